"""Thread-local modes a compiled graph must not see again when it runs.

Autocast is applied while tracing: the casts it chose are nodes of the graph.
Running the graph under the caller's autocast would cast a second time and
ignore ``autocast(enabled=False)`` regions inside the function, so graphs run
with autocast off on every device.
"""
from __future__ import annotations

import contextlib

import torch

from .._torch import (cudnn_flags, fp32_setting, function_stack_at, get_cudnn_allow_tf32, get_mkldnn_enabled,
                      is_any_autocast_enabled, len_torch_function_stack, set_cudnn_flags, set_fp32_setting,
                      set_mkldnn_enabled)
from ..scoped import look_away

_DEVICES = ("cpu", "cuda", "xpu", "mps")


@contextlib.contextmanager
def autocast_off():
    with contextlib.ExitStack() as stack:
        for dev in _DEVICES:
            if _enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield


def _enabled(dev: str) -> bool:
    try:
        return torch.is_autocast_enabled(dev)
    except RuntimeError:        # a device type this build does not know
        return False


def baked() -> tuple:
    """The thread-local modes a trace bakes into its graph (inference mode, autocast per device and its
    dtype, the default dtype): a graph runs only under the ones it was traced under (``BAKED_NAMES``)."""
    cpu, cuda = torch.is_autocast_enabled("cpu"), _enabled("cuda")
    return (torch.is_inference_mode_enabled(), cpu, cuda, torch.get_autocast_dtype("cpu") if cpu else None,
            torch.get_autocast_dtype("cuda") if cuda else None, torch.get_default_dtype())


BAKED_NAMES = ("inference mode", "CPU autocast", "CUDA autocast", "CPU autocast dtype", "CUDA autocast dtype", "the default dtype")


def is_baked(value) -> bool:
    """Whether ``value`` has the shape of :func:`baked`'s tuple (a loaded artifact's modes are checked)."""
    def dtype(v, none_ok):
        return isinstance(v, torch.dtype) or (none_ok and v is None)
    return (type(value) is tuple and len(value) == len(BAKED_NAMES) and all(type(v) is bool for v in value[:3])
            and dtype(value[3], True) and dtype(value[4], True) and dtype(value[5], False))


def function_modes() -> tuple:
    """The torch function modes entered (a ``TorchFunctionMode``, ``torch.device(...)`` as a context,
    ``set_default_device``), innermost last, each by its class and its plain settings (a
    ``DeviceContext``'s device): what they made of the torch functions a trace called is in its graph."""
    n = len_torch_function_stack()
    return () if n == 0 else tuple(_described(function_stack_at(i)) for i in range(n))


_SETTINGS = (bool, int, float, str, type(None), torch.device, torch.dtype)


def _described(mode) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in sorted(getattr(mode, "__dict__", {}).items()) if type(v) in _SETTINGS)
    return f"{type(mode).__module__}.{type(mode).__qualname__}({settings})"


def mismatch(was, function_modes_were=None) -> str | None:
    """Why a graph traced under the modes ``was`` (``baked()`` then; and the torch function modes
    ``function_modes_were``, where given) cannot run under the caller's modes, or None when they are
    the same: the casts autocast chose, inference tensors, the default dtype and what a function mode
    did are in the graph, so running it under others would silently compute something else."""
    was, now = (*was, function_modes_were), (*baked(), function_modes() if function_modes_were is not None else None)
    if was == now:
        return None
    return f"called under other modes than captured ({describe(TRACED_NAMES[1:], was, now)}): the graph has the " \
        "captured modes baked in"


def describe(names, was, now) -> str:
    """``'CPU autocast was off, now on; ...'`` for the modes that differ."""
    def text(v):
        return ("on" if v else "off") if isinstance(v, bool) else str(v)
    return "; ".join(f"{n} was {text(a)}, now {text(b)}" for n, a, b in zip(names, was, now) if n and a != b)


def traced() -> tuple:
    """The modes a trace depends on (``TRACED_NAMES``): grad mode (which outputs require grad), the
    baked ones and the torch function modes; a jit entry or a Dynamo graph's cache entry runs only
    under its own."""
    return (torch.is_grad_enabled(), *baked(), function_modes())


TRACED_NAMES = ("grad mode", *BAKED_NAMES, "torch function modes")


