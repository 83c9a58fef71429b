"""Run database entries in a child process, so that a hard crash of the
compiler (a C++ abort, a segfault, a hang inside a kernel) costs one sample,
not the whole sweep.

The child streams ``("start", index)`` / ``("result", record)`` per sample.
If it dies or goes silent, the sample it was in is recorded as a crash, a new
child is started, and the entry resumes after that sample.
"""
from __future__ import annotations

import multiprocessing
import time

from tests.conformance import sweep

_SLACK = 60.0   # seconds beyond the per-sample limit before a silent child is killed
_BUILD = 600.0  # seconds a child may take to import and generate an entry's samples


def _serve(conn, reference, opts):
    compile_fn = sweep.compiler(reference)
    tables = {}
    while True:
        job = conn.recv()
        if job is None:
            return
        db, key, max_samples, exclude, timeout = job
        if db not in tables:
            tables[db] = sweep.entries(db)
        if key not in tables[db]:
            conn.send(("end", {"samples": [{"index": -1, "outcome": "crash", "type": "UnknownEntry",
                                            "message": f"{db} has no entry {key!r}"}]}))
            continue
        res = sweep.run_entry(db, tables[db][key], compile_fn, max_samples=max_samples,
                              exclude=set(exclude), timeout=timeout,
                              report=lambda kind, value: conn.send((kind, value)), **opts)
        conn.send(("end", res))


class Worker:
    """A child process that runs entries; replaced whenever it dies."""

    def __init__(self, reference=False, **opts):
        self._ctx = multiprocessing.get_context("spawn")  # fork after torch's threads is unsafe
        self._args = (reference, opts)
        self._proc = None

    def _start(self):
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, *self._args), daemon=True)
        self._proc.start()
        child.close()

    def _ensure_started(self):
        if self._proc is None or not self._proc.is_alive():
            self._start()

    def _kill(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._proc = None

    def close(self):
        if self._proc is not None and self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(5)
        self._kill()

    def _receive(self, limit):
        """The next message, or None if the child died or stayed silent past ``limit``."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self._conn.poll(0.5):
                try:
                    return self._conn.recv()
                except EOFError:
                    return None
            if not self._proc.is_alive():
                return None
        return None

    def run_entry(self, db, key, *, max_samples=None, timeout=60.0):
        """Like ``sweep.run_entry``, surviving hard crashes of the child."""
        self._ensure_started()  # a first start is not this entry's time; a restart is
        start, results = time.perf_counter(), []
        while True:
            ended, current, progressed = self._attempt(db, key, max_samples, timeout, results)
            if ended is not None:
                results.extend(ended)
                break
            results.append(self._death(current))
            self._kill()
            if current is None and not progressed:
                break  # died outside any sample, without progress: resuming would repeat it
        return {"seconds": round(time.perf_counter() - start, 3), "samples": results}

    def _attempt(self, db, key, max_samples, timeout, results):
        """Run the entry's remaining samples in the child, appending to ``results``.

        Returns ``(records only the final message carries, or None if the child
        died; the sample it was in; whether it finished any sample)``.
        """
        self._ensure_started()
        self._conn.send((db, key, max_samples, [r["index"] for r in results], timeout))
        current, progressed, streamed = None, False, set()
        while True:
            msg = self._receive(_BUILD if current is None else timeout + _SLACK)
            if msg is None:
                return None, current, progressed
            kind, value = msg
            if kind == "start":
                current = value
            elif kind == "result":
                results.append(value)
                streamed.add(value["index"])
                current, progressed = None, True
            else:  # "end": a failed sample generation is reported only here
                return [r for r in value["samples"] if r["index"] not in streamed], None, progressed

    def _death(self, index):
        self._proc.join(5)  # a closed pipe can come a moment before the exit status
        alive = self._proc.is_alive()
        how = "stopped responding" if alive else f"died with exit code {self._proc.exitcode}"
        return {"index": -1 if index is None else index, "outcome": "crash", "type": "ProcessDied",
                "message": f"the worker process {how} (abort, segfault or hang in native code)"}
