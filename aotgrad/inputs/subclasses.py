"""Traceable wrapper subclasses (``__tensor_flatten__``/``__tensor_unflatten__`` with their own
``__torch_dispatch__``: TwoTensor, float8 training tensors) as the plain tensors they hold.

The graph never sees a subclass. Each subclass input becomes its inner tensors (recursively, a
subclass nested in a subclass too), and the traced function rebuilds the subclass from them
(:class:`Unwrap`), so the subclass's ``__torch_dispatch__`` runs while tracing and leaves plain ATen
ops on the inner tensors in the graph. A subclass the function returns becomes its inner tensors as
graph outputs (:func:`as_inner`, a pytree node whose structure holds the subclass's :class:`Meta`),
rebuilt by the output structure's unflatten at run time.

Both directions are autograd Functions (:class:`_Flatten`, :class:`_Unflatten`), in the trace and at
run time alike: the subclass is the tensor autograd sees (a TwoTensor parameter is the leaf whose
``.grad`` is set), the inner tensors are what the graph differentiates. A gradient of a subclass
input is flattened by the structure it had in the trace (recorded, :attr:`Unwrap.grads`), and
rebuilt as that subclass at run time, as eager gives it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import torch

from .._torch import nested_int, nested_int_of, pytree, tie_nested_int, traceable_subclass
from ..errors import UnsupportedError
from ..ir.descriptors import InputDesc


@dataclass(frozen=True, eq=False)
class Meta:
    """What rebuilding one subclass value takes: its class, its flatten context, the names of its
    inner values (each a plain tensor, ``None``; a nested subclass's ``Meta``; or an :class:`Opaque`
    object the class flattens beside its tensors, DTensor's device mesh), and its outer size and stride.
    ``ties``: per key, the nested int tied to that inner tensor (a jagged nested tensor's offsets:
    its outer size holds it as the ragged size) or None; the trace ties it to the inner tensor's fake,
    so the subclass rebuilt there has the ragged size it had, a constant, and not a fresh symbol."""
    cls: type
    ctx: object
    keys: tuple
    inner: tuple
    size: tuple
    stride: tuple
    ties: tuple = ()

    @classmethod
    def of(cls, t: torch.Tensor) -> "Meta":
        keys, ctx = t.__tensor_flatten__()
        inner = tuple(_inner(getattr(t, k)) for k in keys)
        size, stride = tuple(t.size()), tuple(t.stride())
        ties = ()
        if any(nested_int(v) for v in size):
            ties = tuple(nested_int_of(getattr(t, k)) if m is None else None for k, m in zip(keys, inner))
        first = getattr(t, keys[0]) if keys else None
        if isinstance(first, torch.Tensor) and str((size, stride)) == str((tuple(first.size()), tuple(first.stride()))):
            size = stride = None    # its first inner tensor's (symbolic where that is), rebuilt from it
        return cls(type(t), ctx, tuple(keys), inner, size, stride, ties)

    @property
    def n(self) -> int:
        return sum(1 if m is None else m.n for m in self.inner)

    def leaves(self, t) -> list:
        out = []
        for k, m in zip(self.keys, self.inner):
            x = getattr(t, k)
            out += [x] if m is None else m.leaves(x)
        return out

    def names(self, name: str) -> list:
        """How each leaf is named: ``weight.a``, ``x.a.b``."""
        out = []
        for k, m in zip(self.keys, self.inner):
            out += [f"{name}.{k}"] if m is None else m.names(f"{name}.{k}")
        return out

    def build(self, leaves) -> torch.Tensor:
        """The subclass value from an iterator of its leaves."""
        inner = {k: next(leaves) if m is None else m.build(leaves) for k, m in zip(self.keys, self.inner)}
        for k, n in zip(self.keys, self.ties):
            if n is not None:
                tie_nested_int(inner[k], n)
        if self.size is None:       # symbolic when traced: its first inner tensor's
            first = inner[self.keys[0]]
            return self.cls.__tensor_unflatten__(inner, self.ctx, first.size(), first.stride())
        return self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)

    def why(self, t, name: str) -> str | None:
        """Why ``t`` cannot be passed where this subclass was captured (None where it can)."""
        if type(t) is not self.cls:
            return f"{name} was a {self.cls.__name__} when captured, now a {type(t).__name__}"
        keys, ctx = t.__tensor_flatten__()
        if tuple(keys) != self.keys or not _same(ctx, self.ctx):
            return (f"{name}, a {self.cls.__name__}, flattens to {list(keys)} with context {ctx!r}; when captured "
                    f"to {list(self.keys)} with context {self.ctx!r}")
        if self.static and _layout(t.size(), t.stride()) != _layout(self.size, self.stride):
            return (f"{name}, a {self.cls.__name__}, has size {tuple(t.size())} and stride {tuple(t.stride())}; "
                    f"when captured {self.size} and {self.stride}")
        first = getattr(t, self.keys[0]) if self.size is None else None
        if first is not None and (t.size(), t.stride()) != (first.size(), first.stride()):
            return (f"{name}, a {self.cls.__name__}, has size {tuple(t.size())} and stride {tuple(t.stride())}, "
                    f"not its {self.keys[0]}'s {tuple(first.size())} and {tuple(first.stride())} as when captured")
        for k, m in zip(self.keys, self.inner):
            x = getattr(t, k)
            why = m.why(x, f"{name}.{k}") if m is not None else (
                f"{name}.{k} was a plain tensor when captured, now a {type(x).__name__}"
                if traceable_subclass(x) else None)
            if why:
                return why
        return None

    def gradient(self, grads):
        """The subclass gradient from its leaves' gradients (at run time)."""
        return self.build(iter(grads))

    def differentiable(self, t) -> list:
        """Per leaf, whether it has values to differentiate."""
        return [_differentiable(x, n) for x, n in zip(self.leaves(t), self.names(""))]

    def examples(self, t, rg: bool) -> list:
        out = [x.detach().requires_grad_(rg and d) for x, d in zip(self.leaves(t), self.differentiable(t))]
        if any(n is not None for n in self.ties):      # a nested int times a symbolic stride cannot be
            for x in out:           # formed: only the leading (collapsed ragged) dimension may vary
                x._dynamo_static_indices = set(range(1, x.dim()))
        return out

    def descs(self, d) -> list:
        return [type(d)(n) for n in self.names(d.name)]

    @property
    def static(self) -> bool:
        """Sizes and strides all ints (a nested int is its inner tensor's identity, no size to compare)."""
        return self.size is not None and all(type(v) is int or nested_int(v) for v in (*self.size, *self.stride))

    def __eq__(self, other) -> bool:      # output structures compare (pytree specs hold a Meta)
        return isinstance(other, Meta) and self.cls is other.cls and self.keys == other.keys and \
            _same(self.ctx, other.ctx) and self.inner == other.inner and \
            (not self.static or _layout(self.size, self.stride) == _layout(other.size, other.stride))

    def __hash__(self) -> int:
        return hash((self.cls, self.keys))

    def __repr__(self) -> str:
        return f"{self.cls.__name__}{list(self.keys)}"


@dataclass(frozen=True, eq=False)
class Opaque:
    """A non-tensor value a subclass flattens among its inner tensors (DTensor's ``device_mesh``): no
    leaf of the graph; the captured object itself is put back, and another one is a mismatch."""
    value: object
    n = 0

    def leaves(self, t) -> list:
        return []

    def names(self, name: str) -> list:
        return []

    def build(self, leaves):
        return self.value

    def why(self, x, name: str) -> str | None:
        return None if _same(x, self.value) else f"{name} is {x!r}, when captured {self.value!r}"

    def __eq__(self, other) -> bool:
        return isinstance(other, Opaque) and _same(self.value, other.value)

    def __hash__(self) -> int:
        return hash(type(self.value))


@dataclass(frozen=True, eq=False)
class RaggedSize:
    """A ragged size Dynamo passes as an argument of its graph (a jagged nested tensor's ``size(1)``:
    a nested int, the identity of its offsets, no number): no leaf of the graph; the trace gets the
    nested int it had when captured, and any nested int may come later (the nested tensor's offsets
    and values are inner tensors, guarded as such)."""
    value: object
    n = 0

    def examples(self, t, rg: bool) -> list:
        return []

    def descs(self, d) -> list:
        return []

    def why(self, t, name: str) -> str | None:
        return None if nested_int(t) else f"{name} was a ragged size (a nested int) when captured, now {t!r}"

    @classmethod
    def of(cls, v) -> "RaggedSize | None":
        hint = v.node.hint if isinstance(v, torch.SymInt) else None
        return cls(v if nested_int(v) else hint) if nested_int(v) or nested_int(hint) else None


def _inner(x):
    """How :class:`Meta` holds one inner value."""
    if traceable_subclass(x):
        return Meta.of(x)
    return None if isinstance(x, torch.Tensor) else Opaque(x)


@dataclass(frozen=True, eq=False)
class Promoted:
    """A plain input whose gradient is a subclass (it met one in an op, so eager's ``.grad`` is that
    subclass). Its graph leaves are the input itself and one *carrier* per leaf of the gradient's
    structure ``grad`` (a zero of that leaf's shape, expanded, never read): the traced function takes
    the input through :class:`_Unflatten`, whose backward hands the subclass gradient's leaves to the
    carriers, and at run time :class:`_Flatten` builds the subclass from the carriers' gradients.
    A leaf's shape in ``like`` is None where it is the input's own (symbolic in a trace with symbolic
    sizes: the carrier gets the input's symbols, and its size at run time)."""
    grad: Meta
    like: tuple         # (shape or None, dtype, device) of each leaf of the gradient

    @property
    def n(self) -> int:
        return 1 + len(self.like)

    def leaves(self, t) -> list:
        return [t, *(torch.zeros((), dtype=d, device=v).expand(t.shape if s is None else s) for s, d, v in self.like)]

    def build(self, leaves):
        value = next(leaves)
        for _ in self.like:
            next(leaves)
        return value

    def gradient(self, grads):
        return self.grad.build(iter(grads[1:]))

    def examples(self, t, rg: bool) -> list:
        return [t, *(c.requires_grad_(rg) for c in self.leaves(t)[1:])]

    def fakes(self, f, fake_mode) -> list:
        """The carriers' fakes beside the input's fake ``f`` (its symbols where a shape is the input's)."""
        with fake_mode:
            return [torch.empty_strided(f.shape if s is None else s, (0,) * len(f.shape if s is None else s),
                                        dtype=d, device=v).requires_grad_() for s, d, v in self.like]

    def descs(self, d) -> list:
        return [d, *(InputDesc(n) for n in self.grad.names(f"{d.name}.grad"))]

    def why(self, t, name: str) -> str | None:
        return f"{name} was a plain tensor when captured, now a {type(t).__name__}" if traceable_subclass(t) else None

    def carried(self, grad, like) -> list:
        """The leaves of ``grad``, which must have the structure the trace gave it and the carriers'
        shapes and dtypes (``like``)."""
        leaves = Meta.of(grad).leaves(grad) if traceable_subclass(grad) and Meta.of(grad) == self.grad else None
        if leaves is None or [(x.shape, x.dtype) for x in leaves] != list(like):
            raise UnsupportedError(f"the gradient of a plain input was a {self.grad} when traced, now a "
                                   f"{type(grad).__name__}: aotgrad fixed its structure at the trace",
                                   user_line=_user_line())
        return leaves

    @classmethod
    def of(cls, grad, x) -> "Promoted":
        """The promotion of plain input ``x`` (a fake) whose gradient in the trace is ``grad``."""
        meta = Meta.of(grad)
        _dynamic_refused(meta, "the gradient of a plain input")
        like = []
        for leaf in meta.leaves(grad):
            own = str(tuple(leaf.shape)) == str(tuple(x.shape))
            if not own and not all(type(v) is int for v in leaf.shape):
                raise UnsupportedError(f"the gradient of a plain input is a {meta.cls.__name__} whose inner tensors "
                                       f"have symbolic sizes {tuple(leaf.shape)} other than the input's: aotgrad "
                                       "cannot size the inputs that carry them; capture with dynamic=False",
                                       user_line=_user_line())
            like.append((None if own else tuple(leaf.shape), leaf.dtype, leaf.device))
        return cls(meta, tuple(like))


class SubclassGradient(UnsupportedError):
    """The joint trace found plain graph inputs (of ``n_inputs``) whose gradient is a subclass:
    ``found`` maps each index to its :class:`Promoted`. ``capture_setup`` traces again with them
    promoted (:func:`promoted`); uncaught, it is the refusal it says."""

    def __init__(self, message: str, found: dict, n_inputs: int, user_line=None):
        super().__init__(message, user_line=user_line)
        self.found, self.n_inputs = found, n_inputs


def promoted(setup, e: SubclassGradient):
    """``setup`` (a ``stages.Setup``) with the inputs ``e`` found as :class:`Promoted`; None where its
    graph inputs are not the ones ``e`` counted (rebased)."""
    if setup.rebase is not None or e.n_inputs != len(setup.real_inputs):
        return None
    sig, old = setup.signature, setup.flat_fn
    unwrap = sig.unwrap or Unwrap((None,) * len(setup.real_inputs), tuple(map(str, setup.input_descs)))
    at, k, metas = {}, 0, list(unwrap.metas)      # graph input index -> the plain flat input it is
    for j, m in enumerate(metas):
        at[k] = j if m is None else None
        k += 1 if m is None else m.n
    if any(at.get(i) is None for i in e.found):
        return None
    for i, p in e.found.items():
        metas[at[i]] = p
    new = replace(unwrap, metas=tuple(metas), grads={})
    real, fakes, descs = [], [], []
    for i, (t, f, d) in enumerate(zip(setup.real_inputs, setup.fake_inputs, setup.input_descs)):
        faked = e.found[i].fakes(f, setup.session.fake_mode) if i in e.found else []
        real += [t, *(faked if t is f else e.found[i].examples(t, True)[1:] if i in e.found else [])]
        fakes += [f, *faked]
        descs += e.found[i].descs(d) if i in e.found else [d]
    flat_fn = new.wrap(getattr(old, "inner", old))
    for k, v in vars(old).items():      # what the frontend set on the function (Dynamo's lifted state)
        vars(flat_fn).setdefault(k, v)
    return replace(setup, signature=replace(sig, unwrap=new), flat_fn=flat_fn, real_inputs=tuple(real),
                   fake_inputs=tuple(fakes), input_descs=tuple(descs))


def _layout(size, stride) -> tuple:
    """Outer size and stride to compare: a nested int stands for any (its offsets are an inner tensor)."""
    return tuple(None if nested_int(v) else v for v in (*size, *stride))


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _differentiable(t: torch.Tensor, name: str = "") -> bool:
    """An inner tensor with values to differentiate: floating, and not a nested tensor's cached
    sequence length, an empty tensor holding it as its shape (``_max_seqlen_tensor``). An empty
    DTensor shard (a rank that holds no rows of an FSDP parameter) is differentiable: every rank's
    graph takes part in the gradient's reduce-scatter."""
    return (t.is_floating_point() or t.is_complex()) and not (
        name.endswith("seqlen_tensor") and any(type(v) is int and v == 0 for v in t.shape))


def _user_line():
    from ..errors import caller_line
    return caller_line()


class _Flatten(torch.autograd.Function):
    """A subclass value -> its leaves (detached: the subclass's own inner tensors are not touched);
    the gradients of the leaves come back as one gradient of ``grad_meta``'s subclass."""

    @staticmethod
    def forward(ctx, meta, grad_meta, t):
        ctx.grad_meta = grad_meta
        ctx.own = meta.leaves(t)
        ctx.diff = meta.differentiable(t) if hasattr(meta, "differentiable") else [_differentiable(x) for x in ctx.own]
        leaves = [x.detach() for x in ctx.own]
        ctx.like = [(x.shape, x.dtype, x.device) for x in leaves]
        ctx.mark_non_differentiable(*[x for x, d in zip(leaves, ctx.diff) if not d])
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return None, None, None
        # a leaf with no gradient (a nested tensor's offsets; autograd hands it zeros): the value's own
        grads = [g if d else o for g, o, d in zip(grads, ctx.own, ctx.diff)]
        grads = [g if g is not None else torch.zeros(s, dtype=d, device=v) for g, (s, d, v) in zip(grads, ctx.like)]
        return None, None, ctx.grad_meta.gradient(grads)


class _Unflatten(torch.autograd.Function):
    """Leaves -> the subclass value; its gradient, a subclass too, comes back as the leaves'
    gradients (``record(meta)`` is told the gradient's structure)."""

    @staticmethod
    def forward(ctx, meta, record, *leaves):
        ctx.meta, ctx.record = meta, record
        ctx.like = [(x.shape, x.dtype) for x in leaves]
        return meta.build(iter(x.detach() for x in leaves))

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None, None) + (None,) * len(ctx.like)
        if isinstance(ctx.meta, Promoted):
            return (None, None, None, *ctx.meta.carried(grad, ctx.like[1:]))
        gm = Meta.of(grad) if traceable_subclass(grad) else None
        leaves = gm.leaves(grad) if gm is not None else None
        if leaves is None or len(leaves) != len(ctx.like) or any(
                g.shape != s or g.dtype != d for g, (s, d) in zip(leaves, ctx.like)):
            raise UnsupportedError(
                f"the gradient of a {ctx.meta.cls.__name__} is a "
                + (type(grad).__name__ if gm is not None else "plain tensor")
                + (f" laid out as {gm}" if gm is not None else "")
                + f", not a {ctx.meta.cls.__name__} of inner tensors like its own ({ctx.meta}): aotgrad "
                "differentiates the inner tensors and cannot map that gradient onto them", user_line=_user_line())
        if ctx.record is not None:
            ctx.record(gm)
        return (None, None, *leaves)


