"""The min-cut partitioner: save the cheapest set of forward values from
which the backward can recompute everything else it reads.

Each forward node ``n`` becomes an edge ``n.in -> n.out`` whose capacity is
the bytes saving ``n`` costs; data edges are infinite. The source feeds the
primals and every node that may not be recomputed; every forward value the
backward reads drains to the sink. A minimum cut then names the saved values
(cut edges) and the recomputed ones (nodes on the sink side). Recomputed
nodes are duplicated into the backward; the forward itself is unchanged.

    forward: a = mm(x, w); r = relu(a); s = sin(r)       backward reads r and s
    default saves (r, s); min_cut saves a and recomputes r = relu(a), s = sin(r).
"""
from __future__ import annotations

import operator
from dataclasses import replace

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov
import torch.fx as fx

from .._torch import copy_graph, copy_node, lazy_graph_module
from ..ir.records import JointLayout
from ..ir.ops import aliases_input
from .costs import STRICT, may_recompute, node_bytes
from .default import Partition, ancestors, build, default_partition, forward_nodes, is_sym, split_nodes, views_of
from .blocks import inline_calls
from .memory import estimate

# Bytes dominate the cut; recompute count only breaks ties between equal-byte cuts.
BYTE_SCALE = 1 << 20


def save_costs(joint: fx.GraphModule, fw: set) -> dict:
    """Bytes saving each forward node keeps alive; 0 for inputs and their views."""
    cost = {}
    for n in joint.graph.nodes:
        if n not in fw:
            continue
        base = n.args[0] if aliases_input(n) and n.args and isinstance(n.args[0], fx.Node) else None
        if n.op == "placeholder" or is_sym(n):
            cost[n] = 0
        elif base is not None and base in cost:
            cost[n] = cost[base] if cost[base] == 0 else node_bytes(n)
        else:
            cost[n] = node_bytes(n)
    return cost


def flow_graph(joint: fx.GraphModule, fw: set, bw: set, recomputable, saveable) -> nx.DiGraph:
    g = nx.DiGraph()
    cost = save_costs(joint, fw)
    for n in joint.graph.nodes:
        if n not in fw or n.op in ("output", "get_attr"):
            continue
        tuple_valued = isinstance(n.meta.get("val"), (tuple, list))
        no_save = tuple_valued or not saveable(n)
        cap = {} if no_save else {"capacity": cost[n] * BYTE_SCALE}   # no capacity: infinite
        g.add_edge((n, "in"), (n, "out"), **cap)
        if not recomputable(n):
            g.add_edge("source", (n, "in"))
        else:
            g.add_edge("source", (n, "in"), capacity=1)    # recomputing costs a little
        for u in n.users:
            if u in bw:
                g.add_edge((n, "out"), "sink")
            elif u in fw and u.op != "output":
                g.add_edge((n, "out"), (u, "in"))
    g.add_node("sink")
    return g


def choose(joint: fx.GraphModule, fw: set, bw: set, recomputable, saveable=lambda n: True) -> set:
    """The forward nodes to recompute in the backward, by a minimum cut."""
    try:
        graph = flow_graph(joint, fw, bw, recomputable, saveable)
        # Boykov-Kolmogorov: two to three times networkx's default (preflow-push) on a joint's flow
        # graph, and a budget asks for a cut per candidate.
        _, (src_side, _) = nx.minimum_cut(graph, "source", "sink", flow_func=boykov_kolmogorov)
    except nx.NetworkXUnbounded:     # the backward reads a value nothing may save: recompute nothing
        return set()
    recomputed = {n for n in fw if (n, "in") not in src_side and n.op == "call_function"}
    assert all(recomputable(n) for n in recomputed), "a node that may not be recomputed was cut"
    return recomputed


def generations(order: list, bw: set, recomputed: set, gap) -> dict:
    """Per recomputed node, the joint positions of the backward nodes before which a copy of it is
    made (its generations), earliest first. A copy serves the needs from its anchor on, until a need
    comes more than ``gap`` backward nodes after the anchor: that need gets a copy of its own,
    recomputed just before it, so one copy is not kept alive across the backward in between (the
    whole forward recomputed at the backward's start, each layer's values held until that layer's
    gradients). ``gap=None``: one copy, before the first need."""
    pos = {n: i for i, n in enumerate(order)}
    seen, count = 0, []
    for n in order:
        seen += n in bw
        count.append(seen)
    gens: dict[fx.Node, list[int]] = {}
    for n in reversed(order):
        if n not in recomputed:
            continue
        needs = sorted({pos[u] for u in n.users if u in bw} | {a for u in n.users for a in gens.get(u, ())})
        anchors = needs[:1]
        for q in needs[1:]:
            if gap is not None and count[q] - count[anchors[-1]] > gap:
                anchors.append(q)
        if anchors:
            gens[n] = anchors
    return gens


