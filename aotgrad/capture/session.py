"""The tracing session: the one place that enters fake mode, the shape
environment, functionalization and the grad mode for tracing.

Everything a trace needs is held as data on :class:`Session`; callers pass a
function and get results back, never a context manager to keep open.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic, ShapeEnv, StatelessSymbolicContext,
)

from .._torch import (
    anomaly_nan_check, known_true, functionalize_has_data_mutation, functionalize_was_storage_changed,
    FakeTensor, FakeTensorMode, FunctionalTensor, FunctionalTensorMode, from_functional_tensor,
    constant_nested_ints, has_own_dispatch, is_functional_tensor, laid_out_as_value, traceable_class, plain_fake,
    pytree, storage_key, symbolic_dispatch, sync, to_functional_tensor, traced_sum, view_meta_sequence,
    _engine_is_caller,
)
from .. import tracing
from ..scoped import look_away
from ..guards import reads
from ..ir.ops import FAKE_LAYOUT_DIFFERS, laid_out_as_kernel, returns_fresh
from ..ir.records import ViewMeta, reached_bytes
from ..runtime import modes
from ..runtime.modes import baked, function_modes
from ..tracing.patches import TRACEABLE
from .block_graph import UnseenUsed
from .stale_views import StaleViews


@dataclass
class Session:
    """Fake mode and shape environment shared by every trace of one capture."""
    dynamic: bool | None
    grad_enabled: bool
    shape_env: ShapeEnv = field(default_factory=ShapeEnv)
    fake_mode: FakeTensorMode | None = None
    baked: tuple = field(default_factory=baked)   # autocast and default dtype when captured (runtime.modes)
    function_modes: tuple | None = field(default_factory=function_modes)    # torch function modes then (None: not checked)

    def __post_init__(self):
        if self.fake_mode is None:
            self.fake_mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True,
                                            static_shapes=self.dynamic is False)
        constant_nested_ints(self.fake_mode)      # a nested tensor made inside (inputs.subclasses)

    @classmethod
    def for_inputs(cls, tensors, dynamic, grad_enabled) -> "Session":
        """Static unless asked for ``dynamic`` or some tensor carries ``mark_dynamic`` hints."""
        hinted = dynamic is None or any(getattr(t, "_dynamo_dynamic_indices", None) for t in tensors)
        return cls(dynamic=True if dynamic else (None if hinted else False), grad_enabled=grad_enabled)

    def fakeify_all(self, tensors, dynamic_dims: dict) -> list:
        """Fake copies of ``tensors`` (``dynamic_dims``: flat index -> dimensions to make symbolic).
        Tensors that share a storage go through ``from_tensor``, whose fakes share one too."""
        keys = [storage_key(t) if isinstance(t, torch.Tensor) else None for t in tensors]
        shared = Counter(k for k in keys if k is not None)
        return [self.fakeify(t, dynamic_dims.get(i, ()), alone=k is not None and shared[k] == 1)
                for i, (t, k) in enumerate(zip(tensors, keys))]

    def fakeify(self, t: torch.Tensor, dynamic_dims=(), alone: bool = False) -> torch.Tensor:
        """A fake copy of ``t``; sizes symbolic where ``dynamic`` or hinted. ``alone``: no other
        input shares ``t``'s storage."""
        if self.dynamic is False:
            fake = plain_fake(self.fake_mode, t) if alone else None
            return fake if fake is not None else self.fake_mode.from_tensor(t)
        dims = set(dynamic_dims) | set(getattr(t, "_dynamo_dynamic_indices", ()))
        if self.dynamic:        # but what torch._dynamo.mark_static marked (a nested tensor's fixed dims)
            dims = set(range(t.dim())) - set(getattr(t, "_dynamo_static_indices", ()))
        ctx = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())])
        return self.fake_mode.from_tensor(t, symbolic_context=ctx)

    @contextlib.contextmanager
    def tracing(self):
        """Fake mode and the captured grad mode, for metadata analysis."""
        with self.fake_mode, torch.set_grad_enabled(self.grad_enabled), traceable_ops(), \
                symbolic_dispatch(self.shape_env):
            yield


