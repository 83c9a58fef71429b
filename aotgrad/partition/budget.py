"""A memory budget for the min-cut partitioner: never a peak above the unbudgeted one.

The budget lets the min cut recompute more ops, in a fixed order: most bytes
saved per recompute FLOP first. Letting it recompute the first k of them for
growing k gives a sequence of cuts, ending with every forward op that may be
recomputed recomputed (JAX's ``nothing_saveable``). Recomputing more saves less
but can raise the peak: recomputed at the backward's start and held until the
gradients that read it, a value recomputed once costs what saving it cost, and
more (the whole forward recomputed for the last layer's backward, every layer's
values held until its own). So each cut is scheduled several ways
(``min_cut.generations``: one copy of a recomputed value, or a fresh copy for a
need more than ``gap`` backward nodes after the last, as checkpointing
recomputes a layer just before its gradients) and the lowest predicted peak is
taken. A candidate whose peak is above the unbudgeted min cut's is dropped.

A budget is a fraction of the default partition's saved bytes (the first
candidate saving no more; a smaller fraction walks further along one fixed
sequence, so it never saves more) or a predicted peak in bytes (the first
candidate whose peak fits). Either is met or refused with a ``BudgetError``
saying how close the candidates came.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir.records import JointLayout
from ..errors import BudgetError, caller_line
from .blocks import inline_calls
from .costs import flops, may_recompute, never_recompute, node_bytes
from .default import Partition, default_partition, forward_nodes
from .memory import estimate
from .min_cut import cut, generations, min_cut_partition, recomputing
from ..options import budget_kind, keywords_checked

# Schedules tried per cut: ``None``, one copy of each recomputed value; n, a new copy for a need
# more than n backward nodes after the copy's first (see ``min_cut.generations``).
GAPS = (None, 16)


def recompute_order(joint: fx.GraphModule, lay: JointLayout, policy) -> list[fx.Node]:
    """Forward ops the policy keeps but a budget may recompute, best bytes-per-FLOP first."""
    fw = forward_nodes(joint, lay)
    extra = [n for n in joint.graph.nodes if n in fw and not never_recompute(n)
             and not may_recompute(n, policy)]
    return sorted(extra, key=lambda n: -node_bytes(n) / max(flops(n), 1))   # zero-size ops cost no FLOPs


def _levels(n: int, steps: int = 16) -> list[int]:
    """How many ops of the order each candidate may recompute: fine at first
    (a few ops often suffice), then in ``steps`` even strides."""
    stride = max(1, -(-n // steps))
    return sorted({k for k in (0, 1, 2, 4, *range(0, n, stride), n) if k <= n})


def scheduled(joint: fx.GraphModule, lay: JointLayout, policy, extra=frozenset(), seen=None):
    """The cut ``(policy, extra)`` names, scheduled for the lowest predicted peak (fewest
    recompute FLOPs among equal peaks): ``(partition, estimate)``; None where ``seen`` (the
    recomputed sets of earlier cuts, added to) holds its cut already: the same partition again.
    One cut serves every schedule of it."""
    fw, bw, recomputed = cut(joint, lay, policy, extra)
    if seen is not None:
        if frozenset(recomputed) in seen:
            return None
        seen.add(frozenset(recomputed))
    best, made = None, []
    order = list(joint.graph.nodes)
    for gap in GAPS:
        gens = generations(order, bw, recomputed, gap)
        if gens in made:
            continue                # the same copies as a schedule already tried: the same partition
        made.append(gens)
        part = recomputing(joint, lay, fw, bw, recomputed, gap)
        est = estimate(part)
        if best is None or (est.peak_bytes, est.recompute_flops) < (best[1].peak_bytes, best[1].recompute_flops):
            best = part, est
        if not part.recomputed:
            break                   # nothing recomputed: every schedule is this one
    return best


def candidates(joint: fx.GraphModule, lay: JointLayout, policy="cheap"):
    """``(partition, estimate)`` pairs, least recomputation first, none peaking above the
    unbudgeted min cut (the first); then full recomputation, the policy-free floor. A level whose
    cut recomputes what an earlier one's did is that candidate again (its pick was already made)."""
    order = recompute_order(joint, lay, policy)
    first = min_cut_partition(joint, lay, policy)
    limit = estimate(first).peak_bytes
    yield first, estimate(first)
    seen: set = set()
    for k in [*_levels(len(order))[1:], None]:
        got = scheduled(joint, lay, "save_nothing", seen=seen) if k is None else \
            scheduled(joint, lay, policy, frozenset(order[:k]), seen)
        if got is not None and got[1].peak_bytes <= limit:
            yield got


def pick(cands, kind: str, target: int, default_saved: int) -> Partition:
    """The first candidate within ``target``: saved bytes (``kind="fraction"``) or predicted peak
    (``kind="peak"``); a ``BudgetError`` naming the closest one when none is."""
    measure = (lambda e: e.saved_bytes) if kind == "fraction" else (lambda e: e.peak_bytes)
    closest = None
    for part, est in cands:
        if measure(est) <= target:
            return part
        closest = est if closest is None or measure(est) < measure(closest) else closest
    what = "saves" if kind == "fraction" else "peaks at"
    raise BudgetError(f"memory budget of {target} bytes ({'saved' if kind == 'fraction' else 'peak'}) cannot be "
                      f"met: the closest partition {what} {measure(closest)} bytes "
                      f"({f'{measure(closest) / target:.2f}x the budget; ' if target else ''}it saves {closest.saved_bytes} of the "
                      f"default's {default_saved} and peaks at {closest.peak_bytes}). No partition is taken whose "
                      f"peak is above the unbudgeted one, and random draws and values read from inputs updated "
                      f"in place must be saved; raise the budget to at least that", user_line=caller_line())


def budget_partition(joint: fx.GraphModule, lay: JointLayout, budget, policy="cheap") -> Partition:
    """The partition with the least recomputation that fits ``budget`` (see the module's doc)."""
    joint = inline_calls(joint)     # a block's halves are opaque to the cut: it decides per op
    kind, value = budget_kind(budget)
    default_saved = estimate(default_partition(joint, lay)).saved_bytes
    target = int(value * default_saved) if kind == "fraction" else value
    return pick(candidates(joint, lay, policy), kind, target, default_saved)


@keywords_checked("partition.min_cut")
def min_cut(budget=None, policy="cheap"):
    """A partitioner ``(joint, layout) -> Partition`` for ``captured.compile(partitioner=...)``.

    ``budget``: ``None`` for the plain min cut, a fraction of the default
    partitioner's saved bytes (float in [0, 1]) or a predicted peak in bytes (an
    int above 1, or text such as ``"4MB"``: ``options.budget_kind``).
    ``policy``: which ops may be recomputed, a name from ``costs.POLICIES``.
    """
    if budget is not None:
        budget_kind(budget)             # reject a malformed budget now, not at compile time

    def partition(joint, lay):
        if budget is None:
            return min_cut_partition(joint, lay, policy)
        return budget_partition(joint, lay, budget, policy)
    partition.__name__ = f"min_cut(budget={budget!r}, policy={policy!r})"
    return partition
