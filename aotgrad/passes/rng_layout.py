"""Random ops draw in the memory order eager draws in.

Dropout runs ``empty_like(x).bernoulli_(p)``: on a transposed or channels-last
``x`` the mask is filled in that layout's memory order. Functionalization
turns the in-place op into ``bernoulli.p``, which fills a contiguous tensor
instead, so the same numbers land at other positions. This pass draws on the
input permuted to a contiguous view, permutes back, and copies to the
contiguous layout the traced graph expects.

    m = bernoulli.p(e, 0.5)          # e: (4, 8) with strides (1, 4)
    ->  m = clone(permute(bernoulli.p(permute(e, [1, 0]), 0.5), [1, 0]), contiguous_format)

An in-place fill of a view with gaps (``y[:, 1:].normal_()``) is functionalized into
``normal_functional(view)``, which fills a contiguous copy: eager's kernel takes another path
for a non-contiguous tensor (CPU ``normal_`` draws element by element there, in blocks of 16 on
a contiguous one), so other numbers come out and the stream moves by another count. Such a
fill runs eager's in-place op on a tensor with the view's own sizes and strides
(``aotgrad::fill_strided_<op>``, tagged ``nondeterministic_seeded`` like the op it runs).

    n = normal_functional(v)         # v: (4, 7) with strides (8, 1)
    ->  n = clone(aotgrad.fill_strided_normal___default(v))      # dense, as the functional op returns
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import is_non_overlapping_and_dense_or_false
from ..ir.ops import FILLS_CONTIGUOUS, inplace_twin, is_random

aten = torch.ops.aten
_LIB = torch.library.Library("aotgrad", "FRAGMENT")
_strided: dict = {}
FILL_PREFIX = "fill_strided_"   # aotgrad::fill_strided_<in-place op>__<overload>; export refuses it


def _strided_fill(twin):
    """``aotgrad::fill_strided_<op>(self, ...)``: in-place ``twin`` run on a fresh tensor with
    ``self``'s sizes, strides and values, returned in that layout."""
    if twin not in _strided:
        name = f"{FILL_PREFIX}{twin._schema.name.split('::')[-1]}__{twin._overloadname}"
        schema = str(twin._schema)
        _LIB.define(name + schema[schema.index("("):schema.rindex("->")].replace("Tensor(a!) self", "Tensor self")
                    + "-> Tensor", tags=(torch.Tag.nondeterministic_seeded,))

        def like(self):
            return torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device=self.device)

        def fill(self, *args, **kwargs):
            out = like(self).copy_(self)
            twin(out, *args, **kwargs)
            return out
        _LIB.impl(name, fill, "CompositeExplicitAutograd")
        torch.library.register_fake(f"aotgrad::{name}", lambda self, *a, **k: like(self), lib=_LIB)
        _strided[twin] = getattr(torch.ops.aotgrad, name).default
    return _strided[twin]


def _fills_with_gaps(n: fx.Node):
    """The in-place op ``n`` stands for when it fills a copy of a view with gaps (else None)."""
    val = n.args[0].meta.get("val") if is_random(n) and n.args and isinstance(n.args[0], fx.Node) else None
    twin = inplace_twin(n.target) if isinstance(val, torch.Tensor) and val.dim() else None
    if twin is None:
        return None
    try:
        return None if is_non_overlapping_and_dense_or_false(val) else twin
    except (TypeError, ValueError):
        return None             # symbolic strides: left as traced


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
    """Whether any of ``nodes`` is a contiguous-filling random op on a permuted input, or the
    functional form of an in-place fill of a view with gaps."""
    return any(_order_of(n) is not None or _fills_with_gaps(n) is not None for n in nodes)


def _fill_in_layout(gm: fx.GraphModule, n: fx.Node, twin) -> None:
    g = gm.graph
    with g.inserting_before(n):
        drawn = g.call_function(_strided_fill(twin), n.args, dict(n.kwargs))
        out = g.call_function(aten.clone.default, (drawn,))
    drawn.meta.update(n.meta)
    val = n.args[0].meta["val"]
    drawn.meta["val"] = val.new_empty_strided(val.size(), val.stride())
    out.meta["val"], out.meta["stack_trace"] = drawn.meta["val"].clone(), n.meta.get("stack_trace")
    n.replace_all_uses_with(out)
    g.erase_node(n)


def draw_in_memory_order(gm: fx.GraphModule) -> bool:
    """Rewrite, in place, every contiguous-filling random op on a permuted input; True if any was."""
    changed = False
    for n in list(gm.graph.nodes):
        twin = _fills_with_gaps(n)
        if twin is not None:
            _fill_in_layout(gm, n, twin)
            changed = True
            continue
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
