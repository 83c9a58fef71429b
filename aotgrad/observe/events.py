"""Chrome trace events (the format Perfetto and chrome://tracing load).

Every ``timed`` stage becomes one complete ("X") event in each active sink;
records logged under ``aotgrad.*`` while a sink is active (a jit recompile
and its reason, for instance) become instant ("i") events.

    with aotgrad.observe.trace("trace.json"):
        step = aotgrad.capture(f, x).compile()

``AOTGRAD_TRACE=path.json`` traces the whole process and writes at exit.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from ..options import keywords_checked

_lock = threading.Lock()
# Process-wide on purpose, not scoped: a trace (and AOTGRAD_TRACE) records every thread, each
# event tagged with its tid; _lock guards the list.
_sinks: list["TraceSink"] = []
_ROOT = logging.getLogger("aotgrad")


def now_us() -> float:
    return time.perf_counter_ns() / 1e3


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


class TraceSink:
    """Collects events; ``write()`` saves them as a trace-event JSON object."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = path
        self.events: list[dict] = []

    def add(self, event: dict) -> None:
        self.events.append(event)

    def document(self) -> dict:
        pid = os.getpid()
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "aotgrad"}}]
        return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms",
                "otherData": {"producer": "aotgrad"}}

    def write(self, path=None) -> None:
        path = path or self.path
        if path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.document(), f, indent=None, separators=(",", ":"))


def active() -> bool:
    return bool(_sinks)


def emit(name: str, start_us: float, dur_us: float | None, args: dict, cat: str = "aotgrad") -> None:
    """Send one event to every active sink: complete ("X") with a duration, else instant ("i")."""
    if not _sinks:
        return
    event = {"name": name, "cat": cat, "ph": "X" if dur_us is not None else "i", "ts": start_us,
             "pid": os.getpid(), "tid": threading.get_native_id(), "args": _jsonable(args)}
    if dur_us is None:
        event["s"] = "p"
    else:
        event["dur"] = dur_us
    with _lock:
        for s in _sinks:
            s.add(event)


class _LogBridge(logging.Handler):
    """Turns ``aotgrad.*`` log records into instant events (e.g. ``recompiling f: <reason>``)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        args = {"message": message, "logger": record.name, "level": record.levelname}
        emit(message.split(":", 1)[0][:80], now_us(), None, args, cat="log")


_bridge = _LogBridge(logging.INFO)
_saved_level: list[int] = []


def _attach(sink: TraceSink) -> None:
    with _lock:
        if not _sinks:
            _ROOT.addHandler(_bridge)
            # INFO records must reach the bridge; only when nobody chose a level for aotgrad.
            _saved_level.append(_ROOT.level)
            if _ROOT.level == logging.NOTSET:
                _ROOT.setLevel(logging.INFO)
        _sinks.append(sink)


def _detach(sink: TraceSink) -> None:
    with _lock:
        _sinks.remove(sink)
        if not _sinks:
            _ROOT.removeHandler(_bridge)
            _ROOT.setLevel(_saved_level.pop())


@keywords_checked("aotgrad.trace")
@contextlib.contextmanager
def trace(path: str | os.PathLike | None = None):
    """Record every aotgrad stage inside the block; write ``path`` (Chrome trace JSON) at the end.

    Yields the :class:`TraceSink`; with ``path=None`` its ``events`` are only kept in memory.
    """
    sink = TraceSink(path)
    _attach(sink)
    try:
        yield sink
    finally:
        _detach(sink)
        sink.write()


def from_environment(environ=os.environ) -> TraceSink | None:
    """Start the process-wide sink that ``AOTGRAD_TRACE=path.json`` asks for; it writes at exit."""
    path = environ.get("AOTGRAD_TRACE")
    if not path:
        return None
    sink = TraceSink(path)
    _attach(sink)
    atexit.register(sink.write)
    return sink


from_environment()
