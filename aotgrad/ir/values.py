"""Graph values (node ``meta["val"]``) as data, and back as fake tensors when asked.

A stored graph keeps each node's value as a :class:`TensorMeta` (sizes, strides and
offset as ints or as text over the shape environment's symbols), a symbolic int as
:class:`SymText`, tuples of those, or ``None``; and each symbol's example value. A loaded
graph gets its stack traces back at once, its fake values only when :func:`with_values`
is called (memory estimates, a partitioner, ``explain``): making a fake mode imports
Dynamo, which costs seconds a cache hit should not pay. The graphs of one stored entry
share a :class:`FakeValues`, so their symbols are the same objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .._torch import backed_symbols

STORED = "aotgrad_stored_val"       # node.meta key: the value as data, until with_values rebuilds it
VALUES = "aotgrad_values"           # gm.meta key: the FakeValues that rebuilds this graph's values (a stored one)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple                    # ints, or sympy text over symbols
    stride: tuple
    offset: int | str
    dtype: torch.dtype
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class SymText:
    expr: str


def _functions() -> dict:
    from .._torch import sympy_functions as fns
    return {k: v for k, v in vars(fns).items() if isinstance(v, type) and issubclass(v, sympy.Basic)}


def _size(s, hints: dict):
    """An int, or the text of a symbolic size (recording each symbol's example value in ``hints``)."""
    if not isinstance(s, torch.SymInt):
        return int(s)
    expr = s.node.expr
    if expr.is_number:
        return int(expr)
    known = _functions()
    if any(type(f).__name__ not in known for f in expr.atoms(sympy.Function)):
        raise ValueError(f"size {expr} uses a function a stored graph cannot name")
    backed = backed_symbols(s.node.shape_env)
    for sym in expr.free_symbols:
        if sym not in backed:
            raise ValueError(f"size {expr} depends on data (unbacked symbol {sym})")
        hints[str(sym)] = int(backed[sym])
    return str(expr)


def value_out(v, hints: dict):
    """``v`` (a node's ``meta["val"]``) as data, or None when it is not a tensor, size or tuple of them."""
    try:
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(_size(s, hints) for s in v.shape), tuple(_size(s, hints) for s in v.stride()),
                              _size(v.storage_offset(), hints), v.dtype, str(v.device), v.requires_grad)
        if isinstance(v, torch.SymInt):
            return SymText(str(_size(v, hints)))
        if isinstance(v, (int, float, bool)):
            return v
        if isinstance(v, (tuple, list)):
            return type(v)(value_out(x, hints) for x in v)
    except (ValueError, TypeError):     # TypeError: a size sympy cannot name as an int (a nested tensor's)
        return None
    return None


class FakeValues:
    """Fake tensors for stored values, in one fake mode made on first use."""

    def __init__(self, hints: dict, unbacked: bool = False):
        self.hints = dict(hints)
        self.unbacked = unbacked    # a shape environment even without symbols: item() gives an unbacked number
        self._mode = None
        self._symbols: dict = {}

    def mode(self):
        if self._mode is None:
            from .._torch import FakeTensorMode
            shape_env = self._shape_env() if self.hints or self.unbacked else None
            self._mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True,
                                        static_shapes=not self.hints)
        return self._mode

    def _shape_env(self):
        from .._torch import dynamo_source
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
        env = ShapeEnv(duck_shape=False)     # stored symbols stay distinct even where their examples agree
        for name, hint in sorted(self.hints.items()):
            self._symbols[name] = env.create_symbol(hint, dynamo_source().ConstantSource(f"stored_{name}"), DimDynamic.DYNAMIC,
                                                    do_not_specialize_zero_one=True)
        return env

    def _int(self, s):
        if isinstance(s, int):
            return s
        env = self.mode().shape_env
        expr = sympy.sympify(s, locals={**_functions(), **self._symbols})
        hint = int(expr.xreplace({self._symbols[k]: v for k, v in self.hints.items()}))
        return env.create_symintnode(expr, hint=hint)

    def rebuild(self, data):
        if isinstance(data, TensorMeta):
            shape, stride = [self._int(s) for s in data.shape], [self._int(s) for s in data.stride]
            offset = self._int(data.offset)
            if offset == 0 and all(type(v) is int for v in (*shape, *stride)):     # no dispatch: a warm start
                from .._torch import fresh_fakes                                    # rebuilds hundreds of these
                t = fresh_fakes(self.mode(), [(shape, stride, data.dtype, torch.device(data.device))])[0]
                return t.requires_grad_(data.requires_grad) if data.requires_grad else t
            with self.mode():
                t = torch.empty_strided(shape, stride, dtype=data.dtype, device=data.device)
                if data.offset != 0:
                    extent = offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1
                    t = torch.empty(extent, dtype=data.dtype, device=data.device).as_strided(shape, stride, offset)
            return t.requires_grad_(data.requires_grad) if data.requires_grad else t
        if isinstance(data, SymText):
            return self._int(data.expr)
        if isinstance(data, (tuple, list)):
            return type(data)(self.rebuild(x) for x in data)
        return data


def keep(gm, values: FakeValues) -> None:
    """Remember which ``FakeValues`` rebuilds ``gm``'s stored values."""
    gm.meta[VALUES] = values


def with_values(gm):
    """``gm`` with every stored node value rebuilt as a fake value (once); a traced graph is returned as is."""
    values = gm.meta.get(VALUES) if gm is not None else None
    if values is None:
        return gm
    for n in gm.graph.nodes:
        if STORED in n.meta:
            stored = n.meta.pop(STORED)
            if stored is not None:
                n.meta["val"] = values.rebuild(stored)
    del gm.meta[VALUES]
    return gm
