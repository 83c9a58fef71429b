"""A memory budget for the min-cut partitioner, monotonic by construction.

The budget lets the min cut recompute more ops, in a fixed order: most bytes
saved per recompute FLOP first. Letting it recompute the first k of them for
growing k gives a sequence of partitions, ending with every forward op that
may be recomputed recomputed (JAX's ``nothing_saveable``). We keep a chain
of them, each saving fewer bytes than all before: first those that also peak
no higher than all before; then, where that runs out, the rest at whatever
peak they reach (``estimate`` reports it). A budget picks the first kept
partition that fits, so a smaller budget walks further along one fixed chain
and never gets a larger saved size; any budget that full recomputation
meets is met.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir.records import JointLayout
from ..errors import BudgetError, caller_line
from .blocks import inline_calls
from .costs import flops, may_recompute, never_recompute, node_bytes
from .default import Partition, default_partition, forward_nodes
from .memory import estimate
from .min_cut import cut_partition, min_cut_partition
from ..options import keywords_checked


def target_bytes(budget, default_saved: int) -> int:
    """A fraction (0..1, a float) of the default's saved bytes, or a byte count (an int)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
        raise BudgetError(f"memory_budget must be a fraction in [0, 1] or a byte count, not {budget!r}")
    if isinstance(budget, float):
        if budget > 1:
            raise BudgetError(f"memory_budget {budget} is a float above 1; pass a fraction in [0, 1] "
                              f"or an int byte count")
        return int(budget * default_saved)
    return budget


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


def chain(joint: fx.GraphModule, lay: JointLayout, policy="cheap"):
    """The monotonic chain of partitions: each saves fewer bytes than all before it."""
    order = recompute_order(joint, lay, policy)
    kept, higher = None, []
    for k in _levels(len(order)):
        part = min_cut_partition(joint, lay, policy) if k == 0 else \
            cut_partition(joint, lay, policy, frozenset(order[:k]))
        est = estimate(part)
        if kept is None or (est.saved_bytes < kept.saved_bytes and est.peak_bytes <= kept.peak_bytes):
            kept = est
            yield part, est
        else:
            higher.append((part, est))
    # Full recomputation as the policy-free floor (the cuts' byte counts can differ from the estimate's).
    floor = cut_partition(joint, lay, "save_nothing")
    higher.append((floor, estimate(floor)))
    least = kept.saved_bytes
    for part, est in higher:        # saving still less, at a higher peak
        if est.saved_bytes < least:
            least = est.saved_bytes
            yield part, est


def pick(candidates, target: int, default_saved: int) -> Partition:
    """The first partition of the chain (least recomputation) saving at most ``target`` bytes."""
    smallest = None
    for part, est in candidates:
        if est.saved_bytes <= target:
            return part
        smallest = est.saved_bytes
    raise BudgetError(f"memory budget of {target} bytes cannot be met: even recomputing every forward op "
                      f"that may be recomputed saves {smallest} bytes "
                      f"({smallest / max(default_saved, 1):.3f} of the default's {default_saved}; random "
                      f"draws and values read from inputs updated in place must be saved); "
                      f"raise the budget to at least that", user_line=caller_line())


def budget_partition(joint: fx.GraphModule, lay: JointLayout, budget, policy="cheap") -> Partition:
    """The partition with the least recomputation whose saved bytes fit ``budget``."""
    joint = inline_calls(joint)     # a block's halves are opaque to the cut: it decides per op
    default_saved = estimate(default_partition(joint, lay)).saved_bytes
    return pick(chain(joint, lay, policy), target_bytes(budget, default_saved), default_saved)


@keywords_checked("partition.min_cut")
def min_cut(budget=None, policy="cheap"):
    """A partitioner ``(joint, layout) -> Partition`` for ``captured.compile(partitioner=...)``.

    ``budget``: ``None`` for the plain min cut, a fraction of the default
    partitioner's saved bytes (float in [0, 1]) or a byte count (int).
    ``policy``: which ops may be recomputed, a name from ``costs.POLICIES``.
    """
    if budget is not None:
        target_bytes(budget, 0)         # reject a malformed budget now, not at compile time

    def partition(joint, lay):
        if budget is None:
            return min_cut_partition(joint, lay, policy)
        return budget_partition(joint, lay, budget, policy)
    partition.__name__ = f"min_cut(budget={budget!r}, policy={policy!r})"
    return partition
