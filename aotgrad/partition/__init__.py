"""Partitioners split a joint graph into forward and backward graphs.

A partitioner is a pure function ``(joint, layout) -> Partition``.
``min_cut(budget=..., policy=...)`` builds one with options.
"""
from .budget import budget_partition, min_cut
from .default import Partition, default_partition
from .memory import MemoryEstimate, SavedTensor, estimate, measure_peak
from .min_cut import min_cut_partition

PARTITIONERS = {"default": default_partition, "min_cut": min_cut_partition}


def get(name_or_fn, memory_budget=None):
    """The partitioner named (or given); a ``memory_budget`` selects the budgeted min cut."""
    if memory_budget is not None:
        if name_or_fn not in ("default", "min_cut"):
            from ..errors import AotgradError
            raise AotgradError(f"memory_budget works with partitioner='min_cut', not {name_or_fn!r}")
        return min_cut(budget=memory_budget)
    if callable(name_or_fn):
        return name_or_fn
    try:
        return PARTITIONERS[name_or_fn]
    except KeyError:
        from ..errors import AotgradError
        raise AotgradError(f"unknown partitioner {name_or_fn!r}; choose one of {sorted(PARTITIONERS)} or pass a function") from None


__all__ = ["Partition", "default_partition", "min_cut_partition", "min_cut", "budget_partition",
           "PARTITIONERS", "get", "estimate", "measure_peak", "MemoryEstimate", "SavedTensor"]
