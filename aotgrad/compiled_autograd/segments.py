"""Split a captured backward at its opaque Python calls; compile each ATen run.

A graph compiler such as Inductor takes tensors and sizes, not hooks or
autograd ``ctx`` objects, and cannot lower a call into user Python. So the
captured graph runs as a plan: maximal runs of consecutive ATen nodes become
subgraphs handed to the compiler; the nodes between them (opaque calls and
the ``getitem``s unpacking their results) run as plain Python calls.

    before: mm, t, call_hook(h, t), getitem, mul, accumulate_grad(w, mul)
    after:  [segment(mm, t)], call_hook, getitem, [segment(mul)], accumulate_grad
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch import OpOverload
from . import opaque


def _compilable(node: fx.Node, run: list) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:   # unpacking a multi-output ATen op of this run
        return isinstance(node.args[0], fx.Node) and node.args[0] in run
    return isinstance(node.target, OpOverload)


def _runs(nodes):
    """Group the body nodes in order: lists of compilable nodes, or single Python nodes.

    Setting ``.grad`` does not end a run: only user Python could see it, so it is
    done right after the run's segment (before the next Python call).
    """
    groups, current, deferred = [], [], []
    for n in nodes:
        if _compilable(n, current):
            current.append(n)
            continue
        if current and n.target is opaque.set_grad:
            deferred.append(n)
            continue
        if current:
            groups.append(current)
            groups.extend(deferred)
            current, deferred = [], []
        groups.append(n)
    if current:
        groups.append(current)
        groups.extend(deferred)
    return groups


def _subgraph(run: list, compile_fn):
    inside = set(run)
    inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta["val"] = a.meta.get("val")
    for n in run:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(torch.nn.Module(), graph, "CompiledAutogradSegment")
    return compile_fn(gm, [a.meta.get("val") for a in inputs]), inputs, outputs


class SegmentedBackward:
    """Runs a captured backward: compiled ATen segments, Python calls between them."""

    def __init__(self, gm: fx.GraphModule, compile_fn):
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = nodes[-1]
        assert self.output.op == "output"
        body = [n for n in nodes if n.op not in ("placeholder", "output")]
        self.plan = [(_subgraph(g, compile_fn) if isinstance(g, list) else g) for g in _runs(body)]
        self.segments = sum(isinstance(step, tuple) for step in self.plan)

    def __call__(self, *args):
        env = dict(zip(self.placeholders, args))
        load = lambda a: env[a]  # noqa: E731
        for step in self.plan:
            if isinstance(step, fx.Node):
                env[step] = step.target(*fx.map_arg(step.args, load), **fx.map_arg(step.kwargs, load))
                continue
            compiled, inputs, outputs = step
            values = compiled(*[env[a] for a in inputs])
            env.update(zip(outputs, values))
        return fx.map_arg(self.output.args[0], load)
