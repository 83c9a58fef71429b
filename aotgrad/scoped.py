"""Run-time state scoped to one thread (or asyncio task) instead of the process.

A capture, a compiled backward or a ``compiled_autograd`` block pushes what the code it calls
needs to find (the seeds its function set, the log of random ops, the callbacks its hooks
queue) and pops it at the end. Kept in a module-level list, that state was shared: a capture in
one thread saw the seeds or the callbacks of another. ``Stack`` keeps it in a context variable,
so each thread starts with an empty stack and nested scopes stack as before.

Settings that are process-wide by nature (torch's globals, patched functions) cannot be scoped:
``Shared`` applies them once for all the scopes that need them at the same time.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from contextvars import ContextVar


class Stack:
    """A list-like stack private to the running context (thread or asyncio task).

    The value is a tuple replaced on each change, so a context copied by ``asyncio`` or
    ``contextvars.copy_context`` never shares a mutable list with the one it was copied from."""

    def __init__(self, name: str):
        self._var: ContextVar[tuple] = ContextVar(name, default=())

    def append(self, item) -> None:
        self._var.set(self._var.get() + (item,))

    def pop(self):
        items = self._var.get()
        self._var.set(items[:-1])
        return items[-1]

    def clear(self) -> None:
        self._var.set(())

    def __getitem__(self, i):
        return self._var.get()[i]

    def __len__(self) -> int:
        return len(self._var.get())

    def __bool__(self) -> bool:
        return bool(self._var.get())

    def __iter__(self):
        return iter(self._var.get())

    def __repr__(self) -> str:
        return f"Stack({list(self._var.get())!r})"


class Shared:
    """Process-wide settings (torch's globals, patched functions) needed by every scope open now,
    in any thread: the first scope in applies them and the last one out restores them.

    Each scope saving and restoring them itself would, interleaved across threads, let one
    scope "restore" the patched values another one saved, leaving them patched for good."""

    def __init__(self, apply):
        self._apply = apply         # () -> the function that restores what it changed
        self._lock = threading.Lock()
        self._users, self._restore = 0, None

    @contextlib.contextmanager
    def __call__(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def acquire(self) -> None:
        with self._lock:
            if not self._users:
                self._restore = self._apply()
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._users:
                restore, self._restore = self._restore, None
                restore()

    @property
    def users(self) -> int:
        return self._users


def _pause_gc():
    """Stop Python's cyclic garbage collector; return the function that starts it again (if it ran).

    Capturing and compiling allocate hundreds of thousands of long-lived objects (graph nodes, fake
    tensors, their metadata) and free few cycles: the collector's passes over them were a tenth of a
    deep model's capture, and a full pass landing in the middle made timings jump. The objects that
    become garbage meanwhile are collected by the first pass after."""
    import gc
    if not gc.isenabled():
        return lambda: None
    gc.disable()
    return gc.enable


GC_PAUSED = Shared(_pause_gc)
"""Held while a capture traces or a compile partitions and compiles (in any thread)."""


FX_TRACING = threading.RLock()
"""Held around every ``make_fx`` trace: fx's tracer patches ``Module.__call__`` and ``__getattr__``
through one process-wide patcher (``torch.fx._symbolic_trace.CURRENT_PATCHER``), which two traces
in two threads at once undo for each other (an AssertionError, or its patches left installed for
good). Captures in several threads trace their forwards side by side and take turns here."""


C_PROFILER = None
"""``(take_profile, CProfile)`` of ``guards/_tags.c`` where it is built (``guards.reads``, which imports it,
puts them here): a profiler written in C taken whole."""


def take_profile():
    """This thread's profiler, to put back with :func:`restore_profile`: ``sys.getprofile()``'s function, or
    a profiler written in C (cProfile on Python 3.11, torch.profiler's Python tracer: ``sys.getprofile()``
    shows only its object, no profile function) taken whole where ``guards/_tags.c`` is built, as a
    callable that passes each event on to it."""
    return sys.getprofile() if C_PROFILER is None else C_PROFILER[0]()


def chainable(saved):
    """What a profile function of ours calls after itself: ``saved`` (:func:`take_profile`) where it
    passes events on; None for none, or for a C profiler's bare object (``_tags`` not built), which
    then pauses while ours runs and is put back after (:func:`restore_profile`)."""
    return saved if callable(saved) else None


def restore_profile(saved) -> None:
    """Make ``saved`` (:func:`take_profile`, taken earlier) this thread's profiler again: a C profiler
    taken whole exactly as it was; a bare C profiler's object through its ``enable()`` (cProfile's, with
    its default flags: ``sys.setprofile`` of the object would raise at the next event); else none."""
    if C_PROFILER is not None and type(saved) is C_PROFILER[1]:
        saved.restore()
    elif saved is None or callable(saved):
        sys.setprofile(saved)
    elif callable(getattr(saved, "enable", None)):
        sys.setprofile(None)
        saved.enable()
    else:
        sys.setprofile(None)


_WATCHES = threading.local()    # .users: per aotgrad watch of this thread begun, the profiler it found


@contextlib.contextmanager
def watched(saved):
    """aotgrad watches this thread with a profile function of its own inside the block; ``saved``
    (:func:`take_profile`) is the profiler it found, which that function passes events to."""
    users = getattr(_WATCHES, "users", None)
    if users is None:
        users = _WATCHES.users = []
    users.append(saved)
    try:
        yield
    finally:
        users.pop()


@contextlib.contextmanager
def look_away():
    """aotgrad's watch of this thread (if any) sees nothing inside the block, and the user's own
    profiler (the one the outermost watch found) runs there instead, so it sees every event with
    no gap: a profiler that pairs calls with returns (Python's ``profile``, torch.profiler's Python
    tracer) fails on a return whose call it never saw. Outside a watch: nothing changes."""
    users = getattr(_WATCHES, "users", None)
    if not users:
        yield
        return
    before = take_profile()
    restore_profile(users[0])
    try:
        yield
    finally:
        restore_profile(before)