@contextlib.contextmanager
def traceable_ops():
    """Settings under which traced graphs run correctly outside the trace, in this thread.

    * effect-only checks become plain nodes (``tracing.patches.PLAIN_EFFECTS``);
    * seeding the global RNG is noted (the capture's ``Trace.seeds``): the graph
      would not repeat it, so capture refuses it when the graph draws random numbers;
    * oneDNN is off, so RNNs trace into plain ATen ops: the fused
      ``mkldnn_rnn_layer`` returns an undefined workspace tensor at run time
      that Python cannot pass back to its backward (a process-wide flag: an
      eager RNN in another thread meanwhile runs PyTorch's plain kernels);
    * ``torch.compiler.is_compiling()`` is True, as under ``torch.export``'s
      tracing, so libraries take their trace-friendly paths (HuggingFace's
      mask helpers skip data-dependent shortcuts when they see it); other
      threads get PyTorch's own answer.
    """
    with TRACEABLE(), tracing.scope(traceable=True):
        yield


def to_functional(t):
    return FunctionalTensor.to_functional(t) if isinstance(t, torch.Tensor) else t


def from_functional(t):
    if isinstance(t, FunctionalTensor):
        sync(t)
        return from_functional_tensor(t.elem)
    return t


class _CheckedFunctionalMode(FunctionalTensorMode):
    """Functionalization that refuses in-place writes to tensors that are not traced values.

    A global tensor or a plain (unregistered) tensor attribute written in place would be
    written for real at every trace and never by the compiled graph.

    ``lines`` maps ``id`` of a watched tensor (the inputs, when ``analyze`` sets ``watched``) whose
    metadata or storage an op changed in place (``t_()``, ``set_()``) to the user's line of the first
    such op: an input's refusal names it. ``written_before_swap``: the same for a watched tensor written
    in place before a ``set_()`` swapped its storage (the caller's old storage must keep that write)."""

    def __init__(self):
        super().__init__()
        self.watched: frozenset = frozenset()
        self.lines: dict = {}
        self.written_before_swap: dict = {}
        self.owners: list = []       # the tensors whose storages a set_() may land in (analyze: the inputs)
        self.anchors: dict = {}      # id of each -> an alias of it, taken at the first set_()
        self.stale = StaleViews()
        self.storages = Storages()   # inputs' storage sizes as resize_storage_bytes_ changes them
        self.numerics = modes.numerics()    # the caller's: what the compiled graph's CUDA kernels run under

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            device = _device(args[0])
            if device is not None:
                return device
        if anomaly_nan_check(func):
            return False        # no values to check: the compiled backward's outputs are checked when it runs
        if func is _RESIZE and _symbolic(args) and not _symbolic_shrink(args):
            from ..errors import UnsupportedError, caller_line
            raise UnsupportedError(
                "resize_() of a tensor with symbolic sizes to more elements, or of a non-contiguous one, cannot be "
                "captured (fake tensors with symbolic sizes cannot resize; torch.compile breaks its graph there): "
                "capture with static shapes (dynamic=False)", user_line=caller_line())
        if func is _RESIZE and _symbolic_shrink(args):
            # Fake tensors with symbolic sizes cannot resize (their sizes are the shape environment's): a
            # contiguous tensor resized to no more elements keeps its storage and offset and takes the new
            # size's contiguous strides, which is as_strided_ (replayed on the caller's tensor like t_()).
            t, size = args[0], list(args[1])
            stride = [1] * len(size)
            for d in range(len(size) - 2, -1, -1):
                stride[d] = stride[d + 1] * size[d + 1]
            return self.__torch_dispatch__(_AS_STRIDED_, (FunctionalTensor,), (t, size, stride, t.storage_offset()),
                                           {})
        if func is _RESIZE_STORAGE:
            return self.storages.resize(args[0], args[1])
        if func is _SET_EMPTY and isinstance(args[0], FunctionalTensor):
            # x.set_(): a fresh empty storage, as set_() onto a fresh empty tensor (functionalization's own
            # writes an empty value into the old storage, which the caller's other views of it hold)
            fresh = self.__torch_dispatch__(_NEW_EMPTY, (FunctionalTensor,), (args[0], [0]), {})
            return self.__torch_dispatch__(_SET, (FunctionalTensor,), (args[0], fresh), {})
        if self.storages.unreadable:
            self.storages.check(func, args, kwargs or {})
        _refuse_other_numerics(func, args, self.numerics)
        for cls in types:
            if has_own_dispatch(cls):
                if traceable_class(cls):   # its own dispatch runs now, on its inner tensors
                    _refuse_constant_requiring_grad(func, args, kwargs)   # (inputs.subclasses)
                    return NotImplemented
                from ..errors import UnsupportedError, caller_line
                raise UnsupportedError(
                    f"{func.__name__} on a {cls.__name__}, a tensor subclass with its own __torch_dispatch__ but "
                    "no __tensor_flatten__/__tensor_unflatten__, inside the captured function: aotgrad traces "
                    "plain tensors and traceable wrapper subclasses only; build it outside, on the compiled "
                    "function's outputs", user_line=caller_line())
        direct = tracing.current().direct
        if direct is not None and direct.unseen and direct.touches(args, kwargs or {}):
            raise UnseenUsed(f"{func} reads an input only repeated blocks were to read")
        written = _written(func)
        if written and func.__name__.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            _refuse_overlapping_foreach(func, args, kwargs or {})
        swaps = func.__name__.startswith("set_")
        if written:
            for t in _args_at(func, written, args, kwargs or {}):
                if (id(t) in self.watched or swaps) and id(t) not in self.lines and _changes_layout(func):
                    from ..errors import caller_line
                    self.lines[id(t)] = caller_line()
                if swaps and not self.anchors:      # (not made before: an alias of an input stops its resize_)
                    self.anchors = {id(o): self.__torch_dispatch__(_ALIAS, (FunctionalTensor,), (o,), {})
                                    for o in self.owners}
                if id(t) in self.watched and swaps and _written_unswapped(t):
                    from ..errors import caller_line
                    self.written_before_swap.setdefault(id(t), caller_line())
                if isinstance(t, torch.Tensor) and not isinstance(t, FunctionalTensor):
                    from ..errors import UnsupportedError, caller_line
                    raise UnsupportedError(
                        f"{func.__name__} writes in place to a tensor of shape {tuple(t.shape)} that is not an "
                        "input of the captured function (a global, or a tensor attribute that is not a registered "
                        "buffer); the compiled graph would not repeat the write: register it as a buffer or pass "
                        "it as an argument", user_line=caller_line())
        layout = self.stale.before(func, args, kwargs)
        # The autograd engine summing two gradients of one tensor: recorded without the three modes.
        out = traced_sum(*args, self) if func is _ADD and len(args) == 2 and not kwargs and ENGINE_SUMS \
            and _engine_is_caller() else None
        if out is None:
            try:
                out = self._dispatched(func, types, args, kwargs)
            except RuntimeError as e:
                if func is _RESIZE and _NO_GROWTH in str(e):
                    raise _growth_refused(args[0]) from None
                raise
        self.stale.after(func, out, layout)
        if written and (swaps or torch.Tag.out in func.tags):    # (an out= op may resize its out)
            for t in _args_at(func, written, args, kwargs or {}):
                if isinstance(t, FunctionalTensor) and t.layout == torch.strided and \
                        ViewMeta.of(t) != ViewMeta.of(t.elem):
                    laid_out_as_value(t)
        if type(out) is FakeTensor and not written:
            out = self._traced_constant_op(func, args, kwargs, out)
        if getattr(func, "_overloadpacket", None) in FAKE_LAYOUT_DIFFERS:     # traced after it: eager's layout
            out = laid_out_as_kernel(func, args, out, lambda t, fmt: self.__torch_dispatch__(
                _CLONE, (type(t),), (t,), {"memory_format": fmt}))
        return out

    def _dispatched(self, func, types, args, kwargs):
        watch = sys.getprofile()
        if watch is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if not getattr(watch, "between_user_code", False):
            if getattr(func, "namespace", None) not in _TORCH_OPS:    # a custom op's fake kernel may be the user's Python
                return super().__torch_dispatch__(func, types, args, kwargs)
            with reads.switches_only(watch):
                return super().__torch_dispatch__(func, types, args, kwargs)
        # Another thread's writes are told apart by watching this one (guards.attribution); no
        # user code runs inside an op (subclasses with their own dispatch are refused above).
        with look_away():
            return super().__torch_dispatch__(func, types, args, kwargs)

    def _traced_constant_op(self, func, args, kwargs, out):
        """``out`` as a traced value where an op of constants alone made it fresh: functionalization
        wraps most such outputs, but not those of the ``*_like`` factories (``zeros_like(mask)``), so
        a later in-place op on one (``.masked_fill_(mask, -inf)``, nn.MultiheadAttention's mask) was
        taken for a write to a global. A view of a constant stays a constant's (a write to it is one)."""
        if out.requires_grad or not returns_fresh(func) or any(
                isinstance(a, FunctionalTensor) for a in pytree.tree_leaves((args, kwargs))):
            return out
        return FunctionalTensor(to_functional_tensor(out), self)