class Inner:
    """A subclass output as its leaves: a pytree node whose structure (its context) is the
    subclass's :class:`Meta` and its ``requires_grad`` and ``is_leaf`` in the trace, so unflattening
    the output structure rebuilds the subclass. One made inside from tensors that require grad is a
    leaf that requires grad (its wrapper's flag; its dispatch differentiates nothing): rebuilt, it
    gets the flag where its leaves do not carry it, as the runtime gives a plain output its own."""
    __slots__ = ("meta", "leaves", "traced")

    def __init__(self, meta, leaves, traced=(False, True)):
        self.meta, self.leaves, self.traced = meta, leaves, traced


def _rebuilt(leaves, context):
    (meta, (rg, leaf)), v = context, _Unflatten.apply(context[0], None, *leaves)
    if not rg or v.requires_grad or not torch.is_grad_enabled():
        return v
    return v.detach().requires_grad_() if leaf else v.detach().requires_grad_().clone()


pytree.register_pytree_node(Inner, lambda v: (list(v.leaves), (v.meta, v.traced)), _rebuilt)


_CALL = threading.local()
"""Per thread: ``traced``, ``(unwrap, {input index: subclass})`` of the running trace's rebuilt
subclass inputs; ``inputs``, the caller's flat inputs of the running compiled call."""


