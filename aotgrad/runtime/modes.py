"""Thread-local modes a compiled graph must not see again when it runs.

Autocast is applied while tracing: the casts it chose are nodes of the graph.
Running the graph under the caller's autocast would cast a second time and
ignore ``autocast(enabled=False)`` regions inside the function, so graphs run
with autocast off on every device.
"""
from __future__ import annotations

import contextlib

import torch

from .._torch import is_any_autocast_enabled

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