class Storages:
    """The traced storage size of each input whose storage the function resizes (FSDP's free and
    re-allocate: ``untyped_storage().resize_(n)``, ``resize_storage_bytes_``), as PyTorch's
    functionalization tracks it. The graph holds values, not storages: the resize is no node, the
    epilogue replays the final size on the caller's tensor (``runtime.call``). While an input's storage
    does not hold its elements (freed on entry or by a resize, or grown and not yet filled) only a
    whole ``copy_`` into it may touch it: any other use would read memory eager never wrote. Tensors
    are keyed by ``id`` of the inputs' functional tensors. Only the analysis follows sizes (``enter``):
    the joint trace, which runs the function again, has them from it."""

    def __init__(self):
        self.entry: dict = {}           # id -> bytes on entry, of every input
        self.sizes: dict = {}           # id -> bytes now, of each input the function resized
        self.unreadable: dict = {}      # id -> the functional tensor, while its storage is unreadable
        self.freed: set = set()         # the ids unreadable on entry
        self.lines: dict = {}           # id -> the user's line of its first resize
        self.active = False             # entered: the analysis (the joint trace's resizes are no-ops)

    def enter(self, inputs) -> None:
        """Note each input's storage size on entry (one freed by the caller holds no values)."""
        for f in inputs:
            if isinstance(f, FunctionalTensor):
                inner = from_functional_tensor(f.elem)      # (its layout: read without the functional wrapper)
                self.entry[id(f)] = inner.untyped_storage().nbytes()
                # Without a guard (every input of every capture; under Dynamo a guard on a stride it made
                # symbolic may have no source): freed where that holds for every size the trace stands for.
                if known_true(self.entry[id(f)] < reached_bytes(inner)):
                    self.unreadable[id(f)] = f
        self.freed = set(self.unreadable)
        self.active = True

    def resize(self, t, nbytes) -> None:
        if not self.active:     # the joint trace: the analysis accepted this resize
            return None
        from ..errors import UnsupportedError, caller_line
        line = caller_line()
        if id(t) not in self.entry:
            raise UnsupportedError(
                "resizing the storage of a tensor that is not an input of the captured function (an intermediate, "
                "or a view of an input) cannot be captured: the graph holds values, not storages; resize the "
                "input itself", user_line=line)
        start = self.entry[id(t)]
        now = self.sizes.get(id(t), start)
        if nbytes < reached_bytes(t) and t.requires_grad and torch.is_grad_enabled() and not _written_unswapped(t):
            raise UnsupportedError(
                "freeing the storage of an input that requires grad and still holds the caller's values: autograd "
                "may have saved it for the backward, which would read the freed storage; write its values "
                "(copy_ under no_grad) before freeing, or free it after the backward", user_line=line)
        if nbytes and start and nbytes != start:
            raise UnsupportedError(
                f"resizing an input's storage from {start} to {nbytes} bytes: only a storage that starts or ends "
                "empty (FSDP's free and re-allocate) can be captured, as in PyTorch's AOTAutograd", user_line=line)
        self.sizes[id(t)] = nbytes
        self.lines.setdefault(id(t), line)
        if nbytes != now:       # (re-allocated storage holds no values yet; a freed one none at all)
            self.unreadable[id(t)] = t
        return None

    def finish(self) -> dict:
        """``id -> (held, final)`` of each input whose storage the function resized: whether its storage held
        its values on entry (the trace may have read them), its final size in bytes. Stops the checks."""
        self.unreadable, self.active = {}, False
        return {i: (i not in self.freed, n) for i, n in self.sizes.items()}

    def check(self, func, args, kwargs) -> None:
        """Refuse a use of an input whose storage does not hold its elements, but a whole copy_ into one
        whose storage can hold them (which fills it). Reads of sizes and strides read no values."""
        if func in FunctionalTensor.metadata_fns:
            return
        for a in pytree.tree_leaves((args, kwargs)):
            if not isinstance(a, torch.Tensor) or id(a) not in self.unreadable:
                continue
            if func is _COPY_ and a is args[0] and self.sizes.get(id(a), self.entry[id(a)]) >= reached_bytes(a):
                del self.unreadable[id(a)]
                continue
            from ..errors import UnsupportedError, caller_line
            raise UnsupportedError(
                f"{func.__name__} uses an input whose storage does not hold its values (freed, or re-allocated with "
                "untyped_storage().resize_() and not yet filled): eager would read memory nothing wrote; fill it "
                "with a whole copy_() first", user_line=caller_line())


