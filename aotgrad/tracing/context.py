"""The tracing thread's state: one context, entered and left like a ``with`` block.

While the user's code runs under a trace, aotgrad's interceptions (``tracing.patches``) and its
passes need to find what the capture running *in this thread* keeps: the seeds the code set, the
hook record, the RNG log, the reused blocks. All of it is one immutable :class:`Trace` in one
context variable: a scope replaces some fields and puts the whole value back when it ends, so a
nested trace (a block's template inside the joint, a checkpoint recompute) sees its own values
and its caller's again afterwards, and another thread, which starts with an empty context, sees
none of them.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Trace:
    """What the traces running in this thread hold (the innermost value of each field)."""
    traceable: bool = False     # under capture.session.traceable_ops: is_compiling() is True, seeds are noted
    seeds: list | None = None   # torch.manual_seed's (seed, user line) while traceable (refused before random ops)
    eager_path: bool = False    # inputs.step.eager_paths: is_compiling() answers False again inside the trace
    backward: object = None     # torch.autograd.backward in a traced forward: None (eager's), REFUSE, or a step's own
    hooks: object = None        # runtime.hooks.Recorder: hooks the traced program registers
    rng: object = None          # passes.rng_positions._Log: where each random op draws
    blocks: object = None       # capture.blocks.Reuse: calls of repeated blocks go through templates
    direct: object = None       # capture.block_graph.Direct: the joint trace's block parameters
    data: object = None         # inputs.step: what ``t.data = v`` does while a training step is traced
    checkpointed: bool = False  # in a traced reentrant checkpoint's function (its recompute too): nested ones convert
    tangents: tuple = ()        # while the joint's backward is traced: the gradients it is given (the caller's)


REFUSE = True
"""``Trace.backward`` while a user forward is traced: ``backward()`` and ``.grad`` are refused."""

_NONE = Trace()
_CURRENT: ContextVar[Trace] = ContextVar("aotgrad.trace", default=_NONE)
current = _CURRENT.get
"""``current()``: the running context's :class:`Trace` (every field empty outside a trace)."""


@contextlib.contextmanager
def scope(**fields):
    """This thread's :class:`Trace` with ``fields`` replaced, until the block ends."""
    token = _CURRENT.set(replace(_CURRENT.get(), **fields))
    try:
        yield
    finally:
        _CURRENT.reset(token)
