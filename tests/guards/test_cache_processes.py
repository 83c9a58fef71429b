"""The disk cache across processes: a second process loads what the first
compiled; processes racing to write one key leave a whole entry; what changed between
them (an installed library's code, an enum member's value, the contents of a deque,
array, bytearray or NumPy global, an attribute read through ``object.__getattribute__``)
is compiled again, what did not is loaded."""
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotgrad.store import disk

ROOT = Path(__file__).resolve().parents[2]


def _start(cache_dir, *argv, path=()):
    env = {**os.environ, "AOTGRAD_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join((str(ROOT), *path)),
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.guards.cache_worker", *argv], cwd=ROOT, env=env,
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


# What each case reads, as first written and as changed in a later process.
_LIBRARY = """import torch


def act(x):
    return torch.{act}(x)


class Scaler:
    def apply(self, x):
        return x * {scale}
"""
_CASES = """import array
import collections
import enum

import numpy as np

import tinylib


class Color(enum.Enum):
    RED = {enum}


class History(collections.deque):
    pass


class Box:
    def __init__(self):
        self.k = {attr}


HISTORY = History([{deque}, 2.0])
ARR = array.array("d", [{array}, 2.0])
BUF = bytearray([{buf}])
NP = np.array([{np_array}, 2.0])
NPS = np.float32({np_scalar})
SCALER = tinylib.Scaler()
BOX = Box()


def library_function(x):
    return tinylib.act(x) * 2


def library_method(x):
    return SCALER.apply(x)


def enum_member(x):
    return x * Color.RED.value


def deque_subclass(x):
    return x * HISTORY[0] + HISTORY[-1]


def array(x):
    return x * ARR[0]


def bytearray(x):
    return x * BUF[0]


def numpy_array(x):
    return x * float(NP[0])


def numpy_scalar(x):
    return x * float(NPS)


def getattribute(x):
    return x * object.__getattribute__(BOX, "k")
"""
_FIRST = {"act": "relu", "scale": 2.0, "enum": 2.0, "deque": 1.0, "array": 1.0, "buf": 2, "np_array": 1.0,
          "np_scalar": 2.0, "attr": 2.0}
_CHANGED = {"library_function": {"act": "sigmoid"}, "library_method": {"scale": 3.0}, "enum_member": {"enum": 3.0},
            "deque_subclass": {"deque": 5.0}, "array": {"array": 4.0}, "bytearray": {"buf": 5},
            "numpy_array": {"np_array": 6.0}, "numpy_scalar": {"np_scalar": 2.5}, "getattribute": {"attr": 7.0}}


def _stale_run(cache_dir, tmp_path, changed):
    """One worker process over every case, with the cases in ``changed`` changed since the first."""
    values = dict(_FIRST)
    for case in changed:
        values.update(_CHANGED[case])
    lib = tmp_path / "site-packages" / "tinylib"     # an installed library: under a site-packages directory
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "__init__.py").write_text(_LIBRARY.format(**values))
    (tmp_path / "stale_cases.py").write_text(_CASES.format(**values))
    return _result(_start(cache_dir, "stale", path=(str(tmp_path), str(tmp_path / "site-packages"))))


def _changed_then_unchanged(cache_dir, tmp_path, changed):
    cold = _stale_run(cache_dir, tmp_path, ())
    assert set(cold) == set(_CHANGED) and not any(cold.values()), cold
    warm = _stale_run(cache_dir, tmp_path, changed)     # each compared with eager by the worker
    assert warm == {case: case not in changed for case in _CHANGED}, warm


def test_what_changed_between_processes_compiles_again_the_rest_loads(cache_dir, tmp_path):
    _changed_then_unchanged(cache_dir, tmp_path, ("library_function", "enum_member", "deque_subclass", "bytearray",
                                                  "numpy_scalar"))


@pytest.mark.slow
def test_the_other_half_changed_between_processes(cache_dir, tmp_path):
    _changed_then_unchanged(cache_dir, tmp_path, ("library_method", "array", "numpy_array", "getattribute"))
