"""Every stage as it happens: its record, a Chrome trace event, a log line, the progress line.

:func:`timed` is the one place a stage is measured: it appends a :class:`Step` to the stage
object's history, emits a Chrome trace event (the format Perfetto and chrome://tracing load) to
every active sink, logs the step under ``aotgrad.stages`` and feeds the TTY progress line.

Every ``timed`` stage becomes one complete ("X") event in each active sink; records logged under
``aotgrad.*`` while a sink is active (a jit recompile and its reason, for instance) become instant
("i") events.

    with aotgrad.observe.trace("trace.json"):
        step = aotgrad.capture(f, x).compile()

``AOTGRAD_TRACE=path.json`` traces the whole process and writes at exit.

The progress line, on a terminal only: when stages have been running for more than ``after``
seconds, stderr shows ``aotgrad: <stage> 3.1s`` and keeps it current (the elapsed time counts from
the first of the stages that follow each other); the line is cleared as each stage ends, so nothing
the program prints lands on it. Silent when stderr is not a TTY or ``AOTGRAD_LOG=quiet``.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

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



def quiet() -> bool:
    return os.environ.get("AOTGRAD_LOG", "").strip().lower() == "quiet"


class Progress:
    GAP = 0.5        # seconds between stages that still count as one compile

    def __init__(self, stream=None, after: float = 2.0, every: float = 0.25):
        self.stream, self.after, self.every = stream, after, every
        self.stack: list[str] = []
        self.run_start = self.last_exit = 0.0
        self.shown = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def enabled(self) -> bool:
        out = self._out()
        return not quiet() and hasattr(out, "isatty") and out.isatty()

    def enter(self, name: str) -> None:
        if not self.enabled():
            return
        with self._lock:
            now = time.perf_counter()
            if not self.stack and now - self.last_exit > self.GAP:
                self.run_start = now
            self.stack.append(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="aotgrad-progress", daemon=True)
                self._thread.start()

    def exit(self) -> None:
        with self._lock:
            if self.stack:
                self.stack.pop()
                self.last_exit = time.perf_counter()
            if not self.stack and self.shown:
                self._write("\r\x1b[K")      # clear now, before the program prints; redrawn if a stage follows
                self.shown = False

    def _loop(self) -> None:
        while True:
            time.sleep(self.every)
            with self._lock:
                now = time.perf_counter()
                if self.stack and now - self.run_start >= self.after:
                    self._write(f"\r\x1b[Kaotgrad: {' > '.join(self.stack)}  {now - self.run_start:.1f}s")
                    self.shown = True
                elif not self.stack and now - self.last_exit > self.GAP:
                    self._thread = None      # idle: stop; the next stage starts a new one
                    return

    def _write(self, text: str) -> None:
        try:
            self._out().write(text)
            self._out().flush()
        except (OSError, ValueError):
            pass        # a closed terminal must never break a compile


progress = Progress()


log = logging.getLogger("aotgrad.stages")


@dataclass(frozen=True)
class Step:
    name: str
    seconds: float
    info: dict = field(default_factory=dict)

    def __str__(self) -> str:
        facts = ", ".join(f"{k}={v}" for k, v in self.info.items())
        return f"{self.name:<22} {self.seconds * 1e3:9.1f} ms  {facts}"


@contextlib.contextmanager
def timed(history: list, name: str, **info):
    """Append a :class:`Step` to ``history`` when the block ends; the block may add to ``info``."""
    progress.enter(name)
    start_us = now_us()
    start = time.perf_counter()
    try:
        yield info
    except BaseException as e:
        emit(name, start_us, now_us() - start_us, {**info, "error": type(e).__name__})
        raise
    else:
        seconds = time.perf_counter() - start
        history.append(Step(name, seconds, info))
        emit(name, start_us, seconds * 1e6, info)
        log.debug("%s took %.1f ms %s", name, seconds * 1e3, info)
    finally:
        progress.exit()


from_environment()
