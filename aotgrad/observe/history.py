"""Every stage and pass records its name, duration and a few facts.

``timed`` is the one place a stage is measured: it appends a :class:`Step` to
the stage object's history, emits a Chrome trace event to any active trace
sink, logs the step under ``aotgrad.stages`` and feeds the TTY progress line.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from . import progress
from . import events as _trace

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
    progress.current.enter(name)
    start_us = _trace.now_us()
    start = time.perf_counter()
    try:
        yield info
    except BaseException as e:
        _trace.emit(name, start_us, _trace.now_us() - start_us, {**info, "error": type(e).__name__})
        raise
    else:
        seconds = time.perf_counter() - start
        history.append(Step(name, seconds, info))
        _trace.emit(name, start_us, seconds * 1e6, info)
        log.debug("%s took %.1f ms %s", name, seconds * 1e3, info)
    finally:
        progress.current.exit()