def global_state() -> tuple:
    """The settings a function can change and leave changed for the code after it (``GLOBAL_NAMES``):
    grad mode, the baked modes and process-wide switches of torch's numerics."""
    return (torch.is_grad_enabled(), *baked(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(), fp32_setting(), torch.get_num_threads(),
            *(get() for get in cudnn_flags), get_mkldnn_enabled(), _autocast_nesting())


def numerics() -> tuple:
    """The settings a CUDA kernel reads when it runs, not when it is traced (``NUMERICS_NAMES``): an op
    traced while the function had them changed runs, compiled, under the caller's. Read unseen by the
    read recording (not the traced code's read)."""
    return _unwatched(_numerics)


def _numerics() -> tuple:
    return (fp32_setting(), get_cudnn_allow_tf32(),
            *(get() for get in cudnn_flags[1:]), torch.are_deterministic_algorithms_enabled())


NUMERICS_NAMES = ("float32 matmul precision", "cuDNN TF32", "cuDNN benchmark", "cuDNN deterministic",
                  "deterministic algorithms")


def numerics_now(at_entry: tuple) -> str | None:
    """Which of :func:`numerics` differ from ``at_entry`` now (read unseen by the read recording)."""
    now = numerics()
    return None if now == at_entry else describe(NUMERICS_NAMES, at_entry, now)


def _autocast_nesting() -> int:
    """How many autocast regions are open (an entered, never exited one keeps casts cached)."""
    torch.autocast_increment_nesting()
    return torch.autocast_decrement_nesting()


GLOBAL_NAMES = ("grad mode", *BAKED_NAMES, "deterministic algorithms", "deterministic algorithms warn_only",
                "anomaly mode", "anomaly mode check_nan", "float32 matmul precision", "the number of threads",
                "cuDNN", "cuDNN benchmark", "cuDNN deterministic", "oneDNN", "open autocast regions")


def _put_autocast(dev):
    def put(on, dtype):
        if _enabled(dev) != on:
            torch.set_autocast_enabled(dev, on)
        if dtype is not None:
            torch.set_autocast_dtype(dev, dtype)
    return put


def _close_regions(nesting):
    for _ in range(_autocast_nesting() - nesting):     # regions entered and not exited: closed as __exit__ does
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


# How each setting of global_state() is put back: (its indices, the setter taking their values). Inference
# mode (1) only its context can end.
_PUTTERS = (((0,), torch.set_grad_enabled), ((2, 4), _put_autocast("cpu")), ((3, 5), _put_autocast("cuda")),
            ((6,), torch.set_default_dtype), ((7, 8), lambda det, warn: torch.use_deterministic_algorithms(
                det, warn_only=warn)), ((9, 10), torch.set_anomaly_enabled),
            ((11,), set_fp32_setting), ((12,), torch.set_num_threads),
            *(((13 + k,), put) for k, put in enumerate(set_cudnn_flags)), ((16,), set_mkldnn_enabled),
            ((17,), _close_regions))

# The process-wide settings (another thread's setter changes them for this thread too; the others are
# thread-local), by the name of the C function that sets them: a watched capture's thread
# (``guards.attribution``) notes each value it set.
SETTERS = {"_set_default_dtype": (6,), "_set_default_tensor_type": (6,), "_set_deterministic_algorithms": (7, 8),
           "set_anomaly_enabled": (9, 10), "_set_float32_matmul_precision": (11,), "_set_cublas_allow_tf32": (11,),
           "_set_fp32_precision_setter": (11,), "set_num_threads": (12,), "_set_cudnn_enabled": (13,),
           "_set_cudnn_benchmark": (14,), "_set_cudnn_deterministic": (15,), "_set_mkldnn_enabled": (16,)}
PROCESS_WIDE = frozenset(i for ix in SETTERS.values() for i in ix)


def set_global_state(state: tuple, keep=frozenset()) -> None:
    """Put back what :func:`global_state` read, but the settings at the indices ``keep``; a setting
    that has the value already is not set again (another thread may be setting it)."""
    now = global_state()
    want = [v if i not in keep else now[i] for i, v in enumerate(state)]
    for ix, put in _PUTTERS:
        if any(want[i] != now[i] for i in ix):
            put(*(want[i] for i in ix))


@contextlib.contextmanager
def put_back(state: tuple):
    """The settings are ``state`` (a :func:`global_state`) again when the block ends, however it ends."""
    try:
        yield
    finally:
        if global_state() != state:
            set_global_state(state)


@contextlib.contextmanager
def left_as_found(watch=None):
    """Around a traced call of user code. A setting the code changes and leaves changed (a bare
    ``torch.set_grad_enabled(False)``, ``torch.use_deterministic_algorithms(True)``) is refused: eager
    leaves it so after every call, and the compiled function runs no Python to repeat it. Either
    way the settings are put back as they were (a refused capture changes nothing).

    ``watch`` (other threads were alive when the capture began: ``guards.attribution.Watch``) holds
    ``switches``, the value of each process-wide setting right after this thread last set it. A
    process-wide setting this thread did not set, or set back, and another thread changed meanwhile
    is that thread's: kept, not refused. One both changed is refused, and the other thread's value kept."""
    before = _unwatched(global_state)
    outer = watch.switches if watch is not None else None
    if watch is not None:
        watch.switches = {}
    try:
        yield
    finally:
        now = _unwatched(global_state)
        mine = watch.switches if watch is not None else None
        if watch is not None:
            watch.switches = {**outer, **mine}
        changed = _differ(before, now)
        theirs, both = _theirs(changed, before, now, mine)
        if changed - theirs:
            _unwatched(set_global_state, before, theirs)
    if changed - theirs or both:
        _refuse_left_changed(before, now, changed - theirs | both, both)


def _unwatched(fn, *args):
    """``fn(*args)`` unseen by this thread's profile function: reading and putting back the settings
    around the traced code is not the traced code reading them (``guards.reads`` records its reads)."""
    with look_away():
        return fn(*args)


def _differ(a, b) -> set:
    return {i for i, (x, y) in enumerate(zip(a, b)) if x != y}


def _theirs(changed, before, after, mine) -> tuple:
    """``(kept, both)``: of the ``changed`` settings, those another thread changed (kept as it left
    them): process-wide ones this thread did not set (``mine``: the value right after it last set
    each; None where no other thread was alive), or set to other than they are now; and among them
    those this thread had left changed too (refused)."""
    if mine is None:
        return set(), set()
    theirs = {i for i in changed & PROCESS_WIDE if i not in mine or mine[i] != after[i]}
    return theirs, {i for i in theirs if i in mine and mine[i] != before[i]}


def _refuse_left_changed(before, after, which, both):
    from ..errors import UnsupportedError, caller_line
    names = [n if i in which else "" for i, n in enumerate(GLOBAL_NAMES)]
    also = (" (another thread changed {} meanwhile too: its value is kept)".format(
        ", ".join(GLOBAL_NAMES[i] for i in sorted(both))) if both else "")
    raise UnsupportedError(
        f"the function changes global settings and leaves them changed ({describe(names, before, after)}){also}: "
        "eager leaves them so after every call, the compiled function would not repeat the change; change "
        "them in a with-block inside the function (torch.no_grad(), torch.autocast(...)) or before calling it",
        user_line=caller_line())


def without_autocast(graph_fn, backward: bool = False):
    """``graph_fn`` run with autocast off; free when autocast is off already.

    A ``backward`` graph was traced with autocast off, as ``.backward()`` called outside an
    autocast region runs it; called inside one, eager would autocast the backward's ops
    too, so that is refused rather than computed differently."""
    any_enabled = is_any_autocast_enabled

    def call(*args):
        if not any_enabled():
            return graph_fn(*args)
        if backward:
            from ..errors import UnsupportedError, caller_line
            raise UnsupportedError("backward() inside an autocast region: eager would run the backward's ops "
                                   "under autocast, the compiled backward was traced without it; call backward() "
                                   "after leaving the autocast block, as PyTorch recommends",
                                   user_line=caller_line())
        with autocast_off():
            return graph_fn(*args)
    call._boxed_call = getattr(graph_fn, "_boxed_call", False)
    call.__wrapped__ = graph_fn
    return call


def rng_states() -> tuple:
    """The global RNG states (CPU and initialised CUDA devices), e.g. those a forward started from."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_states(states) -> None:
    """Put back what :func:`rng_states` read."""
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
