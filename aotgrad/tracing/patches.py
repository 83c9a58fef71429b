"""Every process-wide change aotgrad makes while it traces, in one place.

PyTorch offers no per-thread way to intercept these functions, so each is replaced process-wide,
for as long as some capture in some thread needs it (``scoped.Shared``: the first scope in applies
it, the last one out restores it). Each replacement reads the running thread's
:class:`~aotgrad.tracing.context.Trace` and passes straight through where it holds nothing, so
another thread never sees a capture's effect. The replacements only dispatch: what a call means to
a capture is a method of the object the capture put in its context.

=====================  ===========================================================  ======================
patch                  what it replaces                                             the context field read
=====================  ===========================================================  ======================
``TRACEABLE``          ``torch.manual_seed``, ``torch.random.manual_seed``,         ``traceable``,
                       ``torch.compiler.is_compiling``; the RNN ops (``torch.lstm``  ``seeds``,
                       and ``torch._VF``'s: oneDNN off while a traced one is        ``eager_path``
                       dispatched, ``ONEDNN_OFF``); the effect tokens of
                       ``aten::_linalg_check_errors``/``aten::_print``
``ONEDNN_OFF``         oneDNN's switch, off for as long as some thread dispatches   ``traceable``
                       a traced RNN op (RNNs trace into plain ATen ops)
``MODULE_CALLS``       ``torch.nn.Module.__call__``                                 ``blocks``
``TENSOR_HOOKS``       ``Tensor.register_hook``, ``register_post_accumulate_grad_   ``hooks``
                       hook``, ``retain_grad``
``FUNCTIONS``          ``torch.autograd.Function.apply`` (reentrant checkpointing   ``hooks``
                       runs as the non-reentrant one)
``RNG_STATE``          ``torch[.random|.cuda].get_rng_state``/``set_rng_state``;   ``rng``
                       ``torch.utils.checkpoint``'s ``_is_compiling``
``FORWARD_ONLY``       ``torch.autograd.backward``; ``.grad``, ``.is_leaf``,        ``backward``
                       ``.grad_fn``, ``._version``, ``._base`` and ``is_inference()``
                       of a FunctionalTensor; its ``untyped_storage()``
                       (``resize_`` is ``resize_storage_bytes_``)
``COMPILED_AUTOGRAD``  the autograd engine's compiler slot (off: the capture's      (none: off for all)
_OFF                   ``autograd.grad`` is traced, not compiled)
``TENSOR_DATA``        ``torch.Tensor.data``'s setter (``t.data = new``);           ``data``
                       ``torch.utils.swap_tensors`` (refused on traced tensors)
=====================  ===========================================================  ======================

What a trace changes elsewhere is per object or per thread, not process-wide: a held module's
``_parameters``/``_buffers`` become per-thread views (``tracing.views``), the class of a module
whose scalar attributes are watched reads attributes through a ``__getattribute__`` that passes
other instances' and threads' reads through, for the length of a block template's trace
(``guards.reads.attribute_reads``), a captured optimizer's ``step`` is wrapped on
the instance (``inputs.step``), the joint trace's own fx tracer records stack traces its cheaper way
(``_torch.user_stack_traces``), and the read recording is this thread's ``sys.setprofile``
(``guards.reads.record``). At run time (not while tracing) a compiled backward swaps the autograd
engine object for one that keeps queued callbacks (``compiled_autograd.opaque``).
"""
from __future__ import annotations

import inspect
import sys

import torch

from .. import errors
from .._torch import (
    ERROR_NODE, FX_MODULE_CALL_WRAPPER, VF, FunctionalTensor, compiled_autograd_engine, get_mkldnn_enabled,
    reentrant_checkpoint, replace_checkpoint_is_compiling, replace_swap_tensor_impl, set_mkldnn_enabled, simple_registry,
)
from ..scoped import Shared
from .context import REFUSE, current, scope

# Ops that exist only for their side effect (they raise, or print) carry an effect token when
# traced, which aotgrad's graphs do not model; with their effect unregistered they are plain nodes
# that dead-code elimination and the partitioner treat as side effects (ir.ops.has_side_effect).
PLAIN_EFFECTS = ("aten::_linalg_check_errors", "aten::_print")


