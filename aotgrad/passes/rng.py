"""A random op that replays a draw reads the first draw's value.

Each random node carries the RNG position it draws at
(:mod:`aotgrad.passes.rng_positions`). Two nodes at one position are one draw
made twice from the same state: ``torch.utils.checkpoint`` recomputing its
region in the backward after restoring the RNG, or code after a
``torch.random.fork_rng`` block repeating what the block drew. The later node
is replaced by the first, so the compiled program draws each number once, in
eager's order, and the partitioner saves the forward's mask for the backward.
A replay that would not give the same numbers (another operator, shape or
input from the same state) is refused. A pass that ends with the stream
rewound restores the state as eager does (:mod:`aotgrad.passes.rng_rewind`),
and masks are drawn in the memory order eager fills them in
(:mod:`aotgrad.passes.rng_layout`).

    fw: m = bernoulli(e, 0.3)  @(cpu, fw, 0)  ...  bw: m2 = bernoulli(e2, 0.3)  @(cpu, fw, 0); y = mul(g, m2)
    ->  fw: m = bernoulli(e, 0.3)  ...  bw: y = mul(g, m)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.ops import RNG_META, SHAPE_ONLY, is_random
from ..errors import UnsupportedError
from .cleanup import _copy, _drop_dead
from .rng_layout import draw_in_memory_order
from .rng_positions import ENDS, PHASE
from .rng_rewind import restore_after


class _Values:
    """Numbers naming what a node computes: equal numbers, equal values (hash-consing)."""

    def __init__(self):
        self.of: dict[fx.Node, int] = {}
        self.ids: dict = {}

    def key(self, n: fx.Node):
        """What ``n`` computes from: operator, argument values and constants."""
        if n.op != "call_function":
            return (n.op, n)
        shape_only = n.target in SHAPE_ONLY
        args = tuple(self._arg(a, shape_only) for a in n.args)
        kwargs = tuple(sorted((k, self._arg(v, shape_only)) for k, v in n.kwargs.items()))
        return (n.target, args, kwargs, n.meta.get(RNG_META))

    def _arg(self, a, shape_only):
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if shape_only and isinstance(val, torch.Tensor):
                return ("like", tuple(str(d) for d in val.shape), val.dtype, str(val.device))
            return ("node", self.of[a])
        if isinstance(a, (list, tuple)):
            return tuple(self._arg(x, shape_only) for x in a)
        return a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)

    def assign(self, n: fx.Node) -> None:
        self.of[n] = self.ids.setdefault(self.key(n), len(self.ids))


def _where(n: fx.Node) -> str | None:
    trace = n.meta.get("stack_trace")
    return trace.strip().splitlines()[-1].strip() if trace else None


def share_recomputed_randomness(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every replayed draw by the first draw at its RNG position, leave the stream where
    eager leaves it, and draw in eager's memory order (see the module docstring)."""
    if not any(is_random(n) for n in gm.graph.nodes):
        return gm
    gm = _copy(gm)
    first = _share_replays(gm.graph)
    _leave_stream_as_eager(gm.graph, first, gm.meta.get(ENDS, {}))
    draw_in_memory_order(gm)
    _drop_dead(gm.graph)
    gm.recompile()
    return gm


def _share_replays(graph: fx.Graph) -> dict:
    """Erase replayed draws; return the first draw at each RNG position."""
    values, first = _Values(), {}
    for n in list(graph.nodes):
        at = n.meta.get(RNG_META) if is_random(n) else None
        prior = first.setdefault(at, n) if at is not None else n
        if prior is n:
            if at is not None:
                _refuse_unknown_state(n, at)
            values.assign(n)
            continue
        if values.key(n) != values.key(prior):
            raise UnsupportedError(
                f"{n.target} draws from an RNG state that {prior.target} already drew from, with another "
                "operator, shape or input (a torch.utils.checkpoint region that recomputes differently, or "
                "code after torch.random.fork_rng drawing differently); the compiled graph cannot replay "
                "that state", user_line=_where(n))
        n.replace_all_uses_with(prior)
        values.of[n] = values.of[prior]
        graph.erase_node(n)
    return first


def _refuse_unknown_state(n: fx.Node, at) -> None:
    """A first draw at a forward position made during the backward reads a forward state the
    forward never drew from (a checkpoint region that draws more when recomputed)."""
    if at[1] == "fw" and n.meta.get(PHASE) == "bw":
        raise UnsupportedError(
            f"the backward draws random numbers ({n.target}) from a restored forward RNG state the forward "
            "never drew them from (a torch.utils.checkpoint region that recomputes differently); the "
            "compiled graph cannot reproduce them", user_line=_where(n))


def _leave_stream_as_eager(graph: fx.Graph, first: dict, ends: dict) -> None:
    """Each pass must leave the stream where eager leaves it: a pass that ends rewound
    (``fork_rng`` around its last draws) gets its state saved and restored."""
    for (dev, phase), (epoch, index) in ends.items():
        drawn = [n for (d, e, _), n in first.items() if d == dev and e == phase]
        if epoch != phase:
            raise UnsupportedError(
                f"the backward leaves the {dev} RNG state at a restored forward state (set_rng_state in a "
                "custom backward?); the compiled graph cannot reproduce that",
                user_line=_where(drawn[-1]) if drawn else None)
        past = [n for n in drawn if n.meta[RNG_META][2] >= index]
        if past:
            restore_after(graph, past[0], drawn[-1], dev, phase)
