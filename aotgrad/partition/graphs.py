"""Build forward and backward graphs out of a joint graph, given which
nodes run in the forward and which values it saves."""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import FakeTensor, fake_like, lazy_graph_module


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
    examples: set = set()
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = _own_example(dict(n.meta), examples)

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:            # constants are copied into every graph that reads them
            assert a.op == "get_attr", f"{a} is neither an input of {name} nor computed in it"
            env[a] = g.node_copy(a)
        return env[a]

    for n in joint.graph.nodes:
        if n in nodes and n not in env and n.op not in ("placeholder", "output", "get_attr"):
            env[n] = g.node_copy(n, lookup)
    g.output(tuple(lookup(o) if isinstance(o, fx.Node) else o for o in outputs))
    # Lazy: the backend compiles the graph itself; fx's Python code is written only if someone reads it.
    return lazy_graph_module(joint, g, name)


def _own_example(meta: dict, seen: set) -> dict:
    """``meta`` with a value of its own when an earlier placeholder has the same value object.

    Copies of one repeated block's template share their nodes' values; a compiler that retraces
    with the placeholders' values as examples (Inductor, any ``make_fx``-based backend) maps
    inputs to placeholders by object, and would read one input wherever the other is used."""
    val = meta.get("val")
    if isinstance(val, FakeTensor):
        if id(val) in seen:
            meta["val"] = val = fake_like(val)
        seen.add(id(val))
    return meta
