"""Memory budgets: met when possible, a clear error when not, and monotonic:
a smaller budget never gives more saved bytes or a larger peak."""
import pytest
import torch

import aotgrad
from aotgrad.errors import BudgetError
from aotgrad.partition import default_partition, estimate, min_cut
from aotgrad.partition.budget import budget_partition, chain, pick, target_bytes
from tests.eager_check import check
from tests.partition.test_min_cut import MODELS

BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.1, 0.0)


def _captured(name):
    model, args = MODELS[name]()
    return aotgrad.capture(model, *args)


def _outcomes(captured):
    """The budgeted partition's estimate for each budget (None: refused), from one chain."""
    default = estimate(default_partition(captured.joint, captured.layout)).saved_bytes
    candidates = list(chain(captured.joint, captured.layout))
    out = []
    for b in BUDGETS:
        try:
            out.append(estimate(pick(candidates, target_bytes(b, default), default)))
        except BudgetError:
            out.append(None)
    return out


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_budget_is_met_or_refused_and_monotonic(name):
    captured = _captured(name)
    default = estimate(default_partition(captured.joint, captured.layout)).saved_bytes
    outcomes = _outcomes(captured)
    for b, e in zip(BUDGETS, outcomes):
        if e is not None:
            assert e.saved_bytes <= b * default
    ests = [e for e in outcomes if e is not None]
    assert len(ests) >= 2
    for big, small in zip(ests, ests[1:]):
        assert small.saved_bytes <= big.saved_bytes
        assert small.peak_bytes <= big.peak_bytes


def test_impossible_budget_names_smallest_amount():
    captured = _captured("cnn")     # its dropout mask and batch-norm inputs must be saved
    candidates = list(chain(captured.joint, captured.layout))
    smallest = min(est.saved_bytes for _, est in candidates)
    with pytest.raises(BudgetError, match=f"smallest saved-activation size reachable without raising the peak is {smallest} bytes"):
        pick(candidates, 0, 1)


def test_malformed_budget_is_refused():
    with pytest.raises(BudgetError, match="fraction"):
        min_cut(budget=1.5)
    with pytest.raises(BudgetError, match="fraction"):
        min_cut(budget=-1)


@pytest.mark.parametrize("name,budget", [("mlp", 0.25), ("gpt_dropout", 0.7)])
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
    from aotgrad.analysis.ops import is_random
    captured = _captured("gpt_dropout")
    for part, _ in chain(captured.joint, captured.layout):
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
