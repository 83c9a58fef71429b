"""A one-line progress display for long compiles, on a terminal only.

When stages have been running for more than ``after`` seconds, stderr shows
``aotgrad: <stage> 3.1s`` and keeps it current (the elapsed time counts from
the first of the stages that follow each other); the line is cleared as each
stage ends, so nothing the program prints lands on it. Silent when stderr is not a TTY or ``AOTGRAD_LOG=quiet``.
"""
from __future__ import annotations

import os
import sys
import threading
import time


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


current = Progress()