def _refuse_constant_requiring_grad(func, args, kwargs) -> None:
    """A subclass value that requires grad but holds no traced tensor (a parameter reached through a
    closure or a global): its dispatch would bake its inner tensors in and its gradient would be lost."""
    for t in pytree.tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor) and t.requires_grad and has_own_dispatch(type(t)) and not _traced(t):
            from ..errors import UnsupportedError, caller_line
            raise UnsupportedError(
                f"{func.__name__} uses a {type(t).__name__} of shape {tuple(t.shape)} that requires grad but is not "
                "an input (a parameter reached through a closure or a global?); its gradient would be lost. "
                "Capture the module itself, or pass the tensor as an argument", user_line=caller_line())


def _traced(t) -> bool:
    """Whether subclass value ``t`` holds a traced (functional) tensor."""
    if isinstance(t, FunctionalTensor):
        return True
    flatten = getattr(t, "__tensor_flatten__", None)
    return flatten is not None and any(_traced(getattr(t, k)) for k in flatten()[0]
                                       if isinstance(getattr(t, k), torch.Tensor))


_TORCH_OPS = ("aten", "prim", "prims")     # operators whose dispatch runs torch's Python alone
_DEVICE = torch.ops.prim.device.default
_CLONE = torch.ops.aten.clone.default
_ALIAS = torch.ops.aten.alias.default
_SET = torch.ops.aten.set_.source_Tensor
_SET_EMPTY = torch.ops.aten.set_.default
_NEW_EMPTY = torch.ops.aten.new_empty.default
_ADD = torch.ops.aten.add.Tensor
ENGINE_SUMS = True      # tests turn it off to compare the recorded sums with dispatched ones
_RESIZE = torch.ops.aten.resize_.default
_AS_STRIDED_ = torch.ops.aten.as_strided_.default
_RESIZE_STORAGE = torch.ops.inductor.resize_storage_bytes_.default
_COPY_ = torch.ops.aten.copy_.default


