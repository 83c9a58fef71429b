"""The default partitioner: the forward computes what the forward outputs
need; the backward computes the rest; the forward saves every forward value
the backward reads. Nothing runs in both graphs.

Every partitioner builds its forward and backward graphs out of the joint graph
with :func:`extract`, given which nodes run in the forward and which values it saves."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import FakeTensor, append_node, copy_node, fake_like, lazy_graph_module

from ..ir.ops import RUNS_IN_FORWARD, aliases_input, draws_at_backward, has_side_effect, is_collective, is_random
from ..ir.records import JointLayout


@dataclass(frozen=True)
class Partition:
    forward: fx.GraphModule     # (*primals) -> (*fw_values, *saved_tensors, *saved_symbols)
    backward: fx.GraphModule    # (*saved_tensors, *saved_symbols, *tangents) -> (*grads)
    saved: tuple[str, ...]      # names of saved values, tensors first
    n_saved_tensors: int
    recomputed: tuple[str, ...] = ()   # backward nodes that recompute a forward value

    def __call__(self, joint: fx.GraphModule, lay: JointLayout) -> "Partition":
        """A partition is its own partitioner: one loaded from the disk cache or an artifact is data
        handed to ``Captured.compile(partitioner=part)``, not a closure over it."""
        return self


def split_nodes(joint: fx.GraphModule, lay: JointLayout):
    """Primal and tangent placeholders, forward outputs and grad outputs."""
    ph = placeholders(joint.graph)
    outs = output_values(joint.graph)
    return ph[:lay.n_primals], ph[lay.n_primals:], outs[:lay.n_fw], outs[lay.n_fw:]


def forward_nodes(joint, lay):
    """Nodes the forward must run: what the forward values need, plus symbolic
    sizes of primals (cheap to save; saving them spares saving whole tensors)."""
    primals, tangents, fw_outs, _ = split_nodes(joint, lay)
    tangent_dep = descendants(tangents)
    fw = ancestors(fw_outs) | set(primals)
    # Random ops and checks run in the forward, in eager's order, even when unused (the RNG must advance the same).
    # So do nodes a pass placed there (passes.compact_saved: what the backward reads instead of a larger value).
    # Collectives run where what they make is needed (FSDP's all-gather again in the backward, inputs.fsdp_graph).
    fw |= {n for n in joint.graph.nodes if (is_sym(n) or has_side_effect(n) or n.meta.get(RUNS_IN_FORWARD))
           and n not in tangent_dep and n.op == "call_function" and not draws_at_backward(n) and not is_collective(n)}
    fw = fw | ancestors(fw - set(primals))
    # Unpacking a multi-output op is free; saving its parts beats saving the tuple.
    fw |= {n for n in joint.graph.nodes if n.target is operator.getitem and n.args[0] in fw}
    assert not (fw & tangent_dep), "a forward value depends on a tangent"
    return fw


def build(joint: fx.GraphModule, lay: JointLayout, fw_set: set) -> Partition:
    """Forward and backward graphs for a given set of forward nodes."""
    primals, tangents, fw_outs, grads = split_nodes(joint, lay)
    # Draws from the RNG as it stands at backward() run there even when nothing reads them; so do the
    # backward's collectives (a rank's empty shard of a reduce-scatter still takes part in it).
    bw_draws = [n for n in joint.graph.nodes if draws_at_backward(n) or (
        n not in fw_set and has_side_effect(n) and not is_random(n))]
    bw_set = ancestors([g for g in grads if g is not None] + bw_draws, stop=fw_set) - fw_set
    bw_set |= set(tangents)
    saved = [n for n in joint.graph.nodes if n in fw_set and n.op not in ("output", "get_attr")
             and any(u in bw_set for u in n.users)]
    saved_t = [n for n in saved if not is_sym(n)]
    saved_s = [n for n in saved if is_sym(n)]
    fw_gm = extract(joint, primals, fw_set, [*fw_outs, *saved_t, *saved_s], "Forward")
    bw_gm = extract(joint, [*saved_t, *saved_s, *tangents], bw_set, list(grads), "Backward")
    return Partition(fw_gm, bw_gm, tuple(n.name for n in saved_t + saved_s), len(saved_t))


def default_partition(joint: fx.GraphModule, lay: JointLayout) -> Partition:
    """Save what the backward reads; recompute nothing.

    joint: ``a = mm(x, w); r = relu(a); gr = threshold_backward(t, r, 0); ...``
    forward: ``a = mm(x, w); r = relu(a); return (r, r)``  (output, saved)
    backward: ``gr = threshold_backward(t, r, 0); ...``
    """
    return build(joint, lay, forward_nodes(joint, lay))


# --- graph helpers every partitioner uses

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


def views_of(roots) -> set[fx.Node]:
    """``roots`` and every node that views one of them, transitively: a view op's output, or a part of a
    split's views (``getitem``)."""
    stack = list(roots)
    seen = set(stack)
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen and u.op == "call_function" and u.args and u.args[0] is n \
                    and (aliases_input(u) or u.target is operator.getitem):
                seen.add(u)
                stack.append(u)
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
    for n in inputs:       # (as g.placeholder(n.name) makes them, without its per-argument checks)
        env[n] = p = append_node(g, "placeholder", n.name, n.name, (), {})
        p.meta.update(n.meta)

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
