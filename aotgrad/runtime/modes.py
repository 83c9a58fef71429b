"""Thread-local modes a compiled graph must not see again when it runs.

Autocast is applied while tracing: the casts it chose are nodes of the graph.
Running the graph under the caller's autocast would cast a second time and
ignore ``autocast(enabled=False)`` regions inside the function, so graphs run
with autocast off on every device.
"""
from __future__ import annotations

import contextlib

import torch

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


def without_autocast(graph_fn):
    """``graph_fn`` run with autocast off; free when autocast is off already."""
    any_enabled = torch._C._is_any_autocast_enabled

    def call(*args):
        if not any_enabled():
            return graph_fn(*args)
        with autocast_off():
            return graph_fn(*args)
    call._boxed_call = getattr(graph_fn, "_boxed_call", False)
    call.__wrapped__ = graph_fn
    return call
