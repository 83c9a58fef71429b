"""Memory budgets: met whenever full recomputation meets them (a clear error when not),
and monotonic: a smaller budget never gives more saved bytes; the predicted peak is
the partition's own, also where meeting the budget raises it."""
import functools

import pytest
from dataclasses import replace
import torch

import aotgrad
from aotgrad.errors import BudgetError
from aotgrad.partition import default_partition, estimate, min_cut, min_cut_partition
from aotgrad.partition.budget import budget_partition, chain, pick, target_bytes
from tests.eager_check import check
from tests.partition.test_min_cut import MODELS

SWEEP = tuple(i / 20 for i in range(20, -1, -1))       # 1.0, 0.95, ..., 0.0


@functools.cache
def _captured(name):
    """One capture per model for the module: partitioners read the joint, never change it. The
    flat joint (a repeated block's halves copied in): the sets below are counted per operator."""
    model, args = MODELS[name]()
    captured = aotgrad.capture(model, *args)
    return replace(captured, joint=captured.flat_joint)


@functools.cache
def _chain(name):
    captured = _captured(name)
    return list(chain(captured.joint, captured.layout))


def _outcomes(name, budgets):
    """The budgeted partition's estimate for each budget (None: refused), from one chain."""
    captured = _captured(name)
    default = estimate(default_partition(captured.joint, captured.layout)).saved_bytes
    candidates = _chain(name)
    out = []
    for b in budgets:
        try:
            out.append(estimate(pick(candidates, target_bytes(b, default), default)))
        except BudgetError:
            out.append(None)
    return default, out


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt_dropout"])
def test_budget_sweep_met_down_to_full_recomputation_and_monotonic(name):
    captured = _captured(name)
    floor = estimate(min_cut_partition(captured.joint, captured.layout, "save_nothing")).saved_bytes
    default, outcomes = _outcomes(name, SWEEP)
    for b, e in zip(SWEEP, outcomes):
        if target_bytes(b, default) >= floor:
            assert e is not None, f"budget {b} refused though full recomputation saves {floor} bytes"
        if e is not None:
            assert e.saved_bytes <= target_bytes(b, default)
    saved = [e.saved_bytes for e in outcomes if e is not None]
    assert saved == sorted(saved, reverse=True)
    assert len(set(saved)) >= 3


def test_gpt_budget_below_the_peak_floor_is_met_with_its_peak_reported():
    """The issue's case: 0.1 of the default was refused although recomputing the whole forward
    meets it; met now, at a peak above the plain partitions' that the estimate reports."""
    captured = _captured("gpt")
    compiled = captured.compile(memory_budget=0.1)
    default = estimate(default_partition(captured.joint, captured.layout))
    mem = compiled.memory
    assert mem.saved_bytes <= 0.1 * default.saved_bytes
    assert mem.peak_bytes > min(est.peak_bytes for _, est in _chain("gpt"))


def test_impossible_budget_names_the_full_recomputation_floor():
    captured = _captured("cnn")     # its dropout mask and batch-norm outputs must be saved
    candidates = _chain("cnn")
    floor = estimate(min_cut_partition(captured.joint, captured.layout, "save_nothing")).saved_bytes
    smallest = min(est.saved_bytes for _, est in candidates)
    assert 0 < smallest <= floor
    with pytest.raises(BudgetError, match=f"even recomputing every forward op that may be recomputed "
                                          f"saves {smallest} bytes"):
        pick(candidates, smallest - 1, 1)


def test_malformed_budget_is_refused():
    with pytest.raises(BudgetError, match="fraction"):
        min_cut(budget=1.5)
    with pytest.raises(BudgetError, match="fraction"):
        min_cut(budget=-1)


@pytest.mark.parametrize("name,budget", [("mlp", 0.25), ("gpt_dropout", 0.2),
                                         ("cnn", 0.5)])
def test_budgeted_gradients_match_eager(name, budget):
    check(None, make=lambda: (*MODELS[name](), {}), partitioner=min_cut(budget=budget),
          rtol=1e-5, atol=1e-5)


def test_absolute_byte_budget():
    captured = _captured("mlp")
    default = estimate(default_partition(captured.joint, captured.layout)).saved_bytes
    part = budget_partition(captured.joint, captured.layout, default // 2)
    assert estimate(part).saved_bytes <= default // 2


def test_memory_budget_selects_the_budgeted_min_cut():
    from aotgrad.partition import get
    captured = _captured("mlp")
    default = estimate(default_partition(captured.joint, captured.layout)).saved_bytes
    part = get("min_cut", memory_budget=0.5)(captured.joint, captured.layout)
    assert estimate(part).saved_bytes <= 0.5 * default
    with pytest.raises(aotgrad.errors.AotgradError, match="memory_budget"):
        get(lambda j, l: None, memory_budget=0.5)


def test_budget_never_recomputes_random_ops():
    from aotgrad.ir.ops import is_random
    for part, _ in _chain("gpt_dropout"):
        assert not any(is_random(n) for n in part.backward.graph.nodes)


def test_compile_memory_budget_and_memory_report():
    from tests.eager_check import check
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 4))
    full = check(m, (torch.randn(32, 16),)).compiled.memory
    half = check(m, (torch.randn(32, 16),), memory_budget=0.5).compiled.memory
    assert half.saved_bytes <= 0.5 * full.saved_bytes
    assert half.peak_bytes <= full.peak_bytes
    assert sum(e.nbytes for e in full.saved) == full.saved_bytes