_NO_GROWTH = "Attempted to resize a view tensor to a larger size"     # functionalization's refusal


def _growth_refused(t):
    """The typed refusal of ``t.resize_()`` to more elements that functionalization raised: it grows a
    tensor's storage only where no other tensor or object holds that storage."""
    from ..errors import UnsupportedError, caller_line
    if view_meta_sequence(t.elem):
        why = ("of a view: functionalization regenerates a view from its base's storage, which the resize would "
               "outgrow; resize the base itself")
    else:
        why = ("of a tensor whose storage something else holds: functionalization grows a storage only while "
               "nothing else holds it (a view of it, or, from torch 2.15 on, the Python storage object that every "
               "traced tensor's storage now has); torch.compile runs such a resize outside its graph")
    return UnsupportedError(f"resize_() to more elements {why}. Resize outside the compiled function",
                            user_line=caller_line())


def _symbolic(args) -> bool:
    """``resize_(t, size)`` of a traced tensor where its sizes or the new ones are symbolic."""
    t, size = args[0], args[1]
    return isinstance(t, FunctionalTensor) and any(isinstance(v, torch.SymInt) for v in (*t.shape, *size))


def _symbolic_shrink(args) -> bool:
    """``resize_(t, size)`` of a traced contiguous tensor with symbolic sizes to no more elements."""
    t, size = args[0], args[1]
    if not isinstance(t, FunctionalTensor) or not any(isinstance(v, torch.SymInt) for v in (*t.shape, *size)):
        return False
    numel = 1
    for v in size:
        numel = numel * v
    return bool(t.is_contiguous()) and bool(numel <= t.numel())


