"""What a function traced through subclasses gives back (``inputs.subclasses``): a subclass output as
its inner tensors (:func:`as_inner`), a subclass input returned as it is or viewed (:class:`InputOut`,
a symbolic layout as expressions over the input's own sizes), and what the function did in place to a
subclass input that the graph cannot do to the caller's (:class:`PutBack`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._torch import pytree, traceable_subclass
from ..errors import UnsupportedError
from .subclasses import _CALL, Inner, Meta, _dynamic_refused, _Flatten, _user_line


class InputOut:
    """A subclass input the function returns as it is (``layout`` None) or a view of (``layout``: its
    size, stride and offset): no graph output; at run time the caller's input itself, as eager
    returns the very tensor, or that input viewed by ``as_strided`` (the replay autograd itself uses for
    a subclass's views), so the output is a view of it, as eager's is. A symbolic layout holds sympy
    expressions over the symbols of the input's own size and stride (``binds``: symbol -> position in
    the input's ``(*size, *stride, offset)``), evaluated on the caller's input."""
    __slots__ = ("index", "layout", "binds")

    def __init__(self, index, layout=None, binds=()):
        self.index, self.layout, self.binds = index, layout, binds

    def __eq__(self, other) -> bool:     # output structures compare
        return isinstance(other, InputOut) and (self.index, self.layout) == (other.index, other.layout)

    def __hash__(self) -> int:
        return hash(self.index)

    def __repr__(self) -> str:
        return f"InputOut({self.index}, {self.layout})"

    def value(self):
        t = _CALL.inputs[self.index]
        if self.layout is None:
            return t
        return t.as_strided(*_concrete(self.layout, self.binds, t))


pytree.register_pytree_node(InputOut, lambda v: ([], v), lambda leaves, v: v.value())


def _at(t) -> tuple:
    return (*t.size(), *t.stride(), t.storage_offset())


def _concrete(layout, binds, t) -> tuple:
    """``layout`` (size, stride, offset) with its expressions evaluated on ``t``'s own ``binds``."""
    if not binds:
        return layout
    at = _at(t)
    env = {sym: at[k] for sym, k in binds}
    size, stride, offset = (tuple(v if type(v) is int else int(v.xreplace(env)) for v in part)
                            for part in (layout[0], layout[1], (layout[2],)))
    return size, stride, offset[0]


def _expr(v):
    """An int as it is, a SymInt as its sympy expression."""
    return v if type(v) is int else v.node.expr


def _symbolic_layout(at, layout):
    """``(layout, binds)`` with each symbolic value of ``layout`` a sympy expression over the symbols
    of ``at``, an input's own ``(*size, *stride, offset)``; None where it holds another symbol."""
    binds = {}
    for k, v in enumerate(at):
        e = _expr(v)
        if type(v) is not int and e.is_Symbol:
            binds.setdefault(e, k)
    size, stride, offset = tuple(map(_expr, layout[0])), tuple(map(_expr, layout[1])), _expr(layout[2])
    free = set().union(*(getattr(e, "free_symbols", set()) for e in (*size, *stride, offset)))
    if not free <= binds.keys():
        return None
    return (size, stride, offset), tuple((sym, binds[sym]) for sym in sorted(free, key=str))


def _input_out(v):
    """:class:`InputOut` where ``v`` is a subclass input of the running trace, or a view of one that
    ``as_strided`` on that input makes again (its inner tensors laid out as ``v``'s; a symbolic layout
    in terms of the input's own sizes); else None."""
    unwrap, traced = getattr(_CALL, "traced", None) or (None, {})
    base = v._base if v._is_view() else v
    i = next((i for i, t in traced.items() if t is base), None)
    layout = None if base is v else (tuple(v.size()), tuple(v.stride()), v.storage_offset())
    if i is None:
        return None
    binds = ()
    if layout is not None:
        try:
            again = base.as_strided(*layout)
        except Exception:       # the class has no as_strided (DTensor)
            return None
        meta, was = Meta.of(v), Meta.of(again)
        if meta != was or str([(x.shape, x.stride(), x.storage_offset()) for x in meta.leaves(v)]) != \
                str([(x.shape, x.stride(), x.storage_offset()) for x in was.leaves(again)]):
            return None
        if not all(type(n) is int for n in (*layout[0], *layout[1], layout[2])):
            found = _symbolic_layout(_at(base), layout)
            if found is None:
                return None
            layout, binds = found
    unwrap.returned.add(i)
    return InputOut(i, layout, binds)


def as_inner(out):
    """``out`` with every subclass leaf as an :class:`Inner` of its leaves (through :class:`_Flatten`,
    so the leaves' gradients reach the subclass) or an :class:`InputOut`; ``out`` itself where it holds none."""
    leaves, spec = pytree.tree_flatten(out)
    if not any(traceable_subclass(v) for v in leaves):
        return out
    for k, v in enumerate(leaves):
        if traceable_subclass(v):
            given = _input_out(v)
            if given is not None:
                leaves[k] = given
                continue
            if v._is_view():
                raise UnsupportedError(
                    f"the function returns a view of a {type(v).__name__} made inside it (or of an input, with "
                    "symbolic sizes not its own or a class that has no as_strided): eager's output is a view of that "
                    "subclass, the graph's inner tensors cannot make one; return a copy (.clone()) or the base",
                    user_line=_user_line())
            leaves[k] = _as_output(v, "an output")
    return pytree.tree_unflatten(leaves, spec)


def put_back(unwrap, flat, before, out):
    """``out`` (a flat function's ``Outputs``) with what the function did in place to subclass inputs
    (and promoted plain ones, which the graph takes detached too) that eager's autograd records or that
    changed their layout (``before``: per input of ``unwrap``, its version, grad_fn, size, stride and
    offset before the call): a :class:`PutBack` of the new values (clones, as graph outputs) and
    layouts, done to the caller's inputs after the graph ran."""
    puts, values = [], []
    for i, (t, was) in enumerate(zip(flat, before)):
        if was is None or t._version == was[0]:
            continue
        cls, relaid = type(t).__name__, str((tuple(t.shape), t.stride(), t.storage_offset())) != str(was[2:])
        recorded = t.grad_fn is not was[1]      # autograd recorded it (under no_grad it does not)
        layout = _put_layout(t, was[2:]) if relaid else None
        # (unrecorded, the trace's subclass, no leaf, would get gradients of the old layout)
        if relaid and (layout is None or not recorded and t.requires_grad):
            raise UnsupportedError(f"an in-place change of the size or stride of {unwrap.names[i]}, a {cls} "
                                   "(t_(), unsqueeze_(), resize_()), cannot be replayed on the caller's subclass "
                                   "(inner tensors laid out otherwise, symbolic sizes not its own, or under no_grad "
                                   "while it requires grad): use the out-of-place op", user_line=_user_line())
        if relaid or recorded:
            unwrap.returned.add(i)
            puts.append(_Put(i, layout, recorded))
            if recorded:
                values.append(_as_output(t.clone(), f"{unwrap.names[i]} written in place"))
    if not puts:
        return out
    leaves, specs = zip(*(pytree.tree_flatten(v) for v in values)) if values else ((), ())
    put = type(out)([*out, *(x for part in leaves for x in part)])
    put.spec = pytree.TreeSpec(PutBack, tuple(puts), [out.spec, *specs])
    put.replaced = getattr(out, "replaced", ())
    return put


@dataclass(frozen=True)
class _Put:
    """One subclass input changed in place: ``layout`` ``(layout, binds)`` or None, and whether autograd
    recorded a write to it (its new value is then among the :class:`PutBack`'s values)."""
    index: int
    layout: tuple | None
    recorded: bool


class PutBack:
    """A traced function's output with what it did in place to subclass inputs: at run time each
    input gets its new layout (``as_strided_``, which the subclass's dispatch applies to its inner
    tensors) and, where eager's autograd records the write, ``copy_`` of its new value under grad mode,
    so the caller's subclass has the history eager gives it (the inner tensors' data the epilogue
    already wrote)."""


def _put_back(children, puts):
    values = iter(children[1:])
    for p in puts:
        t = _CALL.inputs[p.index]
        with torch.set_grad_enabled(p.recorded and torch.is_grad_enabled()):
            if p.layout is not None:
                t.as_strided_(*_concrete(*p.layout, t))
            if p.recorded:
                t.copy_(next(values))
    return children[0]


pytree.register_pytree_node(PutBack, lambda v: ([], ()), _put_back)


def _as_output(v, what: str):
    """``v`` as graph outputs: a subclass as an :class:`Inner` of its leaves, a plain tensor as it is."""
    if not traceable_subclass(v):
        return v
    meta = Meta.of(v)
    _dynamic_refused(meta, what)
    return Inner(meta, _Flatten.apply(meta, meta, v), (v.requires_grad, v.is_leaf))


def _put_layout(t, old):
    """``(layout, binds)`` of ``t``'s new layout in terms of its old one (``old``: size, stride, offset),
    where ``as_strided_`` replays it: each inner tensor laid out as ``t``; else None."""
    new = (tuple(t.size()), tuple(t.stride()), t.storage_offset())
    leaves = Meta.of(t).leaves(t) if traceable_subclass(t) else []     # (a promoted plain input: none)
    if any(str((tuple(x.shape), x.stride(), x.storage_offset())) != str(new) for x in leaves):
        return None
    if all(type(v) is int for v in (*new[0], *new[1], new[2])):
        return new, ()
    return _symbolic_layout((*old[0], *old[1], old[2]), new)
