"""Thread-local modes a compiled graph must not see again when it runs.

Autocast is applied while tracing: the casts it chose are nodes of the graph.
Running the graph under the caller's autocast would cast a second time and
ignore ``autocast(enabled=False)`` regions inside the function, so graphs run
with autocast off on every device.
"""
from __future__ import annotations

import contextlib

import torch

from .._torch import cudnn_flags, get_mkldnn_enabled, is_any_autocast_enabled, set_cudnn_flags, set_mkldnn_enabled

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


def mismatch(was) -> str | None:
    """Why a graph traced under the modes ``was`` (``baked()`` then) cannot run under the caller's modes,
    or None when they are the same: the casts autocast chose, inference tensors and the default dtype
    are in the graph, so running it under others would silently compute something else."""
    now = baked()
    if was == now:
        return None
    return (f"called under other modes than captured ({describe(BAKED_NAMES, was, now)}): the graph has the "
            "casts of the captured modes baked in")


def describe(names, was, now) -> str:
    """``'CPU autocast was off, now on; ...'`` for the modes that differ."""
    def text(v):
        return ("on" if v else "off") if isinstance(v, bool) else str(v)
    return "; ".join(f"{n} was {text(a)}, now {text(b)}" for n, a, b in zip(names, was, now) if a != b)


def traced() -> tuple:
    """The modes a trace depends on (``TRACED_NAMES``): grad mode (which outputs require grad) and
    the baked ones; a jit entry or a Dynamo graph's cache entry runs only under its own."""
    return (torch.is_grad_enabled(), *baked())


TRACED_NAMES = ("grad mode", *BAKED_NAMES)


def global_state() -> tuple:
    """The settings a function can change and leave changed for the code after it (``GLOBAL_NAMES``):
    the modes a trace depends on and process-wide switches of torch's numerics."""
    return (*traced(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(), torch.get_float32_matmul_precision(), torch.get_num_threads(),
            *(get() for get in cudnn_flags), get_mkldnn_enabled(), _autocast_nesting())


def _autocast_nesting() -> int:
    """How many autocast regions are open (an entered, never exited one keeps casts cached)."""
    torch.autocast_increment_nesting()
    return torch.autocast_decrement_nesting()


GLOBAL_NAMES = (*TRACED_NAMES, "deterministic algorithms", "deterministic algorithms warn_only",
                "anomaly mode", "anomaly mode check_nan", "float32 matmul precision", "the number of threads",
                "cuDNN", "cuDNN benchmark", "cuDNN deterministic", "oneDNN", "open autocast regions")


def set_global_state(state: tuple) -> None:
    """Put back what :func:`global_state` read (inference mode, which only its context can end, aside)."""
    grad, _inference, cpu, cuda, cpu_dtype, cuda_dtype, dtype, det, warn, anomaly, nan, precision, threads, \
        cudnn_on, bench, cudnn_det, onednn, nesting = state
    torch.set_grad_enabled(grad)
    for dev, on, dt in (("cpu", cpu, cpu_dtype), ("cuda", cuda, cuda_dtype)):
        if _enabled(dev) != on:
            torch.set_autocast_enabled(dev, on)
        if dt is not None:
            torch.set_autocast_dtype(dev, dt)
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.set_anomaly_enabled(anomaly, nan)
    torch.set_float32_matmul_precision(precision)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for put, v in zip(set_cudnn_flags, (cudnn_on, bench, cudnn_det)):
        put(v)
    set_mkldnn_enabled(onednn)
    open_regions = _autocast_nesting()
    for _ in range(open_regions - nesting):     # regions entered and not exited: closed as __exit__ does
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


@contextlib.contextmanager
def put_back(state: tuple):
    """The settings are ``state`` (a :func:`global_state`) again when the block ends, however it ends."""
    try:
        yield
    finally:
        if global_state() != state:
            set_global_state(state)


@contextlib.contextmanager
def left_as_found():
    """Around a traced call of user code. A setting the code changes and leaves changed (a bare
    ``torch.set_grad_enabled(False)``, ``torch.use_deterministic_algorithms(True)``) is refused: eager
    leaves it so after every call, and the compiled function runs no Python to repeat it. Either
    way the settings are put back as they were (a refused capture changes nothing)."""
    before = global_state()
    with put_back(before):
        yield
        after = global_state()
    if after != before:
        from ..errors import UnsupportedError, caller_line
        raise UnsupportedError(
            f"the function changes global settings and leaves them changed ({describe(GLOBAL_NAMES, before, after)}): "
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