def _dynamic_refused(meta: Meta, what: str) -> None:
    if meta.size is not None and not meta.static:
        raise UnsupportedError(f"{what} is a {meta.cls.__name__} with symbolic outer sizes {meta.size} other than its "
                               "first inner tensor's: rebuilding it at run time needs sizes aotgrad does not compute; "
                               "capture with static shapes (dynamic=False)", user_line=_user_line())
    for m in meta.inner:
        if isinstance(m, Meta):
            _dynamic_refused(m, what)


@dataclass(frozen=True, eq=False)
class Unwrap:
    """How a flat input list holding subclasses becomes the graph's plain inputs: each subclass
    (``metas[i]`` not None) its leaves, in place. ``grads``: input index -> the :class:`Meta` its
    gradient had in the trace (filled by the joint trace)."""
    metas: tuple
    names: tuple
    grads: dict = field(default_factory=dict)
    returned: set = field(default_factory=set)      # inputs returned as they are or viewed (InputOut)

    @classmethod
    def of(cls, tensors, names) -> "Unwrap | None":
        metas = tuple(Meta.of(t) if traceable_subclass(t) else RaggedSize.of(t) for t in tensors)
        return None if all(m is None for m in metas) else cls(metas, tuple(map(str, names)))

    def examples(self, tensors) -> list:
        """The leaves as example inputs: detached, requiring grad where their subclass does."""
        out = []
        for t, m in zip(tensors, self.metas):
            out += [t] if m is None else m.examples(t, getattr(t, "requires_grad", False) and torch.is_grad_enabled())
        return out

    def descs(self, descs) -> list:
        out = []
        for d, m in zip(descs, self.metas):
            out += [d] if m is None else m.descs(d)
        return out

    def graph_inputs(self, flat):
        """``(leaves, None)`` at run time, or ``(None, why)`` where a subclass input changed."""
        if self.returned:
            _CALL.inputs = flat         # what the outputs' InputOuts are
        out = []
        for i, (t, m) in enumerate(zip(flat, self.metas)):
            if m is None:
                if traceable_subclass(t):
                    return None, f"{self.names[i]} was a plain tensor when captured, now a {type(t).__name__}"
                out.append(t)
                continue
            why = m.why(t, self.names[i])
            if why:
                return None, why
            if not isinstance(m, RaggedSize):
                out += _Flatten.apply(m, self.grads.get(i, m), t)
        return out, None

    def wrap(self, flat_fn):
        """``flat_fn`` on the leaves: each subclass rebuilt from its own (its dispatch runs in the trace)."""
        def fn(*leaves):
            it, flat = iter(leaves), []
            for i, m in enumerate(self.metas):
                flat.append(next(it) if m is None else m.value if isinstance(m, RaggedSize) else _Unflatten.apply(
                    m, self._recorder(i), *(next(it) for _ in range(m.n))))
            fn.flat = flat
            before = [(t._version, t.grad_fn, tuple(t.shape), t.stride(), t.storage_offset())
                      if isinstance(m, (Meta, Promoted)) else None for t, m in zip(flat, self.metas)]
            was, _CALL.traced = getattr(_CALL, "traced", None), (self, {
                i: t for i, (t, m) in enumerate(zip(flat, self.metas)) if isinstance(m, Meta)})
            try:
                out = flat_fn(*flat)
            finally:
                _CALL.traced = was
            return put_back(self, flat, before, out)
        fn.__name__, fn.inner = flat_fn.__name__, flat_fn
        state = getattr(flat_fn, "module_state", None)
        if state is not None:
            fn.module_state = lambda leaves: state(fn.flat)
        return fn

    def _recorder(self, i):
        return lambda meta: self.grads.__setitem__(i, meta)


from .subclass_outputs import as_inner, put_back  # noqa: E402  (they build on the above)