def _serving(anchors: list, q: int) -> int:
    """The generation that serves a need at position ``q``: the last one anchored at or before it."""
    return max(a for a in anchors if a <= q)


def with_recomputation(joint: fx.GraphModule, bw: set, recomputed: set, gap=None):
    """A copy of the joint where backward users of each recomputed node read a duplicate.

    Duplicates sit just before their first backward use, so they live no longer than needed (see
    :func:`generations` for ``gap``). Returns the new joint, its node for each old one, and the
    duplicates.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(copy_graph(g, joint.graph, env))
    order = list(joint.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    gens = generations(order, bw, recomputed, gap)
    copies: dict[tuple, fx.Node] = {}
    for n in order:
        for a in gens.get(n, ()):
            with g.inserting_before(env[order[a]]):
                copies[n, a] = copy_node(g, n, lambda x: copies[x, _serving(gens[x], a)] if x in gens else env[x])
    for n, anchors in gens.items():
        for u in n.users:
            if u in bw:
                env[u].replace_input_with(env[n], copies[n, _serving(anchors, pos[u])])
    # Lazy: a budget schedules dozens of these; only the partition's own graphs are ever compiled.
    return lazy_graph_module(joint, g, type(joint).__name__), env, tuple(copies.values())


def stale_inputs(primals: list, lay: JointLayout, bw: set) -> set:
    """Inputs a recomputation must not read: by the time the backward runs, an
    input may have been updated in place (BatchNorm's running stats, or any input
    the function itself writes: the runtime copies the new value in after the
    forward). Other inputs that require grad cannot be, and those the backward
    reads anyway are no new risk. Views of such inputs are as stale: saved, they
    would cost nothing and hand a recomputation the new values all the same."""
    written = set(lay.mutated)
    return views_of(p for i, p in enumerate(primals) if i in written or (
        i not in set(lay.grad_of) and not any(u in bw for u in p.users)))


def cut_partition(joint: fx.GraphModule, lay: JointLayout, policy="cheap",
                  extra: frozenset = frozenset(), gap=None) -> Partition:
    """The partition the minimum cut names, whatever it saves (see ``min_cut_partition``)."""
    fw, bw, recomputed = cut(joint, lay, policy, extra)
    return recomputing(joint, lay, fw, bw, recomputed, gap)


def cut(joint: fx.GraphModule, lay: JointLayout, policy="cheap", extra: frozenset = frozenset()) -> tuple:
    """``(forward nodes, backward nodes, the forward nodes the minimum cut recomputes)``."""
    fw = forward_nodes(joint, lay)
    primals, _, _, grads = split_nodes(joint, lay)
    bw = ancestors([x for x in grads if x is not None], stop=fw) - fw
    unsafe = stale_inputs(primals, lay, bw)

    def recomputable(n):
        if n.target is operator.getitem:    # unpacking a tuple is recomputable when making the tuple is
            return recomputable(n.args[0])
        return (n in extra or may_recompute(n, policy)) and not any(a in unsafe for a in n.all_input_nodes)

    def saveable(n):
        return policy not in STRICT or n in extra or not recomputable(n)
    return fw, bw, choose(joint, fw, bw, recomputable, saveable)


def recomputing(joint: fx.GraphModule, lay: JointLayout, fw: set, bw: set, recomputed: set, gap=None) -> Partition:
    """The partition that recomputes ``recomputed`` in the backward, scheduled by ``gap``
    (:func:`generations`)."""
    new, env, copies = with_recomputation(joint, bw, recomputed, gap)
    return replace(build(new, lay, {env[n] for n in fw}), recomputed=tuple(c.name for c in copies))


def min_cut_partition(joint: fx.GraphModule, lay: JointLayout, policy="cheap",
                      extra: frozenset = frozenset()) -> Partition:
    """Save the fewest bytes from which the backward can recompute what it reads.

    ``policy`` names which ops may be recomputed (see ``costs.POLICIES``);
    ``extra`` are further nodes a memory budget allows to be recomputed. A strict
    policy (JAX's ``dots_saveable``, ``nothing_saveable``) is honoured as named even
    where it saves more than the default partitioner; otherwise the default's
    partition is kept when the cut would save more.
    """
    joint = inline_calls(joint)     # a block's halves are opaque to the cut: it decides per op
    part = cut_partition(joint, lay, policy, extra)
    if policy in STRICT:
        return part
    # The cut's byte count can differ from the estimate's (views of one base
    # are cut separately); the promise "never more than default" is checked here.
    default = default_partition(joint, lay)
    return part if estimate(part).saved_bytes <= estimate(default).saved_bytes else default
