"""The on-disk cache: hits rebuild entries without tracing, still guard every
call, never go stale when the program changes, survive corrupt files."""
import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.export.entry import staged_key, compile_cached
from aotgrad.guards import cache
from aotgrad.store import disk
from tests.eager_check import check

SCALE = 2.0


def jit_compile(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


def entries(d, kind="jit"):
    return sorted(d.glob(f"{kind}-*.bin")) if d.exists() else []


def scaled(x, y):
    return (x * SCALE).sin() + y.cos() * 3


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_second_compile_loads_from_disk_and_matches_eager(cache_dir):
    args = (torch.randn(3, 4, requires_grad=True), torch.randn(3, 4))
    first = check(scaled, args, compile=jit_compile)
    assert len(entries(cache_dir)) == 1 and not first.compiled.entries[0].loaded
    second = check(scaled, args, compile=jit_compile, calls=2)
    assert second.compiled.entries[0].loaded
    assert "loaded from the disk cache" in aotgrad.explain(second.compiled)


def test_module_hit_trains_like_eager(cache_dir):
    x = torch.randn(5, 4)
    check(mlp(), (x,), compile=jit_compile)
    run = check(mlp(), (x,), compile=jit_compile)
    assert run.compiled.entries[0].loaded
    assert run.compiled.entries[0].compiled.captured.history[0].name == "load from disk cache"


class _Holder:
    def __init__(self, x):
        self.x = x * 2


class _Caller:
    def __call__(self, y):
        return y + 1


_CALL = _Caller()


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


_TWICE = _Twice.apply


def built_and_called(x):
    """Reads at the paths of a class's own dict: an object built in the trace (its class's ``__init__``,
    reached through its module), an object's ``__call__``, a custom Function's methods (through ``apply``
    held in a global)."""
    return _TWICE(_CALL(_Holder(x).x)).sin()


@pytest.mark.parametrize("fn", [built_and_called, mlp], ids=["class dicts", "Module.__call__"])
def test_reads_of_classes_and_the_module_call_are_stored_and_loaded(cache_dir, fn):
    args = (torch.randn(3, 4, requires_grad=True),)
    fn = fn if fn is built_and_called else fn()
    check(fn, args, compile=jit_compile)
    run = check(fn, args, compile=jit_compile)
    assert run.compiled.entries[0].loaded


def test_inference_entry_loads(cache_dir):
    x = torch.randn(5, 4)
    with torch.no_grad():
        check(mlp(), (x,), compile=jit_compile, backward=False)
        run = check(mlp(), (x,), compile=jit_compile, backward=False)
    assert run.compiled.entries[0].loaded


def test_loaded_entries_still_guard_and_recompile():
    # The stale-graph regression of aot_function, now across processes' worth of cache.
    f = aotgrad.jit(lambda x: x[: x.shape[0] // 2].sum())
    assert f(torch.ones(4)).item() == 2.0
    assert f(torch.ones(8)).item() == 4.0
    g = aotgrad.jit(f.fn)
    assert g(torch.ones(4)).item() == 2.0
    assert g(torch.ones(8)).item() == 4.0      # guard fails, widens, loads the dynamic entry
    assert g(torch.ones(6)).item() == 3.0      # the dynamic entry serves a new size
    assert [e.loaded for e in g.entries] == [True, True]
    assert g(torch.ones(4, 2)).sum().item() == 4.0     # a new rank: compiled fresh
    assert not g.entries[-1].loaded


def test_changed_global_is_a_miss_not_a_stale_graph(cache_dir):
    global SCALE
    x, y = torch.randn(3), torch.randn(3)
    check(scaled, (x, y), compile=jit_compile)
    SCALE = 3.0
    try:
        run = check(scaled, (x, y), compile=jit_compile)
    finally:
        SCALE = 2.0
    assert not run.compiled.entries[0].loaded
    assert len(entries(cache_dir)) == 2


def test_changed_module_attribute_is_a_miss(cache_dir):
    class Scale(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * self.k

    x = torch.randn(2, 3)
    check(Scale(2), (x,), compile=jit_compile)
    run = check(Scale(5), (x,), compile=jit_compile)
    assert not run.compiled.entries[0].loaded


def test_baked_scalar_and_dtype_are_part_of_the_key(cache_dir):
    f = lambda x, n: x * n                      # noqa: E731
    check(f, (torch.randn(3), 2), compile=jit_compile)
    assert not check(f, (torch.randn(3), 3), compile=jit_compile).compiled.entries[0].loaded
    assert not check(f, (torch.randn(3, dtype=torch.float64), 2), compile=jit_compile).compiled.entries[0].loaded
    assert check(f, (torch.randn(3), 2), compile=jit_compile).compiled.entries[0].loaded


def test_requires_grad_and_layout_are_part_of_the_key(cache_dir):
    x = torch.randn(3, 3)
    check(scaled, (x, x), compile=jit_compile)
    assert not check(scaled, (x.clone().requires_grad_(), x), compile=jit_compile).compiled.entries[0].loaded
    assert not check(scaled, (x.t(), x), compile=jit_compile).compiled.entries[0].loaded
    assert check(scaled, (x.t(), x), compile=jit_compile).compiled.entries[0].loaded


class Box:
    k = 2.0


def test_object_in_a_closure_is_cached_with_the_attributes_read(cache_dir):
    box = Box()
    f = lambda x: x * box.k         # noqa: E731
    check(f, (torch.randn(2, 4),), compile=jit_compile)
    assert check(f, (torch.randn(2, 4),), compile=jit_compile).compiled.entries[0].loaded
    Box.k = 3.0
    try:
        assert not check(f, (torch.randn(2, 4),), compile=jit_compile).compiled.entries[0].loaded
    finally:
        Box.k = 2.0


def test_unstorable_constant_output_is_not_cached(cache_dir):
    f = lambda x: (x * 2, lambda: None)          # noqa: E731 - a non-tensor output the graph cannot hold
    out, _ = aotgrad.jit(f)(torch.ones(2))
    assert out.tolist() == [2.0, 2.0]
    assert entries(cache_dir) == []


def test_disabled_by_environment(cache_dir, monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "0")
    check(scaled, (torch.randn(3), torch.randn(3)), compile=jit_compile)
    assert not cache_dir.exists()


def test_corrupt_entry_warns_once_is_ignored_and_rewritten(cache_dir):
    args = (torch.randn(3, requires_grad=True), torch.randn(3))
    check(scaled, args, compile=jit_compile)
    (path,) = entries(cache_dir)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])          # truncated
    with pytest.warns(UserWarning, match="ignoring the cache entry"):
        run = check(scaled, args, compile=jit_compile)
    assert not run.compiled.entries[0].loaded
    assert path.read_bytes() == whole or disk.load("jit", path.stem[4:], decode=lambda doc, tensors: doc) is not None
    flipped = bytearray(path.read_bytes())
    flipped[-10] ^= 0xFF                               # same length, wrong bytes
    path.write_bytes(bytes(flipped))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # warned about once per entry: no second warning
        check(scaled, args, compile=jit_compile)
    assert check(scaled, args, compile=jit_compile).compiled.entries[0].loaded


def test_uncompilable_options_are_not_cached(cache_dir):
    check(scaled, (torch.randn(3), torch.randn(3)), compile=jit_compile,
          partitioner=lambda joint, lay: aotgrad.partition.default_partition(joint, lay))
    assert entries(cache_dir) == []


def test_staged_path_is_cached_on_the_edited_graph(cache_dir):
    x = torch.randn(4, requires_grad=True)

    def staged(fn, args, kwargs, partitioner="min_cut"):
        return compile_cached(aotgrad.capture(fn, *args, **kwargs), partitioner=partitioner)

    check(scaled, (x, torch.randn(4)), compile=staged, partitioner="default")
    assert entries(cache_dir, "staged") == []      # cheaper to partition again than to load
    check(scaled, (x, torch.randn(4)), compile=staged)
    assert len(entries(cache_dir, "staged")) == 1
    run = check(scaled, (x, torch.randn(4)), compile=staged)
    assert len(entries(cache_dir, "staged")) == 1
    assert run.compiled.history[-1].name == "load partition"
    captured = aotgrad.capture(scaled, x, torch.randn(4))
    edited = copy.deepcopy(captured.joint)
    first = next(n for n in edited.graph.nodes if n.op == "placeholder")
    with edited.graph.inserting_after(first):
        edited.graph.call_function(torch.ops.aten.neg.default, (first,))     # dead but different
    edited.recompile()
    assert staged_key(captured, partitioner="min_cut") != staged_key(captured.with_joint(edited), partitioner="min_cut")


def test_default_location(monkeypatch):
    monkeypatch.delenv("AOTGRAD_CACHE_DIR")
    assert disk.cache_dir() == Path.home() / ".cache" / "aotgrad"
