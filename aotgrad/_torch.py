"""Every PyTorch private API aotgrad uses, in one place, so a torch upgrade is audited here
(torch 2.11-2.14). The rest of the package imports these names from here and never names a
``torch._*`` module, a ``torch.utils._*`` module or a private attribute itself
(tests/core/test_private_apis.py checks it).

Modules torch has imported by the time ``import torch`` returns (or that aotgrad imports anyway)
are bound eagerly; ``torch._dynamo`` and ``torch._inductor`` cost seconds to import, so they are
reached through functions that import them on first use.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import types
import weakref
from typing import Callable

import torch
import torch._library.autograd as _library_autograd
import torch._library.custom_ops as _custom_ops
import torch.fx._symbolic_trace as fx_symbolic_trace      # make_fx keeps the original Module.__call__ here
import torch.utils._pytree as pytree
import torch.utils._sympy.functions as sympy_functions
from torch._C import _autograd as C_autograd
from torch._C import _dynamo as C_dynamo
from torch._C import TensorBase
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._library.simple_registry import singleton as simple_registry
from torch._ops import OpOverload, OpOverloadPacket
from torch._prims_common import is_non_overlapping_and_dense_or_false, make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.symbolic_shapes import _suppress_guards as suppress_guards
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.printers import PythonPrinter

# Re-exported as they are (everything below is a wrapper or a version switch).
__all__ = [
    "C_autograd", "C_dynamo", "FakeTensor", "FakeTensorMode", "FunctionalTensor", "FunctionalTensorMode",
    "OpOverload", "OpOverloadPacket", "PythonPrinter", "TensorBase", "TorchDispatchMode", "TracingContext",
    "detect_fake_mode", "disable_current_modes", "enable_python_dispatcher", "fx_symbolic_trace", "int_oo",
    "is_non_overlapping_and_dense_or_false", "pytree", "simple_registry", "suppress_guards", "sympy_functions",
    "tracing",
]


def symbolic_dispatch(shape_env):
    """The Python dispatcher while tracing with symbolic sizes (``shape_env`` holds symbols), as
    make_fx's symbolic mode and AOTAutograd enable it: C++ kernels that take only concrete sizes
    (``expand`` inside ``clamp_``'s decomposition on a symbolic shape) are then reached through their
    symbolic Python implementations."""
    return enable_python_dispatcher() if shape_env is not None and backed_symbols(shape_env) else contextlib.nullcontext()


_SKIPPED_BY_DYNAMO: list = []


def skipped_by_dynamo() -> None:
    """Dynamo does not trace aotgrad's own frames once it is in use: a compiled step's backward,
    run by ``loss.backward()`` inside a ``torch.compile``d function, runs as torch's own code does
    (Dynamo compiled it as user code and the lazy Inductor backward met symbolic sizes). Nothing to
    do (and no import of ``torch._dynamo``) while Dynamo is not loaded."""
    if _SKIPPED_BY_DYNAMO or "torch._dynamo" not in sys.modules:
        return
    import torch._dynamo.trace_rules as rules
    if hasattr(rules, "add"):
        rules.add("aotgrad")
    _SKIPPED_BY_DYNAMO.append(True)


def without_dynamo(fn):
    """``fn`` run with Dynamo's frame callback off for it and all it calls, when one is on: a compiled
    backward that ``loss.backward()`` runs inside a ``torch.compile``d function (or its lazy Inductor
    compile) is not user code for Dynamo to trace, as torch's own compiled backward is not."""
    callback = C_dynamo.eval_frame.get_eval_frame_callback
    off: list = []

    def run(*args):
        if callback() is None:
            return fn(*args)
        if not off:
            import torch._dynamo
            skipped_by_dynamo()
            off.append(torch._dynamo.disable(fn, recursive=True))
        return off[0](*args)
    return run


# The compiled-autograd engine (C++): its compiler slot and its cache are one per process.
compiled_autograd_engine = C_dynamo.compiled_autograd
TensorGuards = C_dynamo.guards.TensorGuards
# A dict's version tag (CPython's ``ma_version_tag``), where aotgrad's own C module is not built
# (``guards/tags.py`` says what it proves); None where this torch has no such function.
dict_version = getattr(C_dynamo.guards, "dict_version", None)


def tensors_check(exemplars, sizes, strides):
    """``check(values) -> bool`` for a list ``values`` whose first items are tensors: each of the Python type,
    dispatch keys, dtype, device and requires_grad of the exemplar at its place, with its static ``sizes``
    and ``strides``, one ``TENSOR_MATCH`` leaf of a C++ guard manager each (what ``TensorGuards`` checks,
    without unpacking the tensors into call arguments). None where this torch's manager differs."""
    try:
        from torch._dynamo.guards import GuardManagerType
        root, kind = C_dynamo.guards.RootGuardManager(), GuardManagerType.GUARD_MANAGER
        for i, (t, size, stride) in enumerate(zip(exemplars, sizes, strides)):
            root.list_getitem_manager(i, f"flat[{i}]", t, kind).add_tensor_match_guard(
                t, list(size), list(stride), f"flat[{i}]", [f"metadata of flat[{i}]"], None, type(t),
                torch._C._dispatch_keys(t))
        return root.check
    except GUARD_MANAGER_FAILS:
        return None


# What building on another torch's guard manager raises: a method missing or taking other arguments.
GUARD_MANAGER_FAILS = (ImportError, AttributeError, TypeError, RuntimeError)

# Functionalization.
sync = torch._sync
from_functional_tensor = torch._from_functional_tensor
to_functional_tensor = torch._to_functional_tensor
# The node a FunctionalTensor wrapping an input that requires grad gets as its history.
ERROR_NODE = torch._C._functions.Error
is_functional_tensor = torch._is_functional_tensor
functionalize_has_data_mutation = torch._functionalize_has_data_mutation
_functionalization = getattr(torch._C, "_functionalization", None)


def view_meta_sequence(elem):
    """The view ops that made functional tensor ``elem``'s view, or None where this torch does not
    record them (the ``ViewMeta`` sequences are torch >= 2.12)."""
    if _functionalization is None or not hasattr(_functionalization, "get_view_meta_sequence") \
            or not torch._is_functional_tensor(elem):
        return None
    return _functionalization.get_view_meta_sequence(elem)


def apply_view_meta_sequence(base, sequence):
    return _functionalization.apply_view_meta_sequence(base, sequence)


def functionalize_was_storage_changed(elem) -> bool:
    """Whether functional tensor ``elem``'s storage was swapped (``set_``); False where torch cannot say."""
    changed = getattr(torch, "_functionalize_was_storage_changed", None)
    return bool(changed and changed(elem))


def laid_out_as_value(t) -> None:
    """FunctionalTensor ``t``'s own sizes, strides and offset (what Python code reads) set to its value's.
    torch updates them for the in-place view ops alone, not where functionalization replaced the value with one
    laid out otherwise: an out= op that resized its ``out`` (``torch.add(a, b, out=c)`` of an empty ``c``) or
    ``set_()`` onto another tensor; code reading ``c.shape`` then would follow the old layout. Set on the
    wrapper's own storage through the meta kernels (no memory), as torch sets a wrapper's in-place view."""
    e = t.elem
    with torch.utils._mode_utils.no_dispatch(), torch._C._AutoDispatchBelowADInplaceOrView():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.ops.aten.set_.source_Storage_storage_offset(t, torch.Tensor.untyped_storage(t), e.storage_offset(),
                                                              e.shape, e.stride())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)


