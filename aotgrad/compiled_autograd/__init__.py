"""Compiled autograd: capture a whole ``.backward()`` as one graph and run it compiled.

    with aotgrad.compiled_autograd("eager") as ca:
        loss.backward()
    print(ca.explain())        # captures, why each one missed the cache, graph sizes

The engine (C++) walks the autograd graph and calls ``capture.CaptureInstance``;
its result is cached by the engine on the graph's structure (node types, edges,
non-tensor saved values) and on its sizes: the first capture is static, a size
that changes is lifted as a symbolic input from then on (automatic dynamic), so
one more capture serves every later batch size. ``accumulate.py`` traces ``.grad``
accumulation into the graph and runs it early; ``runtime.py`` turns a capture
into what runs, recapturing from the ``tape.py`` recording when a run's sizes
break the capture's assumptions; ``explain.py`` says why a backward was
(re)captured.
"""
from __future__ import annotations

import contextlib

import torch

from .._torch import compiled_autograd_engine
from .. import backends
from . import ddp
from .capture import CaptureInstance
from .explain import ACTIVE, CompiledAutograd
from .tape import Tape
from ..options import keywords_checked

__all__ = ["compiled_autograd", "CompiledAutograd"]

_engine = compiled_autograd_engine
# Process-wide on purpose, not scoped: it names the compiler that filled the engine's cache, and
# that cache (like the engine's compiler slot) is one per process, shared by every thread.
_last_compiler = [None]


@keywords_checked("aotgrad.compiled_autograd")
@contextlib.contextmanager
def compiled_autograd(compiler="eager"):
    """Run every backward inside the block through a captured, compiled graph.

    ``compiler`` is a backend name (``"eager"``, ``"inductor"``) or a graph
    compiler ``(gm, example_inputs) -> callable``. Yields a ``CompiledAutograd``
    that records each capture and the reason it missed the cache.
    """
    compile_fn = backends.get(compiler)
    if _last_compiler[0] is not compile_fn:
        _engine.clear_cache()   # the engine's cache does not know which compiler filled it
        _last_compiler[0] = compile_fn
    state = CompiledAutograd(compile_fn)
    def factory():
        return Tape(CaptureInstance(state.on_capture))
    ddp.prepare()     # DDP modules' C++ reducer cannot run in a compiled backward: ours replaces it
    # False: sizes start static, the engine lifts one once it changes (automatic dynamic).
    prior = _engine.set_autograd_compiler(factory, False)
    ACTIVE.append(state)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            yield state
    except RuntimeError as e:
        ddp.refuse_cpp_reducer(e)     # a DDP configuration only its C++ reducer implements: typed
        _refuse_uncollectable(e)
        raise
    finally:
        ACTIVE.pop()
        _engine.set_autograd_compiler(*prior)


def _refuse_uncollectable(error: RuntimeError) -> None:
    """The engine's refusal to collect a backward (a nested tensor's gradient, say), raised while
    it walks the graph, before any of it ran: a typed error naming the ``.backward()`` line."""
    text = str(error)
    if not isinstance(error, NotImplementedError) or "compiled_autograd" not in text:
        return
    from ..errors import UnsupportedError, user_frame
    raise UnsupportedError(f"compiled autograd cannot capture this backward: {text.splitlines()[0]}",
                           user_line=user_frame(error.__traceback__)) from error


def reset() -> None:
    """Forget every compiled backward (the engine's cache is process-wide)."""
    _engine.clear_cache()
    _last_compiler[0] = None


# ``aotgrad.compiled_autograd`` is this function once re-exported; keep reset reachable.
compiled_autograd.reset = reset