def _traceable():
    """The settings under which traced graphs run correctly outside the trace
    (``capture.session.traceable_ops``): effect-only checks are plain nodes, an RNN op traces into
    plain ATen ops, ``torch.manual_seed`` notes the seed, ``is_compiling()`` is True."""
    holders = [simple_registry.find(name).effect for name in PLAIN_EFFECTS]
    saved = [h.effect for h in holders]
    seeders = (torch.manual_seed, torch.random.manual_seed)
    is_compiling = torch.compiler.is_compiling
    seed = seeders[1]

    def manual_seed(s):
        t = current()
        if t.traceable and t.seeds is not None:     # another thread's seeding is its own business
            t.seeds.append((s, errors.caller_line()))
        return seed(s)

    def compiling():
        t = current()
        return (t.traceable and not t.eager_path) or is_compiling()

    for h in holders:
        h.register(None)
    undo_rnns = _plain_rnns()
    torch.manual_seed = torch.random.manual_seed = manual_seed
    torch.compiler.is_compiling = compiling

    def restore():
        torch.compiler.is_compiling = is_compiling
        torch.manual_seed, torch.random.manual_seed = seeders
        undo_rnns()
        for h, effect in zip(holders, saved):
            h.register(effect)
    return restore


RNN_OPS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def _plain_rnns():
    """A traced RNN op (``nn.LSTM``'s ``_VF.lstm``, ``torch.lstm``) is dispatched with oneDNN off
    (``ONEDNN_OFF``): its fused ``mkldnn_rnn_layer`` returns an undefined workspace tensor at run time
    that Python cannot pass back to its backward. The switch is process-wide, so it is off only
    while the op is dispatched: the traced code (``if torch.backends.mkldnn.enabled:``) and other
    threads read the user's value."""
    vf = vars(VF)
    originals = {name: getattr(VF, name) for name in RNN_OPS}

    def plain(real):
        def rnn(*args, **kwargs):
            if not current().traceable:
                return real(*args, **kwargs)
            with ONEDNN_OFF():
                return real(*args, **kwargs)
        return rnn
    for name, real in originals.items():
        vf[name] = plain(real)      # the VFModule's own dict answers before its __getattr__
        setattr(torch, name, vf[name])

    def restore():
        for name, real in originals.items():
            vf.pop(name, None)
            setattr(torch, name, real)
    return restore


def _onednn_off():
    on = get_mkldnn_enabled()
    set_mkldnn_enabled(False)
    return lambda: set_mkldnn_enabled(on)


def _module_calls():
    """Module calls go to this thread's block reuse (``Trace.blocks.call``); make_fx's tracer calls
    them through the class's ``__call__`` too (``_torch.modules_called_as_now``)."""
    before = _BEFORE["call"] = torch.nn.Module.__dict__["__call__"]

    def dispatch(module, *args, **kwargs):
        reuse = current().blocks
        if reuse is not None:
            return reuse.call(module, args, kwargs)
        return before(module, *args, **kwargs)
    torch.nn.Module.__call__ = _BEFORE["dispatch"] = dispatch

    def restore():
        torch.nn.Module.__call__ = before
    return restore


_BEFORE: dict = {}      # "call": Module.__call__ as it was before MODULE_CALLS; "dispatch": what it put there


def module_call():
    """``Module.__call__`` as the program has it, through what stands in for it for a while in any
    thread: a capture's block dispatch (``MODULE_CALLS``), make_fx's tracer's wrapper of it."""
    call = torch.nn.Module.__dict__["__call__"]
    for _ in range(4):
        if getattr(call, "__code__", None) is FX_MODULE_CALL_WRAPPER and hasattr(call, "__wrapped__"):
            call = call.__wrapped__
        elif call is _BEFORE.get("dispatch"):
            call = _BEFORE["call"]
        else:
            break
    return call


def flat_call(module, *args, **kwargs):
    """Call ``module`` as ``Module.__call__`` does without ``MODULE_CALLS`` (a block run flat)."""
    return _BEFORE["call"](module, *args, **kwargs)