def register_stack_trace_anchor(fn) -> None:
    """Keep ``fn``'s own frames in the stack traces :func:`user_stack_traces` records (only
    ``forward`` methods' otherwise), so errors found in a traced plain function can name its line."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        _ANCHORS.add((code.co_filename, code.co_name))


_ANCHORS: set = set()      # (file, function) pairs whose frames stack traces keep


def user_stack_traces() -> None:
    """Make the running make_fx trace (one recording stack traces) record each node's the way
    make_fx's forward-only recording does (``TracerBase._filter_traceback_frames``: frames of
    ``forward`` methods and anchors, torch's uninteresting files left out), at a fraction of the
    cost: fx symbolizes the whole stack of every node (every frame's source line, some 60 frames
    deep in a capture: 150 us a node, a fifth of capturing a small model) and then keeps a few;
    this walks the frames and reads the lines of those it keeps. Set on the tracer object alone:
    other traces, in this thread or another, are unchanged."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    tracer = getattr(get_proxy_mode(), "tracer", None)
    if not getattr(tracer, "record_stack_traces", False) or "create_node" in vars(tracer):
        return
    create = tracer.create_node
    anchors = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", set())

    def create_node(*args, **kwargs):
        if not tracer.record_stack_traces:      # no_stack_traces() turned it off
            return create(*args, **kwargs)
        tracer.record_stack_traces = False
        try:
            node = create(*args, **kwargs)
        finally:
            tracer.record_stack_traces = True
        if not node.stack_trace:
            trace = _forward_frames(anchors)
            if trace:
                node.stack_trace = trace
        return node
    tracer.create_node = create_node


_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


def anomaly_nan_check(func) -> bool:
    """Whether ``func``, dispatched to a mode, is the autograd engine reading a scalar for anomaly
    mode's NaN check of a backward node's outputs (``set_detect_anomaly(True)``). The engine is C++:
    the first Python frame below aotgrad's and the wrappers torch puts around a mode is the one that
    started it. Code of the program reading a value (a custom Function's backward) has a frame of
    its own."""
    return func is _LOCAL_SCALAR and torch.is_anomaly_enabled() \
        and torch.is_anomaly_check_nan_enabled() and _engine_is_caller()


def _engine_is_caller() -> bool:
    import torch._compile
    import torch._dynamo.eval_frame
    skip = (torch._compile.__file__, torch._dynamo.eval_frame.__file__)
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename in skip or f.f_globals.get("__name__", "").startswith("aotgrad.")):
        f = f.f_back
    return f is not None and f.f_code is torch.autograd.graph._engine_run_backward.__code__


def _forward_frames(anchors) -> str:
    """The running thread's frames fx's forward-only filter keeps, formatted as fx formats them.
    Which code objects it keeps is decided once per code (while the anchors stay as they are), and
    the text once per stack of kept lines: a trace's nodes are made some 70 frames deep, a few user
    lines each."""
    global _kept_for
    now = (len(_ANCHORS), frozenset(anchors))      # (ours only grow; fx's may lose one)
    if _kept_for != now or len(_KEPT) > 8192 or len(_TEXTS) > 8192:
        _KEPT.clear()
        _TEXTS.clear()
        _kept_for = now
    kept = []
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        keep = _KEPT.get(id(code))
        if keep is None:
            keep = _KEPT[id(code)] = (code, _keeps(code, anchors))
        if keep[1]:
            kept.append((code, f.f_lineno))
        f = f.f_back
    key = tuple((id(c), line) for c, line in kept)
    got = _TEXTS.get(key)
    if got is None:
        import traceback
        text = "".join(traceback.StackSummary.from_list(
            [traceback.FrameSummary(c.co_filename, line, c.co_name) for c, line in reversed(kept)]).format()).strip()
        got = _TEXTS[key] = (kept, text)     # (the codes: alive while their ids are a key)
    return got[1]


def _keeps(code, anchors) -> bool:
    from torch.fx.experimental.symbolic_shapes import uninteresting_files
    where = (code.co_filename, code.co_name)
    return (code.co_name == "forward" or where in _ANCHORS or where in anchors) and code.co_filename not in uninteresting_files()


# Keyed by the ids of code objects _KEPT holds (a new one for code defined again); cleared together when full.
_KEPT: dict = {}            # id(code) -> (code, whether stack traces keep its frames)
_kept_for = None            # the anchors _KEPT was decided for
_TEXTS: dict = {}           # ((id(code), line), ...) kept -> (those codes and lines, the formatted stack trace)


