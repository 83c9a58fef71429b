"""Memory budgets never raise the peak (issue #61): a fraction of the default's saved bytes or a
peak in bytes is met at a predicted peak no higher than the unbudgeted min cut's, or refused with
a ``BudgetError`` naming how close it came; a smaller fraction never saves more; the gradients are
eager's."""
import functools
import re

import pytest
from dataclasses import replace
import torch

import aotgrad
from aotgrad.errors import BudgetError, OptionError
from aotgrad.options import CompileOptions, budget_kind
from aotgrad.partition import default_partition, estimate, measure_peak, min_cut, min_cut_partition
from aotgrad.partition.budget import budget_partition, candidates, pick, recompute_order
from aotgrad.partition.min_cut import cut_partition
from tests.eager_check import check
from tests.partition.test_min_cut import MODELS

FRACTIONS = (1.0, 0.5, 0.25, 0.1, 0.0)


@functools.cache
def _captured(name):
    """One capture per model for the module: partitioners read the joint, never change it. The
    flat joint (a repeated block's halves copied in): the sets below are counted per operator."""
    model, args = MODELS[name]()
    captured = aotgrad.capture(model, *args)
    return replace(captured, joint=captured.flat_joint)


@functools.cache
def _pairs(name):
    c = _captured(name)
    return list(candidates(c.joint, c.layout))


@functools.cache
def _facts(name):
    """(default saved bytes, unbudgeted peak, every candidate's estimate)."""
    c = _captured(name)
    default = estimate(default_partition(c.joint, c.layout)).saved_bytes
    unbudgeted = estimate(min_cut_partition(c.joint, c.layout)).peak_bytes
    return default, unbudgeted, [est for _, est in _pairs(name)]


def _outcome(name, budget):
    """What ``budget_partition`` picks, from the candidates listed once (``pick`` is its choice)."""
    default = _facts(name)[0]
    kind, value = budget_kind(budget)
    try:
        return estimate(pick(iter(_pairs(name)), kind, int(value * default) if kind == "fraction" else value,
                             default))
    except BudgetError as e:
        return e


def test_budget_partition_is_pick_over_the_candidates():
    c = _captured("cnn")
    for budget in (0.5, _facts("cnn")[1]):
        assert estimate(budget_partition(c.joint, c.layout, budget)) == _outcome("cnn", budget)


@pytest.mark.parametrize("budget", FRACTIONS)
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt_dropout"])
def test_fraction_never_raises_the_peak(name, budget):
    default, unbudgeted, cands = _facts(name)
    got = _outcome(name, budget)
    reachable = [e for e in cands if e.saved_bytes <= int(budget * default)]
    if isinstance(got, BudgetError):
        assert not reachable, f"budget {budget} refused though a candidate saves {reachable[0].saved_bytes}"
        least = min(e.saved_bytes for e in cands)
        assert f"the closest partition saves {least} bytes" in str(got)
        return
    assert got.saved_bytes <= int(budget * default)
    assert got.peak_bytes <= unbudgeted, (got.peak_bytes, unbudgeted)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt_dropout"])
def test_smaller_fraction_never_saves_more(name):
    saved = [o.saved_bytes for o in map(functools.partial(_outcome, name), (1.0, 0.75, 0.5, 0.25, 0.1, 0.05))
             if not isinstance(o, BudgetError)]
    assert saved == sorted(saved, reverse=True) and len(set(saved)) >= 2, saved


def test_gpt_full_recomputation_is_no_longer_a_higher_peak():
    """The issue's case: recomputing the whole forward once, at the backward's start, holds every
    layer's values until its gradients and peaks above the unbudgeted min cut (the trap this test
    needs to exist); recomputed just before each layer's gradients it peaks below, and 0.1 of the
    default's saved bytes is met there."""
    c = _captured("gpt")
    default, unbudgeted, _ = _facts("gpt")
    once = estimate(cut_partition(c.joint, c.layout, "save_nothing"))
    assert once.peak_bytes > unbudgeted
    got = _outcome("gpt", 0.1)
    assert got.saved_bytes <= 0.1 * default and got.peak_bytes < unbudgeted