def _tensor_hooks():
    """Hook registration goes to this thread's recorder (``Trace.hooks.register`` / ``.retain``)."""
    T = torch.Tensor
    originals = {name: T.__dict__.get(name) for name in
                 ("register_hook", "register_post_accumulate_grad_hook", "retain_grad")}
    plain = {name: getattr(T, name) for name in originals}

    def method(name):
        def intercepted(self, hook):
            rec = current().hooks
            return plain[name](self, hook) if rec is None else rec.register(plain[name], self, hook, name)
        return intercepted

    def retain_grad(self):
        rec = current().hooks
        return plain["retain_grad"](self) if rec is None else rec.retain(plain["retain_grad"], self)
    T.register_hook = method("register_hook")
    T.register_post_accumulate_grad_hook = method("register_post_accumulate_grad_hook")
    T.retain_grad = retain_grad

    def restore():
        for name, value in originals.items():
            if value is None:
                delattr(T, name)
            else:
                setattr(T, name, value)
    return restore


def _functions():
    """Custom Functions applied in a traced program are shown to this thread's recorder
    (``Trace.hooks.applied``), which checks what their backward writes."""
    Function = torch.autograd.Function
    original = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        t = current()
        rec = t.hooks
        if (rec is not None or t.checkpointed) and cls is reentrant_checkpoint():
            return _as_non_reentrant(*args)
        out = original.__get__(None, cls)(*args, **kwargs)     # torch 2.14.1's apply is a C classmethod_descriptor
        if rec is not None and not getattr(cls, "aotgrad_writes_nothing", False):      # aotgrad's own Functions
            rec.applied(cls, args, out, errors.caller_line())
        return out
    Function.apply = classmethod(apply)

    def restore():
        Function.apply = original
    return restore