def _device(t):
    """The device a fake tensor (or the functional wrapper of one) reports, as the fake mode's
    answer below this mode gives it; None for anything else. Each FunctionalTensor made (every
    traced op's outputs, every input wrapped) asks it, and the mode's generic path for an op
    (auto-functionalization, effects, unwrapping) cost more than the rest of the wrapping."""
    if is_functional_tensor(t) and not isinstance(t, FunctionalTensor):
        t = from_functional_tensor(t)
    if type(t) is FakeTensor:
        return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
    return None


_WRITTEN: dict = {}     # a true cache: an operator's schema never changes


def _refuse_overlapping_foreach(func, args, kwargs) -> None:
    """An in-place ``_foreach_*_`` whose other arguments read an element of the list it writes at
    another index (``_foreach_add_([a, b], [c, a])``): eager's kernel updates the elements one after
    the other, so ``b`` gets the new ``a`` on CPU (and either, on CUDA's fused kernel); a functional
    graph computes every element from the old values."""
    def key(t):
        return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None
    written: dict = {}      # storage -> the indices that write into it (views of one base share one)
    for i, t in enumerate(args[0]):
        if isinstance(t, torch.Tensor):
            written.setdefault(key(t), set()).add(i)
    for arg in (*args[1:], *kwargs.values()):
        items = arg if isinstance(arg, (list, tuple)) else [arg] * len(args[0])
        for j, t in enumerate(items):
            i = min(written.get(key(t), set()) - {j}, default=None) if isinstance(t, torch.Tensor) else None
            if i is not None:
                from ..errors import UnsupportedError, caller_line
                raise UnsupportedError(
                    f"{func.__name__} writes element {i} of its list and reads it as element {j} of another "
                    "argument: eager updates the elements one after another (the result depends on the order "
                    "its kernel takes them), the compiled graph computes all from the old values; pass "
                    "separate tensors or update them one by one", user_line=caller_line())


def _written(func) -> tuple:
    """Names of the arguments ``func`` writes to, from its schema (cached per operator)."""
    names = _WRITTEN.get(func)
    if names is None:
        schema = getattr(func, "_schema", None)
        names = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write) \
            if schema is not None else ()
        _WRITTEN[func] = names
    return names


def _written_unswapped(t) -> bool:
    """Whether functional tensor ``t`` was written in place in the storage it was entered with."""
    sync(t)
    return functionalize_has_data_mutation(t.elem) and not functionalize_was_storage_changed(t.elem)


def _refuse_other_numerics(func, args, at_entry) -> None:
    """A CUDA op traced while the function has TF32, cuDNN's algorithm switches or deterministic
    algorithms set otherwise than its caller (set and put back inside it) would run, compiled, under
    the caller's: other numbers than eager's (a matmul in bf16 under "medium" precision, say)."""
    if not any(a.is_cuda for a in _tensor_args(args)):
        return
    changed = modes.numerics_now(at_entry)
    if changed is None:
        return
    from ..errors import UnsupportedError, caller_line
    raise UnsupportedError(
        f"{func.__name__} runs on CUDA while the captured function has changed torch's numerics settings "
        f"({changed}); the compiled graph's kernels run under the caller's settings: set them around the "
        "call instead", user_line=caller_line())


def _tensor_args(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _changes_layout(func) -> bool:
    """Whether ``func`` changes its written argument's metadata or storage (``t_``, ``set_``)."""
    return torch.Tag.inplace_view in func.tags or func.__name__.startswith("set_")


def _args_at(func, names, args, kwargs):
    positional = [a.name for a in func._schema.arguments]
    for name in names:
        k = positional.index(name)
        yield args[k] if k < len(args) else kwargs.get(name)


def functional_mode() -> FunctionalTensorMode:
    return _CheckedFunctionalMode()