def fresh_fakes(mode, metas) -> list:
    """New fake tensors of ``(shape, stride, dtype, device)`` in ``mode``, made from meta tensors
    directly: a fake kernel's outputs without one dispatch through the fake mode each. Each is made as a
    plain subclass of its meta tensor with a copy of the state ``FakeTensor(mode, meta, device)`` gives
    every new fake of that device (a quarter of the constructor's time; a deep model's trace makes
    thousands), that state proven once per mode and device (:func:`_proven_fake_state`); torch's
    constructor where it is not, in FakeTensor's debug mode and while exporting (its extras then)."""
    fast = not (torch.compiler.is_exporting() or FakeTensorConfig.debug)
    states = _FAKE_STATES.setdefault(mode, {}) if fast else None
    unsafe = mode._allow_unsafe_data_ptr_access
    with torch._C._DisableTorchDispatch():
        out = []
        for shape, stride, dtype, device in metas:
            meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            state = None
            if states is not None:
                if device not in states:
                    states[device] = _proven_fake_state(mode, device)
                state = states[device]
            out.append(FakeTensor(mode, meta, device) if state is None else _made_fake(meta, state, unsafe))
        return out


_FAKE_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # mode -> {device: (device, __dict__) or None}


def _made_fake(meta, state, unsafe):
    device, attrs = state
    fake = torch.Tensor._make_subclass(FakeTensor, meta, False, dispatch_device=True, device_for_backend_keys=device)
    if unsafe:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(fake)
    else:
        torch._C._set_throw_on_mutable_data_ptr(fake)
    fake.__dict__.update(attrs)
    return fake


def _proven_fake_state(mode, device):
    """``(device, __dict__)`` of ``FakeTensor(mode, meta, device)``, where a fake made from it by
    :func:`_made_fake` equals the constructor's attribute by attribute, in its dispatch keys and data
    pointer policy; None where it does not, and for a fake meta tensor."""
    if torch.device(device).type == "meta":
        return None
    real = FakeTensor(mode, torch.empty_strided((2, 3), (3, 1), device="meta"), device)
    state = (real.fake_device, dict(real.__dict__))
    fake = _made_fake(torch.empty_strided((2, 3), (3, 1), device="meta"), state, mode._allow_unsafe_data_ptr_access)
    same = (type(fake) is type(real) and fake.__dict__.keys() == real.__dict__.keys()
            and all(fake.__dict__[k] is v or fake.__dict__[k] == v for k, v in real.__dict__.items())
            and torch._C._dispatch_keys(fake) == torch._C._dispatch_keys(real)
            and fake.device == real.device and fake.requires_grad == real.requires_grad)
    return state if same else None


def traced_call(op, tensors: list, consts: tuple, metas) -> list | None:
    """``op(tensors, *consts)`` recorded straight into the running ``make_fx`` trace: one node
    reading the tensors' nodes and a ``getitem`` node per output, the outputs fresh fake tensors of
    ``metas`` (``(shape, stride, dtype, device)``) wrapped as functional tensors, as functionalization,
    the proxy mode and the fake mode would have made them, without dispatching through the three
    (their bookkeeping is most of a deep model's trace of a repeated block's calls). For an ``op``
    that is functional, returns fresh tensors only and has no effects, whose node the caller
    replaces before anything reads its meta. None where the trace is not one of functional tensors
    under those modes alone (the caller dispatches the op)."""
    modes = _traced_modes(tensors)
    if modes is None:
        return None
    tracer, functional, fake = modes
    node = _traced_node(tracer, op, [_synced_inner(t) for t in tensors], consts)
    return _wrapped(tracer, functional, node, fresh_fakes(fake, metas), many=True)


def traced_sum(a, b, functional):
    """``a + b`` of two functional tensors of one static shape, dtype and device, both contiguous,
    recorded straight into the running ``make_fx`` trace (:func:`traced_call`: one ``aten.add`` node, a
    fresh contiguous output): what the autograd engine does to sum two gradients of one tensor (a
    repeated block's input used twice: one a layer), which the three modes cost a few hundred
    microseconds. Called by the ``functional`` mode's own dispatch (so not on the mode stack). None
    elsewhere (the caller dispatches the op)."""
    modes = _traced_modes((a, b), functional)
    if modes is None:
        return None
    tracer, functional, fake = modes
    x, y = _synced_inner(a), _synced_inner(b)
    shape = x.shape
    if x.dtype != y.dtype or x.device != y.device or shape != y.shape or not (x.is_contiguous() and y.is_contiguous()) \
            or any(isinstance(s, torch.SymInt) for s in shape) or not _tracked(tracer, x, y):
        return None
    node = _traced_node(tracer, torch.ops.aten.add.Tensor, [x, y], (), listed=False)
    # TensorIterator gives contiguous operands a freshly laid out output: x's own strides differ where a
    # dimension is 0 or 1 (an expanded zero-size gradient is "contiguous" with stride 0)
    out = fresh_fakes(fake, [(shape, tuple(make_contiguous_strides_for(shape)), x.dtype, x.device)])
    return _wrapped(tracer, functional, node, out, many=False, enter=False)[0]


def _traced_modes(tensors, dispatching=None):
    """``(tracer, functional mode, fake mode)`` of a trace of functional tensors under make_fx's proxy
    mode, functionalization and a fake mode alone (``dispatching``: that functional mode, off the stack
    while it dispatches); None elsewhere."""
    key = torch._C._TorchDispatchModeKey
    proxy, functional, fake = (torch._C._get_dispatch_mode(k) for k in (key.PROXY, key.FUNCTIONAL, key.FAKE))
    if dispatching is not None and functional is None:
        functional = dispatching
    if proxy is None or functional is None or fake is None \
            or torch._C._len_torch_dispatch_stack() != 3 - (dispatching is not None) \
            or not all(type(t) is FunctionalTensor for t in tensors):
        return None
    return proxy.tracer, functional, fake


