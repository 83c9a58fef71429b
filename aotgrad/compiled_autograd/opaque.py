"""Python calls the compiled-autograd graph makes at run time, opaque to the compiler.

Each is a plain function the graph calls with real tensors and the real
Python objects (hooks, autograd ``ctx``) the engine hands in; none of them is
traced through, so arbitrary Python in a hook or a custom backward is safe.
"""
from __future__ import annotations

import torch

from .._torch import compiled_autograd_engine, replace_execution_engine
from ..scoped import Shared, Stack


def call_hook(hook, *args, hook_type: str):
    """A tensor/node hook; ``None`` from a hook means "keep the value"."""
    result = hook(*args)
    if hook_type == "post_acc_grad_hook":
        if result is not None:
            raise RuntimeError("Tensor post accumulate grad hooks should return None.")
        return args[0]
    return args[0] if result is None else result


class _SavedCtx:
    """The real autograd ``ctx`` with its saved tensors taken from the graph's inputs."""

    def __init__(self, ctx, saved_tensors):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", tuple(saved_tensors))

    @property
    def saved_variables(self):
        return self.saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def call_backward(ctx, saved_tensors, *grads, expected=()):
    """Run a ``torch.autograd.Function``'s Python backward as the eager engine would;
    ``expected``: the inputs whose gradient the captured graph reads."""
    fake = _SavedCtx(ctx, saved_tensors)
    out = ctx._forward_cls.backward(fake, *grads)
    out = out if isinstance(out, tuple) else (out,)
    for i in expected:
        if out[i] is None:
            from ..errors import UnsupportedError, caller_line
            raise UnsupportedError(
                f"under compiled autograd, the backward of custom autograd.Function {ctx._forward_cls.__name__} "
                f"returned None for input {i}, which requires grad, and the captured graph adds a gradient "
                "there; return torch.zeros_like(...) for it, or run this backward outside compiled_autograd",
                user_line=caller_line())
    return out


def accumulate_grad(variable: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``variable.grad += grad`` with eager's rules: the first gradient is copied in
    the variable's layout, later ones are added in place (grad mode is off here)."""
    with torch.no_grad():
        if variable.grad is None:
            new = torch.empty_strided(variable.size(), variable.stride(),
                                      dtype=variable.dtype, device=variable.device)
            variable.grad = new.copy_(grad)
        else:
            variable.grad.add_(grad)
    return variable.grad


def set_grad(variable: torch.Tensor, value: torch.Tensor) -> None:
    """A variable's first gradient, computed in the graph, becomes its ``.grad``."""
    variable.grad = value


def saved_symbols(ctx) -> tuple:
    """The sizes an aotgrad forward saved on ``ctx`` (read, not traced: they vary per run;
    the capture's assumptions about them are checked before the run, see runtime.py)."""
    return tuple(ctx.symbols)


def call_cpp_tensor_pre_hooks(hook_id: int, grad: torch.Tensor) -> torch.Tensor:
    """C++ tensor pre-hooks (``retain_grad``), run by the engine that registered them."""
    return compiled_autograd_engine.call_cpp_tensor_pre_hooks(hook_id, grad)


# Callbacks queued with ``Variable._execution_engine.queue_callback`` by the hooks of
# each compiled backward running now (innermost last); see ``queued_callbacks``.
_QUEUED = Stack("aotgrad.queued_callbacks")


class _QueueingEngine:
    """Stands in for the autograd engine object while compiled backwards run: the engine's own
    graph task is never finished, so a callback queued in a thread running one is kept in that
    thread's list; one queued anywhere else goes to the engine."""

    def __init__(self, engine):
        self._engine = engine

    def queue_callback(self, callback) -> None:
        if _QUEUED:
            _QUEUED[-1].append(callback)
        else:
            self._engine.queue_callback(callback)

    def __getattr__(self, name):
        return getattr(self._engine, name)


# The engine object is process-wide: installed once for all the compiled backwards running now.
_QUEUEING = Shared(lambda: replace_execution_engine(_QueueingEngine))


def collect_callbacks() -> None:
    """Until ``stop_collecting``, callbacks hooks queue are kept for ``run_final_callbacks``."""
    _QUEUEING.acquire()
    _QUEUED.append([])


def stop_collecting() -> None:
    _QUEUED.pop()
    _QUEUEING.release()


def run_final_callbacks() -> None:
    """Where eager autograd runs the queued callbacks: after everything else, in queue
    order, including any a callback queues."""
    callbacks = _QUEUED[-1] if _QUEUED else []
    i = 0
    while i < len(callbacks):
        callbacks[i]()
        i += 1
    callbacks.clear()


IMPURE = frozenset({call_hook, call_backward, accumulate_grad, call_cpp_tensor_pre_hooks,
                    set_grad, run_final_callbacks})
