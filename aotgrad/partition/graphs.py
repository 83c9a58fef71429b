"""Build forward and backward graphs out of a joint graph, given which
nodes run in the forward and which values it saves."""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import FakeTensor, copy_node, fake_like, lazy_graph_module


def placeholders(g: fx.Graph) -> list[fx.Node]:
    return [n for n in g.nodes if n.op == "placeholder"]


def output_values(g: fx.Graph) -> list:
    return list(g.output_node().args[0])


def ancestors(roots, stop=frozenset()) -> set[fx.Node]:
    seen, stack = set(), [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            stack.extend(n.all_input_nodes)
    return seen


def descendants(roots) -> set[fx.Node]:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def is_sym(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def extract(joint: fx.GraphModule, inputs: list[fx.Node], nodes: set[fx.Node],
            outputs: list, name: str) -> fx.GraphModule:
    """A graph with ``inputs`` as placeholders computing ``outputs`` from ``nodes``.

    Nodes are copied in the joint's order; ``None`` outputs stay ``None``.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:            # constants are copied into every graph that reads them
            assert a.op == "get_attr", f"{a} is neither an input of {name} nor computed in it"
            env[a] = copy_node(g, a)
        return env[a]

    for n in joint.graph.nodes:
        if n in nodes and n not in env and n.op not in ("placeholder", "output", "get_attr"):
            env[n] = copy_node(g, n, lookup)
    g.output(tuple(lookup(o) if isinstance(o, fx.Node) else o for o in outputs))
    # Lazy: the backend compiles the graph itself; fx's Python code is written only if someone reads it.
    return lazy_graph_module(joint, g, name)


def distinct_examples(values: list) -> list:
    """``values`` with every fake tensor that appeared earlier in the list replaced by a new one
    of the same layout.

    Copies of one repeated block's template share their nodes' values (so do the placeholders of
    the graphs :func:`extract` makes); a compiler that retraces with the placeholders' values as
    examples (Inductor, any ``make_fx``-based backend) maps inputs to placeholders by object, and
    would read one input wherever the other is used."""
    seen: set = set()
    out = []
    for v in values:
        if isinstance(v, FakeTensor) and id(v) in seen:
            v = fake_like(v)
        seen.add(id(v))
        out.append(v)
    return out
