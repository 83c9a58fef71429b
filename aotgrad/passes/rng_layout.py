"""Random ops draw in the memory order eager draws in.

Dropout runs ``empty_like(x).bernoulli_(p)``: on a transposed or channels-last
``x`` the mask is filled in that layout's memory order. Functionalization
turns the in-place op into ``bernoulli.p``, which fills a contiguous tensor
instead, so the same numbers land at other positions. This pass draws on the
input permuted to a contiguous view, permutes back, and copies to the
contiguous layout the traced graph expects.

    m = bernoulli.p(e, 0.5)          # e: (4, 8) with strides (1, 4)
    ->  m = clone(permute(bernoulli.p(permute(e, [1, 0]), 0.5), [1, 0]), contiguous_format)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.ops import FILLS_CONTIGUOUS

aten = torch.ops.aten


def _memory_order(val) -> list[int] | None:
    """The dimension order that makes ``val`` contiguous, when it is dense but not contiguous."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    try:
        strides, sizes = [int(s) for s in val.stride()], [int(s) for s in val.size()]
    except (TypeError, ValueError):
        return None             # symbolic strides: left as traced
    order = sorted(range(val.dim()), key=lambda d: (-strides[d], -sizes[d]))
    expected, dense = 1, True
    for d in reversed(order):
        dense &= sizes[d] == 1 or strides[d] == expected
        expected *= sizes[d]
    return order if dense and order != list(range(val.dim())) else None


def _order_of(n: fx.Node) -> list[int] | None:
    return _memory_order(n.args[0].meta.get("val")) if n.target in FILLS_CONTIGUOUS and n.args else None


def needs_memory_order(nodes) -> bool:
    """Whether any of ``nodes`` is a contiguous-filling random op on a permuted input."""
    return any(_order_of(n) is not None for n in nodes)


def draw_in_memory_order(gm: fx.GraphModule) -> bool:
    """Rewrite, in place, every contiguous-filling random op on a permuted input; True if any was."""
    changed = False
    for n in list(gm.graph.nodes):
        order = _order_of(n)
        if order is None:
            continue
        inverse = [order.index(d) for d in range(len(order))]
        g = gm.graph
        with g.inserting_before(n):
            src = g.call_function(aten.permute.default, (n.args[0], order))
            drawn = g.call_function(n.target, (src, *n.args[1:]), dict(n.kwargs))
            back = g.call_function(aten.permute.default, (drawn, inverse))
            out = g.call_function(aten.clone.default, (back,), {"memory_format": torch.contiguous_format})
        val = n.args[0].meta["val"]
        src.meta["val"] = val.permute(order)
        drawn.meta.update(n.meta)
        drawn.meta["val"] = n.target(src.meta["val"], *n.args[1:], **n.kwargs)
        back.meta["val"] = drawn.meta["val"].permute(inverse)
        out.meta["val"] = n.meta["val"]
        for new in (src, back, out):
            new.meta["stack_trace"] = n.meta.get("stack_trace")
        n.replace_all_uses_with(out)
        g.erase_node(n)
        changed = True
    return changed