def test_a_need_far_from_the_first_gets_its_own_copy():
    """``gap``: a value recomputed for two backward uses far apart is recomputed twice, each copy
    just before its use; ``None`` makes one copy (held between them)."""
    c = _captured("gpt")
    extra = frozenset(recompute_order(c.joint, c.layout, "cheap"))
    once = cut_partition(c.joint, c.layout, "cheap", extra)
    split = cut_partition(c.joint, c.layout, "cheap", extra, gap=16)
    assert len(split.recomputed) > len(once.recomputed)
    assert split.saved == once.saved         # the same cut, scheduled otherwise
    assert estimate(split).peak_bytes < estimate(once).peak_bytes


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt_dropout"])
def test_peak_budget_met_or_refused_with_how_close(name):
    default, unbudgeted, cands = _facts(name)
    lowest = min(e.peak_bytes for e in cands)
    for target in (unbudgeted, (unbudgeted + lowest) // 2, lowest):
        got = _outcome(name, target)
        assert not isinstance(got, BudgetError), (target, got)
        assert got.peak_bytes <= target
    got = _outcome(name, lowest - 1)
    assert isinstance(got, BudgetError)
    assert f"the closest partition peaks at {lowest} bytes" in str(got)
    assert re.search(r"\d+\.\d\dx the budget", str(got))


def test_peak_budget_as_text():
    _, unbudgeted, _ = _facts("gpt")
    text = f"{unbudgeted / 1000:.3f}KB"         # rounded down to a byte: at most the unbudgeted peak
    got = _outcome("gpt", text)
    assert got.peak_bytes <= int(float(text[:-2]) * 1000)
    assert "peaks at" in str(_outcome("gpt", "2B"))


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.25, 0.1, 0.0])
def test_no_candidate_peaks_above_the_unbudgeted(budget):
    """Every partition a budget may pick, not only the ones these budgets pick."""
    for name in ("cnn", "gpt_dropout"):
        _, unbudgeted, cands = _facts(name)
        assert all(e.peak_bytes <= unbudgeted for e in cands)


@pytest.mark.parametrize("name,budget", [("mlp", 0.25), ("gpt_dropout", 0.2), ("cnn", 0.5),
                                         ("gpt", 0.1), ("gpt", "peak")])
def test_budgeted_gradients_match_eager(name, budget):
    if budget == "peak":
        budget = min(e.peak_bytes for e in _facts(name)[2])
    check(None, make=lambda: (*MODELS[name](), {}), partitioner=min_cut(budget=budget),
          rtol=1e-5, atol=1e-5)


def test_measured_peak_never_above_the_unbudgeted():
    model, args = MODELS["gpt"]()
    captured = aotgrad.capture(model, *args)

    def measured(budget):
        step = captured.compile(partitioner=min_cut(budget=budget))

        def once():
            step(*args).backward()
            for p in model.parameters():
                p.grad = None
        once()
        return measure_peak(once), estimate(step.partition).peak_bytes
    base, _ = measured(None)
    for b in (0.1,):
        peak, predicted = measured(b)
        assert peak <= base and abs(predicted - peak) <= 0.1 * peak, (b, peak, base, predicted)


def test_budget_never_recomputes_random_ops():
    from aotgrad.ir.ops import is_random
    for part, _ in _pairs("gpt_dropout"):
        assert not any(is_random(n) for n in part.backward.graph.nodes)


# --- the option

@pytest.mark.parametrize("given,read", [
    (0.5, ("fraction", 0.5)), (0.0, ("fraction", 0.0)), (1, ("fraction", 1.0)), (0, ("fraction", 0.0)),
    (2, ("peak", 2)), (4_000_000, ("peak", 4_000_000)), ("4MB", ("peak", 4_000_000)),
    ("512KiB", ("peak", 524288)), ("1.5GB", ("peak", 1_500_000_000)), (" 3 mib ", ("peak", 3 * 2**20)),
    ("100", ("peak", 100)), ("64B", ("peak", 64))])