def _as_non_reentrant(function, preserve_rng_state, *args):
    """``checkpoint(function, *args, use_reentrant=True)`` inside a trace, whose backward is the joint's
    ``autograd.grad`` (reentrant checkpointing runs ``backward()`` in its own backward, and refuses
    ``grad``): the non-reentrant implementation recomputes the same ops from the same RNG state. Eager's
    reentrant one gives no gradient where no tensor argument requires grad (its outputs are detached,
    the parameters inside get none; it warns so): that is kept. The function runs with nested reentrant
    checkpoints converted too, in its recompute as well (the joint's backward, outside the user forward's
    hook recording): the forward and its recompute save the same tensors."""
    from torch.utils import checkpoint
    if not (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        import warnings
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=3)
        with torch.no_grad():
            return function(*args)

    def converting(*a):
        with FUNCTIONS(), scope(checkpointed=True):      # the recompute runs after the forward's patches end
            return function(*a)
    return checkpoint.checkpoint(converting, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


def _rng_targets():
    """(module, attribute, default device) of each RNG-state function."""
    targets = [(m, name, "cpu") for m in (torch, torch.random) for name in ("get_rng_state", "set_rng_state")]
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        targets += [(cuda, "get_rng_state", "cuda"), (cuda, "set_rng_state", "cuda")]
    return targets


def _rng_state():
    """RNG-state saves and restores go to this thread's RNG log (``Trace.rng.got`` / ``.setting``);
    checkpoint's selective contexts act as they do eagerly while one is kept."""
    targets = _rng_targets()
    originals = [getattr(m, name) for m, name, _ in targets]

    def getter(real, default):
        def get_rng_state(device=None):
            state = real() if default == "cpu" else real(device if device is not None else default)
            log = current().rng
            if log is not None:
                log.got(state, device, default)
            return state
        return get_rng_state

    def setter(real, default):
        def set_rng_state(new_state, device=None):
            log = current().rng
            if log is not None:
                log.setting(new_state, device, default)
            return real(new_state) if default == "cpu" else real(new_state, device if device is not None else default)
        return set_rng_state
    for (m, name, default), real in zip(targets, originals):
        setattr(m, name, (getter if name == "get_rng_state" else setter)(real, default))
    undo_checkpoint = replace_checkpoint_is_compiling(
        lambda real: lambda *a, **k: False if current().rng is not None else real(*a, **k))

    def restore():
        undo_checkpoint()
        for (m, name, _), real in zip(targets, originals):
            setattr(m, name, real)
    return restore


def _forward_only():
    """While a user forward is traced in this thread (``Trace.backward``): ``backward()`` and reading
    a traced tensor's ``.grad`` are refused with the user's line, or a whole step's backward runs."""
    backward = torch.autograd.backward

    def checked_backward(*args, **kwargs):
        mode = current().backward
        if mode is REFUSE:
            raise errors.UnsupportedError(
                "backward() inside the captured function: aotgrad captures the backward itself; return the "
                "loss and call .backward() on the compiled function's result. (A function that reaches a "
                "torch.optim.Optimizer through its globals, closure or self's attributes is captured as a whole "
                "training step; this one reaches none: an optimizer passed as an argument, or a module whose "
                "forward trains, is not found)", user_line=errors.caller_line())
        if mode is not None:        # a whole training step is traced: its own backward (inputs.step)
            return mode(*args, **kwargs)
        return backward(*args, **kwargs)

    def grad(self, *value):
        if current().backward is REFUSE:      # torch's own reads too (clip_grad_norm_ in a forward)
            raise errors.UnsupportedError(
                "reading or setting .grad of a traced tensor inside the captured function: the graph cannot "
                "see eager's accumulated gradients; read .grad outside it", user_line=errors.caller_line())
        return torch.Tensor.grad.__set__(self, *value) if value else torch.Tensor.grad.__get__(self)

    def history(name):
        real = getattr(torch.Tensor, name).__get__

        def read(self):
            if current().backward is REFUSE and _is_traced_input(self) \
                    and not errors.in_packages(sys._getframe(1).f_code.co_filename):
                raise errors.UnsupportedError(
                    f"reading .{name} of an input that requires grad (an argument or a parameter) inside the captured "
                    f"function: in the trace it stands in for the caller's tensor with a history of its own, so the "
                    f"answer would not be eager's (a parameter is a leaf, an argument may not be); read it outside",
                    user_line=errors.caller_line())
            return real(self)
        return property(read)

    def unseen(name, what, method=False):
        """``._version``, ``._base``, ``is_inference()`` of a traced tensor, read by the user's code: the
        trace's tensor has its own counter, base and flag, not the caller's (an input written before the
        call, a view, an inference tensor), so the graph would hold the answer of a tensor eager never had."""
        real = getattr(torch.Tensor, name)

        def read(self, *a):
            if current().backward is REFUSE and not errors.in_packages(sys._getframe(1).f_code.co_filename):
                raise errors.UnsupportedError(
                    f"reading {what} of a traced tensor inside the captured function: the trace's tensor stands in "
                    "for eager's and has its own, so the graph would hold an answer eager's tensor need not give; "
                    "read it outside and pass what you need as an argument", user_line=errors.caller_line())
            return real(self, *a) if method else real.__get__(self)
        return read if method else property(read)
    torch.autograd.backward = checked_backward
    FunctionalTensor.grad = property(grad, grad)
    FunctionalTensor.is_leaf, FunctionalTensor.grad_fn = history("is_leaf"), history("grad_fn")
    FunctionalTensor._version, FunctionalTensor._base = unseen("_version", "._version"), unseen("_base", "._base")
    FunctionalTensor.is_inference = unseen("is_inference", ".is_inference()", method=True)
    FunctionalTensor.untyped_storage = lambda self: _TracedStorage(self)

    def restore():
        torch.autograd.backward = backward
        del FunctionalTensor.grad, FunctionalTensor.is_leaf, FunctionalTensor.grad_fn, FunctionalTensor.untyped_storage
        del FunctionalTensor._version, FunctionalTensor._base, FunctionalTensor.is_inference
    return restore


class _TracedStorage:
    """A traced tensor's storage as the user's forward sees it: ``resize_(n)`` is
    ``resize_storage_bytes_`` of the tensor (as Dynamo rewrites it), which the capture's functional
    mode tracks (``capture.session.Storages``); the rest is the functional wrapper's storage's. The user's
    code may not read its size (``nbytes()``, ``size()``, ``len()``): no guard checks a storage's size (a
    tensor laid out the same may sit in a larger one), and the trace's wrapper keeps its size on entry,
    so a branch on it after a resize would take the other path than eager's."""

    def __init__(self, t):
        self._t, self._storage = t, torch.Tensor.untyped_storage(t)

    def resize_(self, nbytes):
        torch.ops.inductor.resize_storage_bytes_(self._t, nbytes)
        return self

    def __getattr__(self, name):
        if name in ("nbytes", "size") and not errors.in_packages(sys._getframe(1).f_code.co_filename):
            _refuse_storage_size()
        return getattr(self._storage, name)

    def __len__(self):
        if not errors.in_packages(sys._getframe(1).f_code.co_filename):
            _refuse_storage_size()
        return len(self._storage)


def _refuse_storage_size():
    raise errors.UnsupportedError(
        "reading the size of a traced tensor's storage (untyped_storage().nbytes(), .size(), len()) inside the "
        "captured function: the graph holds values, not storages, and no guard checks a storage's size (a tensor "
        "laid out the same may sit in a larger one; a resize inside the function is replayed after the graph "
        "runs); read it outside, or keep the decision in a Python flag", user_line=errors.caller_line())


def _tensor_data():
    """``t.data = v`` in a traced program goes to this thread's trace (``Trace.data``, a training step's
    rule for its parameters, else :func:`traced_data_write`); anywhere else, to torch's own setter."""
    own = inspect.getattr_static(torch.Tensor, "data")      # the C getset (Tensor does not define its own)

    def set_data(t, v):
        now = current()
        if now.hooks is None:       # no user program traced in this thread
            return own.__set__(t, v)
        return (now.data or traced_data_write)(own, t, v)
    torch.Tensor.data = property(own.__get__, set_data)

    def refusing(swap):
        def swap_impl(t1, t2):
            if current().hooks is not None and (isinstance(t1, FunctionalTensor) or isinstance(t2, FunctionalTensor)):
                raise errors.UnsupportedError(
                    "torch.utils.swap_tensors on a tensor the captured function takes or computes: it swaps the two "
                    "Python objects, which the graph does not hold; swap them outside the function, or write values "
                    "in place (`with torch.no_grad(): t.copy_(new)`)", user_line=errors.caller_line())
            return swap(t1, t2)
        return swap_impl
    undo_swap = replace_swap_tensor_impl(refusing)

    def restore():
        del torch.Tensor.data
        undo_swap()
    return restore


def traced_data_write(own, t, v):
    """``t.data = v`` while a program is traced. Eager points ``t`` at ``v``'s storage and layout,
    keeping ``t``'s autograd identity: traced as ``with torch.no_grad(): t.set_(v)`` where both are the
    trace's tensors of one dtype and device. A write between tensors the trace does not hold is
    torch's own; any other would change a tensor the graph never writes, or be lost: refused."""
    traced = isinstance(t, FunctionalTensor), isinstance(v, FunctionalTensor)
    if not any(traced):
        return own.__set__(t, v)
    if all(traced) and t.dtype == v.dtype and t.device == v.device:
        with torch.no_grad():
            t.set_(v)
        return None
    raise errors.UnsupportedError(
        "`.data = ` inside the captured function " + (
            "with a tensor of another dtype or device" if all(traced) else
            "between a tensor the function computes and one it does not hold (a global, a closed-over tensor)")
        + ": the graph cannot repeat it; write the values in place (`with torch.no_grad(): t.copy_(new)`)",
        user_line=errors.caller_line())


def _is_traced_input(t) -> bool:
    """A traced input that requires grad: its functional stand-in's history is one ``Error`` node
    (made when the input was wrapped), which no tensor of eager's has."""
    node = torch.Tensor.grad_fn.__get__(t)
    return type(node) is ERROR_NODE and not node.next_functions


def _compiled_autograd_off():
    """The engine's compiler slot emptied (a capture's ``autograd.grad`` is traced, not compiled)."""
    prior = compiled_autograd_engine.set_autograd_compiler(None, False)
    return lambda: compiled_autograd_engine.set_autograd_compiler(*prior)


TRACEABLE = Shared(_traceable)
ONEDNN_OFF = Shared(_onednn_off)
MODULE_CALLS = Shared(_module_calls)
TENSOR_HOOKS = Shared(_tensor_hooks)
FUNCTIONS = Shared(_functions)
RNG_STATE = Shared(_rng_state)
FORWARD_ONLY = Shared(_forward_only)
COMPILED_AUTOGRAD_OFF = Shared(_compiled_autograd_off)
TENSOR_DATA = Shared(_tensor_data)

PATCHES = {"TRACEABLE": TRACEABLE, "ONEDNN_OFF": ONEDNN_OFF, "MODULE_CALLS": MODULE_CALLS, "TENSOR_HOOKS": TENSOR_HOOKS,
           "FUNCTIONS": FUNCTIONS, "RNG_STATE": RNG_STATE, "FORWARD_ONLY": FORWARD_ONLY,
           "COMPILED_AUTOGRAD_OFF": COMPILED_AUTOGRAD_OFF, "TENSOR_DATA": TENSOR_DATA}
"""Every capture-time patch, by name (tests check none is left applied after a capture)."""
