"""A capture that records the Python state its trace read, for ``jit`` and ``capture`` alike.

The trace runs under :func:`aotgrad.guards.reads.record`; an assignment the traced code made
to recorded state is undone and refused (the graph would not repeat it); what it read is
returned as ``Read`` s for :func:`aotgrad.guards.state.build`.
"""
from __future__ import annotations

import sys

import torch

from .._torch import pytree

from .. import errors
from ..runtime.trees import input_name
from ..tracing.patches import COMPILED_AUTOGRAD_OFF
from . import reads, resolve


def root_name(fn, depth: int = 0) -> str:
    """How messages name the jitted object: a function by its name, a module by the variable
    the caller of ``aotgrad.jit`` holds it in (``model.fc.training``), else ``model``."""
    if not isinstance(fn, torch.nn.Module):
        return getattr(fn, "__name__", type(fn).__name__)
    if depth:
        frame = sys._getframe(depth + 1)
        for scope in (frame.f_locals, frame.f_globals):
            for k, v in scope.items():
                if v is fn and k.isidentifier() and not k.startswith("_"):
                    return k
    return "model"


def call_leaves(args, kwargs) -> list:
    """The call's non-tensor argument leaves (tensors as None), in pytree order."""
    return [None if isinstance(v, torch.Tensor) else v for v in pytree.tree_leaves((tuple(args), dict(kwargs)))]


def leaf_names(args, kwargs) -> list:
    """How messages name each of :func:`call_leaves` (as the input guards do: ``input 1``,
    ``input['past_key_values']``, with the path inside it)."""
    return [input_name(path) for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]]


_ATTEMPTS = 3


def recorded(fn, trace, leaves, name, names=()):
    """``(trace(), reads)``: run ``trace`` (a capture of ``fn``) recording what it read. A trace that
    read a global another thread changed meanwhile runs again (its graph may hold either value)."""
    for _ in range(_ATTEMPTS):
        captured, rec = _recorded_once(fn, trace, leaves, names)
        reads_ = resolve.assumed(fn, leaves, name, rec)
        raced = rec.raced(reads_)
        if raced is None:
            return captured, reads_
    raise errors.UnsupportedError(
        f"another thread changed `{raced}`, which the traced code reads, while it was captured, "
        f"{_ATTEMPTS} times: the graph may hold either value. Change it outside the first call, or "
        "make the first call before starting the thread that changes it", user_line=None)


def _recorded_once(fn, trace, leaves, names):
    rec, written = None, None       # undone once, whichever way the trace ends
    try:
        # Inside a compiled_autograd block, the joint trace's autograd.grad is traced, not captured.
        with reads.record(fn) as rec, COMPILED_AUTOGRAD_OFF():
            # The objects the call was given (a KV cache): whoever writes them, a library's code
            # included, changes the caller's state, which the compiled graph would not change again.
            for i, v in enumerate(leaves):
                rec.writes.given(v, names[i] if i < len(names) else f"input {i}")
            captured = trace()
    except Exception as e:
        written = rec.undo_writes() if rec is not None else []
        if written:     # the write is the cause (a buffer registered in the first trace broke the next)
            raise _refused(written, rec) from e
        raise
    finally:
        if written is None and rec is not None:
            written = rec.undo_writes()
    if written:
        raise _refused(written, rec)
    return captured, rec


# Globals Dynamo installs in the module of a function it compiles (builtins, imports it needs).
_DYNAMO_GLOBALS = ("__builtins_dict___", "__import_", "__compiled_fn_", "__resume_at_")
COMPILED_INSIDE = (
    "torch.compile's Dynamo runs inside the captured function ({why}), for a function or module compiled "
    "with torch.compile or an op that compiles its body with it (torch.cond, flex_attention): aotgrad "
    "traces the whole function itself; call the uncompiled one inside (a compiled module's `_orig_mod`, a "
    "compiled function's `_torchdynamo_orig_callable`), or compile the outer function with "
    "torch.compile(backend=\"aotgrad\")")


def _refused(written, rec) -> errors.UnsupportedError:
    what, key = written[0]
    if isinstance(key, str) and key.startswith(_DYNAMO_GLOBALS):
        return errors.UnsupportedError(
            COMPILED_INSIDE.format(why=f"Dynamo installed its global `{key}` while compiling it there"),
            user_line=reads.store_line(rec, key) or errors.caller_line())
    return errors.UnsupportedError(
        f"the traced code {what} (Python state outside the tensors that outlives the call); the compiled "
        "graph would not repeat the write, so later calls would differ from eager. Keep that state "
        "in a tensor buffer or update it outside the compiled function", user_line=reads.store_line(rec, key))