def _tracked(tracer, *inner) -> bool:
    """Whether the trace has a node for each of ``inner`` (a constant an op of constants made may have none)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot
    return all(get_proxy_slot(x, tracer, None) is not None for x in inner)


def _synced_inner(t):
    torch._sync(t)      # a pending write to its base is replayed first, as functionalization does
    return torch._from_functional_tensor(t.elem)


def _traced_node(tracer, op, inner: list, consts: tuple, listed: bool = True):
    from torch.fx.experimental.proxy_tensor import get_proxy_slot
    graph = tracer.graph
    ins = [get_proxy_slot(x, tracer).proxy.node for x in inner]
    return graph.create_node("call_function", op, (ins, *consts) if listed else (*ins, *consts), {},
                             name=graph._target_to_str(op._opname))


def _wrapped(tracer, functional, node, outs: list, many: bool, enter: bool = True) -> list:
    """``outs`` (the node's values: a ``getitem`` node each where ``many``) as the trace's functional
    tensors (made inside the functional mode where ``enter``, as its own dispatch makes them outside)."""
    import operator
    from torch.fx.experimental.proxy_tensor import _ProxyTensor, set_proxy_slot
    node.meta["val"] = outs if many else outs[0]
    wrapped = []
    with functional if enter else contextlib.nullcontext():
        for k, o in enumerate(outs):
            g = node
            if many:
                g = tracer.graph.create_node("call_function", operator.getitem, (node, k), {})
                g.meta["val"] = o
            set_proxy_slot(o, tracer, _ProxyTensor(torch.fx.Proxy(g, tracer), None))
            wrapped.append(FunctionalTensor(torch._to_functional_tensor(o), functional))
    return wrapped


def known_true(b) -> bool:
    """Whether ``b`` (a bool, or a SymBool of a trace with symbolic sizes) is true for every size
    the trace stands for, without adding a guard."""
    if not isinstance(b, torch.SymBool):
        return bool(b)
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return statically_known_true(b)


def suggest_memory_format(t) -> torch.memory_format:
    """``Tensor.suggest_memory_format()`` (C++ only): channels-last for 4-d/5-d tensors strided so,
    else contiguous; torch's own Python twin where this torch has one."""
    import torch._prims_common as prims_common
    twin = getattr(prims_common, "suggest_memory_format", None)
    if twin is not None:
        return twin(t)
    like = getattr(prims_common, "are_strides_like_channels_last_or_false", None) or \
        prims_common.are_strides_like_channels_last     # the name 2.13 and 2.14 have; an older one
    if t.layout == torch.strided and t.dim() in (4, 5) and like(t.shape, t.stride()):
        return torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def layouts(tensors) -> tuple:
    """``(shape, stride, storage offset, dtype, device, requires_grad)`` of each tensor, read with
    torch-function modes off: inside a make_fx trace every ``t.stride()`` of a traced tensor would
    otherwise pass through the proxy mode's Python ``__torch_function__`` (18 us a tensor)."""
    with torch._C.DisableTorchFunction():
        return tuple((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)
                     for t in tensors)


def fake_like(t):
    """A new fake tensor in ``t``'s fake mode with its sizes, strides, storage offset, dtype and
    device (compilers read the offset to decide alignment)."""
    layout = (*t.shape, *t.stride())
    if t.storage_offset() == 0 and not any(isinstance(s, torch.SymInt) for s in layout):
        return fresh_fakes(t.fake_mode, [(t.shape, t.stride(), t.dtype, t.device)])[0]
    with t.fake_mode:
        if t.storage_offset() == 0:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        flat = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def plain_fake(mode, t):
    """What ``mode.from_tensor(t)`` gives for a dense leaf tensor with static sizes, made from a meta
    tensor directly (several times faster: a model's parameters are most of a capture's inputs), and
    registered in the mode's memo as from_tensor registers it. None where ``t`` is not such a tensor:
    a subclass, a storage it does not fill, named, quantized, conjugate/negative bits, a view that
    requires grad. (A view of a whole storage that no other input shares, such as a buffer made with
    ``mask.view(1, 1, n, n)``, is that storage under another shape: nothing traced can tell.)"""
    if type(t) not in _PLAIN_TYPES or not t.is_leaf or t.layout is not torch.strided \
            or (t._is_view() and t.requires_grad) \
            or t.storage_offset() != 0 or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg() \
            or any(getattr(t, "names", None) or ()) or t.device.type == "meta" \
            or not (t.is_contiguous() or is_non_overlapping_and_dense_or_false(t)) \
            or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return None
    grad = t.grad
    fake_grad = None if grad is None else plain_fake(mode, grad)
    if grad is not None and fake_grad is None:
        return None
    converter = mode.fake_tensor_converter
    if converter._get_memo(t) is not None:
        return None
    fake = fresh_fakes(mode, [(t.shape, t.stride(), t.dtype, t.device)])[0]
    if t.requires_grad:
        fake.requires_grad_(True)
    if fake_grad is not None:
        fake.grad = fake_grad
    converter.set_tensor_memo(t, fake)
    return fake


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", torch.nn.Parameter))


def storage_key(t):
    """A key equal for tensors that share one real storage; None where ``t`` has no storage of its own
    to compare (a tensor subclass or a nested tensor, whose storage is a Python placeholder that
    raises when read, sparse and other layouts) or an empty one (a storage resized to 0 bytes, as
    FSDP frees parameters: every empty storage reads the same address)."""
    if type(t) not in _PLAIN_TYPES or t.layout is not torch.strided or t.is_nested:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


_OWN_DISPATCH_EXEMPT = (FakeTensor, FunctionalTensor)


def has_own_dispatch(cls) -> bool:
    """Whether tensor class ``cls`` runs its own ``__torch_dispatch__`` (fake and functional
    tensors, aotgrad's own tracing tensors, do not count)."""
    return not issubclass(cls, _OWN_DISPATCH_EXEMPT) and \
        _unbound(cls.__torch_dispatch__) is not _unbound(torch.Tensor.__torch_dispatch__)


def _unbound(method):
    return getattr(method, "__func__", method)


def traceable_subclass(t) -> bool:
    """Whether ``t`` is a traceable wrapper subclass (``__tensor_flatten__``/``__tensor_unflatten__``
    with its own ``__torch_dispatch__``: TwoTensor, DTensor, float8 training tensors), which capture
    traces through to its inner tensors; a jagged nested tensor is one (its ragged size a nested int)."""
    return isinstance(t, torch.Tensor) and traceable_class(type(t))


def traceable_class(cls) -> bool:
    """:func:`traceable_subclass` of a class."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
    return has_own_dispatch(cls) and is_traceable_wrapper_subclass_type(cls)


def view_base(t):
    """The base view ``t`` is regenerated from at run time: ``t._base``, or ``t`` itself where that
    is a traceable wrapper subclass (a jagged nested tensor's ``values()``): the graph returns the
    plain value, whose autograd history runs through the subclass, and the output is a view of it."""
    base = t._base
    return t if base is not None and traceable_subclass(base) else base


def nested_int(v) -> bool:
    """Whether size ``v`` is a nested int (a jagged nested tensor's ragged size: the identity of its
    offsets tensor, no number)."""
    return isinstance(v, torch.SymInt) and v.node.is_nested_int()


def nested_int_of(t):
    """The nested int tied to tensor ``t`` (a jagged nested tensor's offsets), or None: a real
    tensor's from torch's registry, a fake's from its memo (under a functional tensor: its fake's)."""
    if isinstance(t, FunctionalTensor):
        t = torch._from_functional_tensor(t.elem)
    if isinstance(t, FakeTensor):
        return t.nested_int_memo
    module = sys.modules.get("torch.nested._internal.nested_tensor")
    return None if module is None else module._tensor_symint_registry.get(t)


def tie_nested_int(t, n) -> None:
    """Tie nested int ``n`` to ``t``, a fake tensor or a functional tensor over one, that has none:
    a nested tensor built on it while tracing gets ``n`` as its ragged size (torch would make a
    fresh symbol no trace tracks)."""
    if isinstance(t, FunctionalTensor):
        t = torch._from_functional_tensor(t.elem)
    if isinstance(t, FakeTensor) and t.nested_int_memo is None:
        t.nested_int_memo = n


def as_traced_by_make_fx(fn):
    """``fn`` with fx's "symbolic tracing" flag off while it runs: make_fx's tracer sets it, and
    library code that refuses ``fx.symbolic_trace`` (``nested_tensor_from_jagged``) then refuses a
    trace of real fake tensors too; torch's own higher-order ops clear it the same way
    (``_higher_order_ops.utils._set_compilation_env``). Callers hold ``scoped.FX_TRACING``."""
    def run(*args):
        if _FX_TRACING_CONTEXT is not None:        # torch 2.14 on: a per-thread flag
            with _FX_TRACING_CONTEXT(False):
                return fn(*args)
        old, fx_symbolic_trace._is_fx_tracing_flag = fx_symbolic_trace._is_fx_tracing_flag, False
        try:
            return fn(*args)
        finally:
            fx_symbolic_trace._is_fx_tracing_flag = old
    return run


_FX_TRACING_CONTEXT = getattr(fx_symbolic_trace, "_is_fx_tracing_context", None)


def constant_nested_ints(mode) -> None:
    """Make fake mode ``mode`` give a jagged nested tensor built while tracing on offsets with no
    nested int (``nested_tensor_from_jagged`` on an input) a fresh *constant* nested int, as eager's
    registry does, not a symbol of its shape env that no trace tracks (torch's AOTAutograd gets
    that symbol from Dynamo as a graph input). At run time the outputs are rebuilt on the real
    offsets, which get theirs from the registry."""
    def create(*, nt_tensor_id=None):
        from torch.nested._internal import nested_int, nested_tensor
        n, nested_tensor._tensor_id_counter = nested_tensor._tensor_id_counter, nested_tensor._tensor_id_counter + 1
        return torch.SymInt(nested_int.NestedIntNode(n, 1))
    mode.create_symbolic_nested_int = create


def subclass_kind(t) -> str | None:
    """Why tensor ``t``'s class changes what ops do, or None where it does not: a class with its own
    ``__torch_dispatch__`` (a wrapper subclass such as TwoTensor, a jagged nested tensor; fake and
    functional tensors are aotgrad's own), or a ``__torch_function__`` subclass that keeps its class
    on every op's result (``torch.Tensor``'s default for subclasses; ``nn.Parameter`` and classes
    derived from it disable it). Traced through fake tensors, neither would run."""
    cls = type(t)
    if cls in _PLAIN_TYPES or issubclass(cls, _OWN_DISPATCH_EXEMPT):
        return None
    if has_own_dispatch(cls):
        return "has its own __torch_dispatch__"
    if _unbound(cls.__torch_function__) is not torch._C._disabled_torch_function_impl:
        return "runs its own __torch_function__ on every op"
    return None


@contextlib.contextmanager
def fake_cache_off(mode=None):
    """``mode`` (else the active fake mode, if any) skips its dispatch cache: for ops whose arguments
    never repeat (a block call's number), where building the key of every call costs and never hits."""
    mode = mode if mode is not None else detect_fake_mode()
    before = getattr(mode, "cache_enabled", False)
    if before:
        mode.cache_enabled = False
    try:
        yield
    finally:
        if before:
            mode.cache_enabled = True


def tracing_graph():
    """The graph the running make_fx trace in this thread is making, or None."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return getattr(getattr(get_proxy_mode(), "tracer", None), "graph", None)


@contextlib.contextmanager
def no_stack_traces():
    """The active make_fx trace, if any, stops recording stack traces for the nodes made inside."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    tracer = getattr(mode, "tracer", None)
    before = getattr(tracer, "record_stack_traces", False)
    if before:
        tracer.record_stack_traces = False
    try:
        yield
    finally:
        if before:
            tracer.record_stack_traces = True


def lazy_graph_module(root, graph, class_name: str):
    """A GraphModule that writes its Python code only when read or run, where this torch can."""
    make = getattr(getattr(torch.fx, "_lazy_graph_module", None), "_make_graph_module", None)
    if make is None:
        return torch.fx.GraphModule(root, graph, class_name=class_name)
    with lazy_graph_modules():
        return make(root, graph, class_name=class_name)


def lazy_graph_modules():
    """A context in which new GraphModules write their Python code only when read or run (where
    this torch can: otherwise nothing changes)."""
    lazy = getattr(getattr(torch.fx, "_lazy_graph_module", None), "_use_lazy_graph_module", None)
    return lazy(True) if lazy is not None else contextlib.nullcontext()


def _nested_code(fn, name: str):
    """The code of the function named ``name`` that ``fn`` defines inside itself (None: it defines none)."""
    return next((c for c in fn.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == name), None)


FX_MODULE_CALL_WRAPPER = _nested_code(torch.fx.Tracer.trace, "module_call_wrapper")
"""The code of the wrapper make_fx's tracer puts in ``Module.__call__``'s place while it traces."""


def dynamo_saved_values(node) -> tuple:
    """``(saved, kept)``: what the backward ``node`` of a custom Function Dynamo traced
    (``autograd_function_apply``'s ``ApplyTemplate``) reads of its forward, a list in its ``backward``'s
    closure (not on ``ctx``), as the user's forward saved it (``save_for_backward``) or kept it on ``ctx``."""
    cls = getattr(node, "_forward_cls", None)
    if getattr(cls, "__name__", None) != "ApplyTemplate":
        return (), ()
    values = _closed_over(cls.backward, "saved_values") or ()
    saved = _closed_over(cls.forward, "saved_for_backward_idx")
    saved = range(len(values)) if saved is None else saved
    return (tuple(v for i, v in enumerate(values) if i in saved),
            tuple(v for i, v in enumerate(values) if i not in saved))


def _closed_over(fn, name: str):
    """The value of the variable ``name`` function ``fn`` closes over (None: it closes over none)."""
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    return fn.__closure__[names.index(name)].cell_contents if name in names else None


@contextlib.contextmanager
def modules_called_as_now():
    """A context in which make_fx's tracer calls a module through ``Module.__call__`` as the class
    has it now. fx keeps the one it found at import (``_orig_module_call``) and calls that, so a call
    machinery patched since (a profiler's ``__call__``, aotgrad's block dispatch) would run in the
    metadata pass and not in the joint trace. Callers hold ``scoped.FX_TRACING``."""
    old = getattr(fx_symbolic_trace, "_orig_module_call", None)
    now = torch.nn.Module.__dict__["__call__"]
    if old is None:
        yield
        return
    fx_symbolic_trace._orig_module_call = now
    try:
        yield
    finally:
        if fx_symbolic_trace._orig_module_call is now:
            fx_symbolic_trace._orig_module_call = old


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node, transform: Callable = lambda a: a) -> torch.fx.Node:
    """``graph.node_copy(node, transform)`` without ``Graph.create_node``'s scan of every argument
    for raw symbolic values (torch >= 2.13), a third of copying a deep model's graph, needless for
    copies of nodes it already accepted. The rest is create_node's own steps, the same in 2.11-2.14."""
    if not _FAST_COPY:
        return graph.node_copy(node, transform)
    args = torch.fx.node.map_arg(node.args, transform)
    kwargs = torch.fx.node.map_arg(node.kwargs, transform)
    n = append_node(graph, node.op, node.name, node.target, args, kwargs, node.type)
    n.meta = copy.copy(node.meta)
    return n


def append_node(graph: torch.fx.Graph, op: str, name: str, target, args: tuple, kwargs: dict, type_=None):
    """``graph.create_node(op, target, args, kwargs, name)`` for arguments already checked (a copied
    or stored graph's), without its per-argument scan; the name is kept where it is free."""
    if not _FAST_COPY:
        return graph.create_node(op, target, args, kwargs, name, type_)
    name = graph._graph_namespace.create_name(name, None)
    n = torch.fx.Node(graph, name, op, target, args, kwargs, type_)
    owner = graph.owning_module
    for hook in (getattr(owner, "_create_node_hooks", None) or ()) if owner is not None else ():
        hook(n)
    graph._graph_namespace.associate_name_with_obj(name, n)
    graph._insert(n)
    graph._find_nodes_lookup_table.insert(n)
    graph._len += 1
    return n


def copy_graph(graph: torch.fx.Graph, source: torch.fx.Graph, env: dict):
    """``graph.graph_copy(source, env)`` through :func:`copy_node`: copies every node of ``source``
    but its output into ``graph`` (recording the copies in ``env``); returns the output's value."""
    for n in source.nodes:
        if n.op == "output":
            return torch.fx.node.map_arg(n.args[0], env.__getitem__)
        if n not in env:
            env[n] = copy_node(graph, n, env.__getitem__)
    return None


_FAST_COPY = all(hasattr(torch.fx.Graph(), a) for a in ("_insert", "_graph_namespace", "_find_nodes_lookup_table", "_len"))


# Global switches and dispatcher state.
VF = torch._VF      # the RNN ops' module (``_VF.lstm``): tracing.patches dispatches them with oneDNN off
get_mkldnn_enabled = torch._C._get_mkldnn_enabled
set_mkldnn_enabled = torch._C._set_mkldnn_enabled
# cuDNN's switches (enabled, benchmark, deterministic), read and set as torch.backends.cudnn does.
get_cudnn_allow_tf32 = torch._C._get_cudnn_allow_tf32
cudnn_flags = (torch._C._get_cudnn_enabled, torch._C._get_cudnn_benchmark, torch._C._get_cudnn_deterministic)
set_cudnn_flags = (torch._C._set_cudnn_enabled, torch._C._set_cudnn_benchmark, torch._C._set_cudnn_deterministic)
is_any_autocast_enabled = torch._C._is_any_autocast_enabled

# torch's float32 precision settings: the legacy matmul one and, where this torch has them, the
# per-backend ones (``torch.backends.cuda.matmul.fp32_precision = "tf32"``), which a trace reading any of
# them is guarded on. The legacy getter raises once the two are mixed: what a call runs under
# (``runtime.modes``) is the legacy setting where it can be read (setting it writes per-backend ones,
# "none" becoming "ieee", as eager's does), else all of them.
_FP32_BACKENDS = tuple((b, o) for b in ("generic", "cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn")
                       if not (b == "generic" and o != "all"))
_fp32_get = getattr(torch._C, "_get_fp32_precision_getter", None)


def fp32_precisions() -> tuple:
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    return (legacy, *(_fp32_get(b, o) for b, o in _FP32_BACKENDS)) if _fp32_get is not None else (legacy,)


def fp32_setting():
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return fp32_precisions()


def set_fp32_setting(want) -> None:
    if isinstance(want, str):
        torch.set_float32_matmul_precision(want)
        return
    for (b, o), v in zip(_FP32_BACKENDS, want[1:]):
        if _fp32_get(b, o) != v:
            torch._C._set_fp32_precision_setter(b, o, v)


# torch's process-wide switches a program can read, by the C getter every way of reading one calls
# (``torch.are_deterministic_algorithms_enabled()``, ``torch.backends.cudnn.benchmark``...): a trace
# that called one is guarded on its value (``guards.reads``: the profile's ``c_call`` events).
SWITCH_GETTERS = {f: name for name in (
    "_get_deterministic_algorithms", "_get_deterministic_algorithms_warn_only",
    "_get_deterministic_fill_uninitialized_memory", "_get_float32_matmul_precision", "_get_cudnn_enabled",
    "_get_fp32_precision_getter",
    "_get_cudnn_benchmark", "_get_cudnn_deterministic", "_get_cudnn_allow_tf32", "_get_mkldnn_enabled",
    "_get_mkldnn_deterministic", "_get_onednn_allow_tf32", "_get_cublas_allow_tf32",
    "_get_cublas_allow_fp16_reduced_precision_reduction", "_get_cublas_allow_bf16_reduced_precision_reduction",
    "_get_cpu_allow_fp16_reduced_precision_reduction", "_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled",
    "_get_math_sdp_enabled", "_get_cudnn_sdp_enabled", "_get_nnpack_enabled", "_get_warnAlways",
    "is_anomaly_enabled", "is_anomaly_check_nan_enabled", "get_num_threads", "get_num_interop_threads")
    for f in [getattr(torch._C, name, None)] if f is not None}     # (the default dtype is a baked mode)
SWITCH_VALUES = {"_get_fp32_precision_getter": fp32_precisions}     # a getter taking arguments: all it can answer
are_functorch_transforms_active = torch._C._are_functorch_transforms_active
torch_function_state, set_torch_function_state = torch._C._get_torch_function_state, torch._C._set_torch_function_state
cuda_end_allocate_to_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)     # (None: a torch without CUDA)
# A storage over memory it does not own, and the exchange of two storages' memory (every tensor and
# view over either follows its storage); None where this torch has no exchange.
storage_over = torch._C._construct_storage_from_data_pointer
swap_storage_memory = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
len_torch_function_stack, function_stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
top_saved_tensors_default_hooks = C_autograd._top_saved_tensors_default_hooks


def version_counter(t):
    """``t``'s version counter, or None: not a tensor, or an inference tensor (it has none)."""
    try:
        return t._version if isinstance(t, torch.Tensor) else None
    except RuntimeError:
        return None


def set_version_counter(t: torch.Tensor, version: int) -> None:
    if t.is_inference():        # an inference tensor (made under inference_mode) has no version counter
        return
    try:
        C_autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:           # torch < 2.12 takes one tensor
        C_autograd._unsafe_set_version_counter(t, version)


def functorch_interpreter_active() -> bool:
    """A functorch transform (vmap, grad) is running now."""
    functorch = getattr(torch._C, "_functorch", None)
    return functorch is not None and functorch.peek_interpreter_stack() is not None

# nn.Module's call path (the frames a read recording skips): _wrapped_call_impl is torch >= 2.1.
MODULE_CALL_CODES = frozenset(f.__code__ for f in (getattr(torch.nn.Module, "_call_impl"),
                                                   getattr(torch.nn.Module, "_wrapped_call_impl", None)) if f)


# A custom op's autograd kernel (``torch.library.custom_op``'s ``register_autograd``, or
# ``torch.library.register_autograd`` on a ``Library`` op): the forward of the autograd.Function it makes,
# whose closure holds the op and what holds the formula (``info``: the CustomOpDef, or an Info).
CUSTOM_OP_FORWARD = _nested_code(_library_autograd.make_autograd_impl, "forward")
CUSTOM_OPS = _custom_ops.OPDEFS     # qualified name -> CustomOpDef (weakly)


def queue_engine_callback(callback) -> None:
    """Run ``callback`` when the autograd engine finishes the current backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def replace_execution_engine(make) -> "Callable[[], None]":
    """Put ``make(engine)`` where Python's autograd finds the engine; return the undo."""
    from torch.autograd.variable import Variable
    engine = Variable._execution_engine
    Variable._execution_engine = make(engine)

    def restore():
        Variable._execution_engine = engine
    return restore


def replace_swap_tensor_impl(make) -> "Callable[[], None]":
    """Put ``make(torch's)`` where ``torch.utils.swap_tensors`` finds its last step (the swap of the
    two objects' C++ tensors); return the undo."""
    real = torch._C._swap_tensor_impl
    torch._C._swap_tensor_impl = make(real)

    def restore():
        torch._C._swap_tensor_impl = real
    return restore


torch_functions_off = torch._C.DisableTorchFunction
"""No torch function mode or subclass override sees what runs inside (a parameter's own attributes read)."""


def ddp_bucket_limits(ddp) -> list:
    """A DistributedDataParallel module's bucket caps in bytes, as DDP hands them to its bucket
    assignment (the last stands for every later bucket): its per-bucket caps where it was given
    ``bucket_cap_mb_list``, else ``[first bucket's cap, other buckets' cap]``."""
    import torch.distributed as dist
    config = getattr(ddp, "_bucket_config", None)
    if config is None:      # torch < 2.13: the caps are DDP's own attributes
        per, cap = list(getattr(ddp, "bucket_bytes_cap_list", ()) or ()), ddp.bucket_bytes_cap
        default = getattr(ddp, "bucket_bytes_cap_default", False)     # no bucket_cap_mb given: a small first
        return per or [getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", cap) if default else cap, cap]
    return list(config.per_bucket_bytes_caps or ()) or [config.first_bucket_bytes_cap, config.bucket_bytes_cap]


def ddp_bucket_assignment(params: list, limits: list) -> list:
    """DDP's assignment of ``params`` to buckets by size, as lists of indices."""
    import torch.distributed as dist
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    return indices


def reentrant_checkpoint():
    """The ``autograd.Function`` ``checkpoint(..., use_reentrant=True)`` applies (``None`` where gone)."""
    from torch.utils import checkpoint
    return getattr(checkpoint, "CheckpointFunction", None)


def replace_checkpoint_is_compiling(make) -> "Callable[[], None]":
    """Make ``torch.utils.checkpoint`` ask ``make(its own check)`` whether it is compiling (its
    selective checkpoint contexts act eagerly when told no); return the undo (nothing where torch
    has no such hook)."""
    from torch.utils import checkpoint
    real = getattr(checkpoint, "_is_compiling", None)
    if real is None:
        return lambda: None
    checkpoint._is_compiling = make(real)

    def restore():
        checkpoint._is_compiling = real
    return restore


def dynamo_source():
    """``torch._dynamo.source`` (importing torch._dynamo costs seconds: only on first use)."""
    import torch._dynamo.source as source
    return source


def inductor_api():
    """``(config, compile_fx_inner, select_decomp_table)`` of Inductor, imported on first use."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    return config, compile_fx_inner, select_decomp_table


def backed_symbols(shape_env) -> dict:
    """Symbols bound to input sizes, with their values (torch 2.13 renamed ``var_to_val``)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val


def dispatcher_has_kernel(qualified_name: str) -> bool:
    """Whether ``ns::name`` / ``ns::name.overload`` is a dispatcher operator with a kernel (a
    TorchScript-only builtin such as ``aten::save`` or ``aten::grad`` is not, and no trace records one)."""
    return torch._C._dispatch_has_kernel(qualified_name)


def data_dependent_errors() -> tuple:
    """What a fake tensor raises where an op's result depends on the data (``item()``, ``nonzero``)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode


def dynamo_fallback_errors() -> tuple:
    """The exceptions a ``torch.compile`` backend may raise for Dynamo to split its graph there and run
    that part eagerly (``torch._dynamo.exc.exceptions_allowed_to_be_fallback``: a data-dependent output
    shape, an operator fake tensors cannot run), as PyTorch's own backends raise them."""
    from torch._dynamo import exc
    return tuple(getattr(exc, "exceptions_allowed_to_be_fallback", ()))


def _spell_keyword_overloads() -> None:
    """fx writes a call to ``aten.random.from`` (``x.random_(0, 10)``) as
    ``torch.ops.aten.random.from(...)``, a SyntaxError whenever a graph holding it is compiled to
    Python (pytorch#151432; fixed in fx by pytorch#185456): spell an overload named by a Python
    keyword ``getattr(torch.ops.aten.random, 'from')``. Installed once, where this torch needs it."""
    import keyword

    import torch.fx.graph as fx_graph
    real = fx_graph._get_qualified_name
    if not keyword.iskeyword(real(getattr(torch.ops.aten.random, "from")).rsplit(".", 1)[-1]):
        return

    def qualified_name(func) -> str:
        head, *parts = real(func).split(".")
        for part in parts:
            head = f"getattr({head}, {part!r})" if keyword.iskeyword(part) else f"{head}.{part}"
        return head
    fx_graph._get_qualified_name = qualified_name


_spell_keyword_overloads()


def dynamo_errors() -> tuple:
    """``(BackendCompilerFailed, TorchDynamoException)``: what Dynamo wraps a backend's exception in
    (its ``inner_exception`` is the backend's own), and the base of Dynamo's own failures."""
    from torch._dynamo import exc
    return exc.BackendCompilerFailed, exc.TorchDynamoException


class Fsdp2:
    """What a capture needs of one FSDP2 unit's state (``fully_shard.state(unit)``), read from FSDP's
    private fields here: its modules, mixed-precision policy, whether it is idle, and per param group
    (``groups``: ``(the group object, Fsdp2Group)``) the mesh and parameters."""

    def __init__(self, unit):
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        state = unit._get_fsdp_state()
        self.owner, self.modules, self.policy = state, tuple(state._modules), state._mp_policy
        self.auto_reshard = bool(state._auto_reshard_after_forward)     # off for the root (FSDP's lazy init)
        self.idle = state._training_state == TrainingState.IDLE
        groups = state._fsdp_param_groups if hasattr(state, "_fsdp_param_groups") else \
            [g for g in [state._fsdp_param_group] if g is not None]
        self.groups = [(g, Fsdp2Group(g, self.policy)) for g in groups]
        self.offload = any(p.offload_to_cpu for g in groups for p in g.fsdp_params)


class Fsdp2Group:
    def __init__(self, g, policy):
        self.mesh = g.mesh_info.mesh
        pg = g.mesh_info.shard_process_group
        self.world, self.rank, self.group_name = pg.size(), pg.rank(), pg.group_name
        reduce = policy.reduce_dtype
        self.reduce_dtype = None if reduce == policy.param_dtype else reduce
        self.has_hook = g._all_reduce_hook is not None
        self.reshards = g.post_forward_mesh_info is not None     # reshard_after_forward
        self.params = [Fsdp2Param(p, policy) for p in g.fsdp_params]


class Fsdp2Param:
    def __init__(self, p, policy):
        info = p._module_info
        self.name, self.module = info.param_name, info.module
        self.shared = tuple(zip(info.shared_modules, info.shared_param_names))
        self.dim = p.fsdp_placement.dim if len(p.sharded_param.placements) == 1 else None     # None: 2-D (FSDP + TP)
        self.extension = hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")
        self.held = p.sharded_param
        orig = p.sharded_param.dtype
        self.param_dtype = None if policy.param_dtype in (None, orig) or not orig.is_floating_point \
            else policy.param_dtype


def fsdp2_divide_factors(group, reduce_dtype) -> tuple:
    """``(pre-divide, post-divide, reduce op name)`` FSDP2 uses for ``group``'s reduce-scatter."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    pre, post, op, _ = _get_gradient_divide_factors(
        group.mesh_info.shard_process_group, None, reduce_dtype, group.device.type, group.gradient_divide_factor,
        group.force_sum_reduction_for_comms)
    return pre, post, getattr(op, "name", str(op))


def functional_all_gather(x, world: int, group_name: str):
    """A waited functional all-gather on dim 0 (``_c10d_functional``)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group_name))


def functional_reduce_scatter(x, op: str, world: int, group_name: str):
    """A waited functional reduce-scatter on dim 0 (``_c10d_functional``)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, op, world, group_name))
