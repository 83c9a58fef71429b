"""Stage objects are data: they do not pin the user's batch, a ``Compiled`` loaded from the
disk cache is as usable as a fresh one, and they print in one line."""
import dataclasses
import gc
import re
import weakref

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.stages import Modes


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch_dies(use) -> bool:
    """Whether the example batch is freed once the caller drops it, while ``use``'s result is kept."""
    x = torch.randn(3, 4)
    ref = weakref.ref(x)
    kept = use(x)
    del x
    gc.collect()
    assert kept is not None
    return ref() is None


def test_captured_and_compiled_do_not_pin_the_batch():
    m = _model()

    def use(x):
        captured = aotgrad.capture(m, x)
        compiled = captured.compile()
        compiled(x).sum().backward()
        return captured, compiled
    assert _batch_dies(use)


def test_jit_entries_do_not_pin_the_batch(monkeypatch, tmp_path):
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(tmp_path))
    m = _model()
    for loaded in (False, True):      # the second jit loads its entry from the disk cache
        step = aotgrad.jit(m)

        def use(x, step=step):
            step(x).sum().backward()
            step(x + 1)
            return step
        assert _batch_dies(use)
        assert step.entries[0].loaded == loaded


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return (self.fc2(h) * h.sum(-1, keepdim=True)).sum()


def _fresh_and_loaded(monkeypatch, tmp_path, dynamic):
    """A jit entry compiled here, and the same entry loaded from the disk cache by a new jit."""
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    m, x = Net(), torch.randn(5, 4)
    fresh, loaded = aotgrad.jit(m, dynamic=dynamic), aotgrad.jit(m, dynamic=dynamic)
    fresh(x), loaded(x)
    assert not fresh.entries[0].loaded and loaded.entries[0].loaded
    return fresh.entries[0].compiled, loaded.entries[0].compiled, m, x


def _rows(memory) -> list:
    """The saved-tensor rows, symbols renamed in order of appearance (a loaded entry's shape
    environment numbers its symbols afresh)."""
    names: dict = {}

    def size(s):
        return re.sub(r"\bs\d+\b", lambda m: names.setdefault(m.group(), f"S{len(names)}"), str(s))
    return [(s.name, tuple(map(size, s.shape)), s.dtype, s.source) for s in memory.saved]


@pytest.mark.parametrize("dynamic", [False, True])
def test_loaded_entry_has_memory_estimates(monkeypatch, tmp_path, dynamic):
    fresh, loaded, _, _ = _fresh_and_loaded(monkeypatch, tmp_path, dynamic)
    a, b = fresh.memory, loaded.memory
    assert (a.saved_bytes, a.peak_bytes) == (b.saved_bytes, b.peak_bytes) and b.saved_bytes > 0
    assert _rows(a) == _rows(b)
    assert any("test_stage_data.py" in (s.source or "") for s in b.saved)


@pytest.mark.parametrize("dynamic", [False, True])
def test_loaded_entry_compiles_again(monkeypatch, tmp_path, dynamic):
    fresh, loaded, m, x = _fresh_and_loaded(monkeypatch, tmp_path, dynamic)
    for partitioner in ("min_cut", "default"):
        again = loaded.captured.compile(partitioner=partitioner)
        same = fresh.captured.compile(partitioner=partitioner)
        assert again.partition.saved == same.partition.saved
        assert again.memory.saved_bytes == same.memory.saved_bytes
        runs = []
        for c in (again, same):
            m.zero_grad()
            out = c(x)
            out.backward()
            runs.append((out, [p.grad.clone() for p in m.parameters()]))
        torch.testing.assert_close(runs[0], runs[1])


def test_loaded_entry_explains_like_a_fresh_one(monkeypatch, tmp_path):
    fresh, loaded, _, _ = _fresh_and_loaded(monkeypatch, tmp_path, False)

    def saved_table(c):
        text = aotgrad.explain(c)
        return text[text.index("saved for backward"):text.index("guards:")]
    assert "NoneType" not in saved_table(loaded) and "?" not in saved_table(loaded)
    assert saved_table(loaded) == saved_table(fresh)
    assert "float32[5, 4]" in str(loaded.captured) and str(loaded.captured) == str(fresh.captured)


def test_captured_keeps_modes_not_the_tracing_session():
    m, x = Net(), torch.randn(5, 4)
    c = aotgrad.capture(m, x)
    assert c.setup.session == Modes(dynamic=False, grad_enabled=True,
                                    baked=(False, False, False, None, None, torch.float32), function_modes=())
    assert c.setup.fake_inputs == () and c.setup.real_inputs == ()
    held = [getattr(c.setup, f.name) for f in dataclasses.fields(c.setup)]
    assert not any(isinstance(v, (list, dict, set)) for v in held)     # nothing a later call appends to


def test_the_trace_returns_its_output_structure():
    def f(x, *, scale):
        return {"y": x * scale, "parts": (x.sin(), None)}
    x = torch.randn(3, requires_grad=True)
    c = aotgrad.capture(f, x, scale=2.0)
    out = c.setup.flat_fn(x)
    assert out.spec == c.out_spec == torch.utils._pytree.tree_structure(f(x, scale=2.0))
    step = c.compile()
    for _ in range(3):      # a second-order backward re-runs the function: nothing accumulates
        y = step(x, scale=2.0)
        g, = torch.autograd.grad(y["y"].sum() + y["parts"][0].sum(), x, create_graph=True)
        g.sum().backward()


def test_staged_compile_writes_to_disk_only_when_asked(monkeypatch, tmp_path):
    from aotgrad.export.entry import compile_cached
    monkeypatch.delenv("AOTGRAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    home_cache = tmp_path / ".cache" / "aotgrad"
    m, x = Net(), torch.randn(5, 4)
    captured = aotgrad.capture(m, x)
    captured.compile(partitioner="min_cut")
    captured.compile(memory_budget=0.5)
    assert not home_cache.exists()
    compile_cached(captured, partitioner="min_cut")
    assert [p.name.split("-")[0] for p in home_cache.iterdir()] == ["staged"]


def test_a_partition_is_data_handed_to_compile():
    from tests.eager_check import check
    m, x = _model(), torch.randn(3, 4)
    captured = aotgrad.capture(m, x)
    part = captured.compile(partitioner="min_cut").partition

    def compile_with_part(fn, args, kwargs):
        return aotgrad.capture(fn, *args, **kwargs).compile(partitioner=part)
    run = check(_model(), (x,), compile=compile_with_part)
    assert run.compiled.partition is part
    assert "stored partition" in [s.name for s in run.compiled.history]
