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

from ..ir.ops import RNG_CALL, RNG_META, SHAPE_ONLY, is_random
from ..errors import UnsupportedError
from .cleanup import drop_dead, copy_module
from .rng_layout import draw_in_memory_order, needs_memory_order
from .rng_positions import ENDS, PHASE
from .rng_rewind import restore_after


aten = torch.ops.aten
# Ops whose result holds their first argument's values, whatever else they change.
SAME_VALUE = {aten.detach.default, aten.alias.default, aten.clone.default}


class _Values:
    """Numbers naming what a node computes: equal numbers, equal values (hash-consing),
    computed on demand for the nodes a replay check reaches."""

    def __init__(self):
        self.of: dict[fx.Node, int] = {}
        self.ids: dict = {}

    def id_of(self, root: fx.Node) -> int:
        stack = [root]
        while stack:
            n = stack[-1]
            if n in self.of:
                stack.pop()
                continue
            shape_only = n.target in SHAPE_ONLY
            deps = [a for a in n.all_input_nodes if a not in self.of
                    and not (shape_only and isinstance(a.meta.get("val"), torch.Tensor))]
            if deps:
                stack.extend(deps)
                continue
            stack.pop()
            if n.target in SAME_VALUE:          # a checkpoint's saved value comes back detached
                self.of[n] = self.of[n.args[0]]
                continue
            self.of[n] = self.ids.setdefault(self._key(n, shape_only), len(self.ids))
        return self.of[root]

    def _key(self, n: fx.Node, shape_only: bool):
        """What ``n`` computes from: operator, argument values, constants, RNG position."""
        if n.op != "call_function":
            return (n.op, n)
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


def _where(n: fx.Node) -> str | None:
    trace = n.meta.get("stack_trace")
    return trace.strip().splitlines()[-1].strip() if trace else None


def share_recomputed_randomness(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every replayed draw by the first draw at its RNG position, leave the stream where
    eager leaves it, and draw in eager's memory order (see the module docstring)."""
    drawn = [n for n in gm.graph.nodes if is_random(n)]
    replays = replays_or_rewinds(positions(drawn), gm.meta.get(ENDS, {}))
    if not (replays or needs_memory_order(drawn)):
        return gm
    # block_graph.inline_blocks calls no half that draws where draws replay or the stream rewinds.
    assert not (replays and any(RNG_CALL in n.meta for n in drawn)), "a drawing block half is called in a replay"
    gm = copy_module(gm)
    first = _share_replays(gm.graph)
    _leave_stream_as_eager(gm.graph, first, gm.meta.get(ENDS, {}))
    draw_in_memory_order(gm)
    drop_dead(gm.graph)
    gm.recompile()
    return gm


def positions(drawn) -> list:
    """The stream position of each draw of random nodes ``drawn``: one per op, one per draw of a call
    of a block's half (its ``RNG_CALL``), None where unknown."""
    return [at for n in drawn for at in ([p for p, _ in n.meta[RNG_CALL]] if RNG_CALL in n.meta
                                         else [n.meta.get(RNG_META)])]


def replays_or_rewinds(at: list, ends: dict) -> bool:
    """Whether draws at positions ``at`` (a graph whose passes end at ``ends``) replay one another
    (two draws at one position) or leave the stream rewound: then eager's numbers need
    :func:`share_recomputed_randomness` to rewrite the draws."""
    return len(set(at)) < len(at) or _rewound(at, ends)


def _rewound(at: list, ends: dict) -> bool:
    """Whether some pass ends before its last draw, or at another pass's position."""
    return any(epoch != phase or any(t is not None and t[0] == dev and t[1] == phase and t[2] >= index for t in at)
               for (dev, phase), (epoch, index) in ends.items())


def _share_replays(graph: fx.Graph) -> dict:
    """Erase replayed draws; return the first draw at each RNG position."""
    values, first = _Values(), {}
    for n in [n for n in graph.nodes if is_random(n)]:
        at = n.meta.get(RNG_META)
        prior = first.setdefault(at, n) if at is not None else n
        if prior is n:
            if at is not None:
                _refuse_unknown_state(n, at)
            continue
        if values.id_of(n) != values.id_of(prior):
            raise UnsupportedError(
                f"{n.target} draws from an RNG state that {prior.target} already drew from, with another "
                "operator, shape or input (a torch.utils.checkpoint region that recomputes differently, or "
                "code after torch.random.fork_rng drawing differently); the compiled graph cannot replay "
                "that state", user_line=_where(n))
        n.replace_all_uses_with(prior)
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