def test_budget_forms(given, read):
    assert budget_kind(given) == read
    assert CompileOptions(memory_budget=given).memory_budget == given
    min_cut(budget=given)


@pytest.mark.parametrize("bad", [1.5, -1, -0.1, True, "lots", "4XB", "", "1B", "0.5MBs", "MB", [1], float("nan")])
def test_malformed_budget_is_refused(bad):
    with pytest.raises(OptionError, match="memory_budget"):
        budget_kind(bad)
    with pytest.raises(OptionError, match="memory_budget"):
        CompileOptions(memory_budget=bad)
    with pytest.raises(OptionError, match="memory_budget"):
        min_cut(budget=bad)


def test_memory_budget_selects_the_budgeted_min_cut():
    from aotgrad.partition import get
    c = _captured("mlp")
    default = estimate(default_partition(c.joint, c.layout)).saved_bytes
    part = get("min_cut", memory_budget=0.5)(c.joint, c.layout)
    assert estimate(part).saved_bytes <= 0.5 * default
    with pytest.raises(aotgrad.errors.AotgradError, match="memory_budget"):
        get(lambda j, l: None, memory_budget=0.5)


def test_compile_memory_budget_and_memory_report():
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 4))
    full = check(m, (torch.randn(32, 16),)).compiled.memory
    half = check(m, (torch.randn(32, 16),), memory_budget=0.5).compiled.memory
    assert half.saved_bytes <= 0.5 * full.saved_bytes
    assert half.peak_bytes <= full.peak_bytes
    assert sum(e.nbytes for e in full.saved) == full.saved_bytes


def _exhaustive(joint, lay, policy="cheap"):
    """The candidates as first written: every level's cut by networkx's default max flow, scheduled
    every way (``budget.GAPS``), no level skipped as a repeat; what ``candidates`` must equal."""
    import importlib
    import networkx as nx
    b, mc = (importlib.import_module(f"aotgrad.partition.{m}") for m in ("budget", "min_cut"))
    order = recompute_order(joint, lay, policy)
    first = min_cut_partition(joint, lay, policy)
    limit = estimate(first).peak_bytes
    out = [estimate(first)]
    slow = functools.partial(nx.minimum_cut, flow_func=nx.algorithms.flow.preflow_push)
    for k in [*b._levels(len(order))[1:], None]:
        pol, extra = ("save_nothing", frozenset()) if k is None else (policy, frozenset(order[:k]))
        best = None
        for gap in b.GAPS:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(mc.nx, "minimum_cut", slow)
                est = estimate(cut_partition(joint, lay, pol, extra, gap))
            if best is None or (est.peak_bytes, est.recompute_flops) < (best.peak_bytes, best.recompute_flops):
                best = est
        if best.peak_bytes <= limit:
            out.append(best)
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_candidates_are_the_exhaustive_walks_picks(name):
    """One cut per level serving both schedules, a schedule that makes the copies another did
    skipped, a level whose cut repeats an earlier one's skipped, Boykov-Kolmogorov's max flow: every
    budget picks what cutting every level by preflow-push and scheduling it every way picks."""
    c = _captured(name)
    key = lambda e: (e.saved_bytes, e.peak_bytes, e.recompute_flops)      # noqa: E731
    fast, slow = [key(e) for e in _facts(name)[2]], [key(e) for e in _exhaustive(c.joint, c.layout)]
    assert fast == [k for i, k in enumerate(slow) if i <= 1 or k not in slow[1:i]]     # repeats of a level's cut dropped
    default = _facts(name)[0]
    for budget in FRACTIONS:
        target = int(budget * default)
        first = next((k for k in slow if k[0] <= target), None)
        got = _outcome(name, budget)
        assert (first is None) == isinstance(got, BudgetError)
        assert first is None or key(got) == first
