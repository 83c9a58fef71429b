"""Random ops replayed by the backward read the forward's values.

``torch.utils.checkpoint`` recomputes its region during the backward and
restores the RNG state first, so eager's recomputed dropout mask equals the
forward's. Traced with fake tensors, that restore does nothing, and the
recomputation would draw a fresh mask. This pass pairs each random op traced
during the backward with the forward random op it replays (same operator,
shape and non-tensor arguments, in order) and makes the backward use the
forward's value, which the partitioner then saves.

    fw: m = bernoulli(e, 0.3) ... bw: m2 = bernoulli(e2, 0.3); y = mul(g, m2)
    ->  fw: m = bernoulli(e, 0.3) ... bw: y = mul(g, m)
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.ops import is_random
from ..errors import UnsupportedError
from .cleanup import _copy, _drop_dead


def _signature(n: fx.Node):
    val = n.meta.get("val")
    consts = tuple(a for a in n.args if not isinstance(a, fx.Node))
    return n.target, tuple(getattr(val, "shape", ())), consts, tuple(sorted(n.kwargs.items(), key=str))


def _backward_start(g: fx.Graph, n_tangents: int) -> int:
    """Index of the first node that reads a tangent: everything after it was traced by autograd.grad."""
    nodes = list(g.nodes)
    tangents = [n for n in nodes if n.op == "placeholder"][-n_tangents:] if n_tangents else []
    users = [nodes.index(u) for t in tangents for u in t.users]
    return min(users) if users else len(nodes)


def share_recomputed_randomness(gm: fx.GraphModule, n_tangents: int) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    start = _backward_start(gm.graph, n_tangents)
    if not any(is_random(n) for n in nodes[start:]):
        return gm
    gm = _copy(gm)
    nodes = list(gm.graph.nodes)
    forward = [n for n in nodes[:start] if is_random(n)]
    used = 0
    for n in nodes[start:]:
        if not is_random(n):
            continue
        sig = _signature(n)
        match = next((k for k in range(used, len(forward)) if _signature(forward[k]) == sig), None)
        if match is None:
            raise UnsupportedError(f"the backward draws random numbers ({n.target}) that replay no forward "
                                   "random op; its result would differ from eager")
        n.replace_all_uses_with(forward[match])
        used = match + 1
    _drop_dead(gm.graph)
    gm.recompile()
    return gm
