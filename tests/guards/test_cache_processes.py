"""The disk cache across processes: a second process loads what the first
compiled; processes racing to write one key leave a whole entry."""
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotgrad.store import disk

ROOT = Path(__file__).resolve().parents[2]


def _start(cache_dir):
    env = {**os.environ, "AOTGRAD_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.guards.cache_worker"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "ignoring the cache entry" not in err, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_racing_processes_then_a_second_process_hits(cache_dir):
    racers = [_start(cache_dir) for _ in range(3)]
    for r in racers:
        cold = _result(r)
        assert cold["dynamic"] in ([False, False], [True, True], [True, False], [False, True])
        assert cold["sdpa_gpt"] in ([False], [True])
    warm = _result(_start(cache_dir))
    assert warm == {"module": [True], "function": [True], "dynamic": [True, True], "sdpa_gpt": [True],
                    "examples_gpt": [True]}


def _writer(cache_dir, wid, rounds):
    os.environ["AOTGRAD_CACHE_DIR"] = cache_dir
    for r in range(rounds):
        disk.store("stress", "k", (wid, r, chr(65 + wid) * 300_000))


def _reader(cache_dir, rounds, bad):
    os.environ["AOTGRAD_CACHE_DIR"] = cache_dir
    for _ in range(rounds):
        v = disk.load("stress", "k")
        if v is not None and v[2] != chr(65 + v[0]) * 300_000:
            bad.value += 1
    bad.value += len(disk._warned)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_concurrent_writers_of_one_key_never_leave_a_torn_entry(cache_dir):
    ctx = multiprocessing.get_context("fork")
    bad = ctx.Value("i", 0)
    procs = [ctx.Process(target=_writer, args=(str(cache_dir), w, 40)) for w in range(4)]
    procs.append(ctx.Process(target=_reader, args=(str(cache_dir), 200, bad)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert bad.value == 0
    wid, r, data = disk.load("stress", "k")
    assert r == 39 and data == chr(65 + wid) * 300_000
    assert not list(cache_dir.glob(".*.tmp")), "temporary files left behind"
