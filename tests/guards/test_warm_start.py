"""The warm start: a second process's first call is served by the disk cache, for ``aotgrad.jit``
and for ``torch.compile(backend="aotgrad")``, without aotgrad capturing, partitioning or
tracing anything again; and a changed line, constant or default is never served a stale entry,
``aotgrad.explain`` saying why the stored one was not used."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import aotgrad
from aotgrad.guards import cache

ROOT = Path(__file__).resolve().parents[2]
# Stages of a capture and a partition; a warm first call runs none of them.
CAPTURE = {"setup", "trace joint", "simplify", "analyze", "input guards", "partition", "cache store"}


def _worker(cache_dir, names, program=None):
    env = {**os.environ, "AOTGRAD_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    env.pop("AOTGRAD_CACHE", None)
    cmd = [sys.executable, "-m", "tests.guards.warm_worker", ",".join(names)]
    cmd += ["--program", str(program)] if program else []
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ignoring the cache entry" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_cold(run):
    assert run["hits"] == [False] and "trace joint" in run["stages"], run


def _assert_warm(run):
    assert run["hits"] == [True], run
    assert not CAPTURE & set(run["stages"]), f"stages ran on a warm start: {CAPTURE & set(run['stages'])}"
    assert "stored partition" in run["stages"], run


@pytest.mark.slow
@pytest.mark.parametrize("names", [("gpt_tiny", "cnn", "mlp", "gpt_sdpa"), ("gpt_small",)],
                         ids=["small_models", "gpt_small"])
def test_second_process_loads_every_entry(cache_dir, names):
    cold, warm = _worker(cache_dir, names), _worker(cache_dir, names)
    for name in names:
        for compiler in ("jit", "dynamo"):
            _assert_cold(cold[name][compiler])
            _assert_warm(warm[name][compiler])
        assert "loaded from the disk cache" in warm[name]["jit"]["explain"]


PROGRAM = '''
import torch

SCALE = 2.0


def act(x, slope=0.1):
    return torch.nn.functional.leaky_relu(x, slope) * SCALE


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return act(self.fc(x)).sum()


def INPUTS():
    torch.manual_seed(0)
    return (torch.randn(3, 4, requires_grad=True),)
'''


@pytest.mark.slow
@pytest.mark.parametrize("edit, why", [
    (("SCALE = 2.0", "SCALE = 3.0"), "'2.0' when stored, now '3.0' at warm_program.act"),
    (("slope=0.1", "slope=0.2"), "'0.1' when stored, now '0.2' at warm_program.act"),
    (("* SCALE", "* SCALE * SCALE"), "at warm_program.act"),
    (("self.fc(x)", "self.fc(x + 1)"), "at warm_program.Net.forward"),
])
def test_changed_source_constant_or_default_misses(cache_dir, tmp_path, edit, why):
    """The edited program runs exactly like eager (eager_check), captured again, and explain names the change."""
    program = tmp_path / "warm_program.py"
    program.write_text(PROGRAM)
    _worker(cache_dir, (), program)
    program.write_text(PROGRAM.replace(*edit))
    edited = _worker(cache_dir, (), program)["program"]
    for compiler in ("jit", "dynamo"):
        _assert_cold(edited[compiler])
    assert why in edited["jit"]["explain"], edited["jit"]["explain"]
    again = _worker(cache_dir, (), program)["program"]
    for compiler in ("jit", "dynamo"):
        _assert_warm(again[compiler])


def test_code_fp_does_not_depend_on_reference_counts():
    """marshal writes an object referenced twice as a back-reference: its bytes changed once a
    trace held a reference to a nested code object, and a second process missed its own entry."""
    def f(x):
        return tuple(z + 1.5 for z in x if z in {"a", "b"})
    before = cache.code_fp(f.__code__)
    held = [c for c in f.__code__.co_consts] * 3     # noqa: F841 - extra references, as a trace makes
    assert cache.code_fp(f.__code__) == before

    def g(x):
        return tuple(z + 2.5 for z in x if z in {"a", "b"})
    assert cache.code_fp(g.__code__) != before


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.scale = 2.0

    def forward(self, x):
        return self.fc(x) * self.scale


def test_explain_names_the_read_a_stored_entry_failed(cache_dir):
    """Same key (code, structure, inputs), a module attribute the trace read changed: the stored
    entry is not used, and explain gives the attribute with its stored and current values."""
    x = torch.randn(2, 3)
    model = Scaled()
    first = aotgrad.jit(model)
    first(x)
    assert "nothing is stored for" in first.explain()
    model.scale = 3.0
    second = aotgrad.jit(model)
    out = second(x)
    torch.testing.assert_close(out, model.fc(x) * 3.0)
    assert not second.entries[0].loaded
    assert "`model.scale` was '2.0' when stored, now '3.0'" in second.explain(), second.explain()
    model.scale = 2.0
    third = aotgrad.jit(model)
    third(x)
    assert third.entries[0].loaded and third.entries[0].disk is None
