"""Partitioners split a joint graph into forward and backward graphs.

A partitioner is a pure function ``(joint, layout) -> Partition``.
``min_cut(budget=..., policy=...)`` builds one with options.
"""
from .budget import budget_partition, min_cut
from .default import Partition, default_partition
from .memory import MemoryEstimate, SavedTensor, estimate, measure_peak
from .min_cut import min_cut_partition
from ..options import keywords_checked

PARTITIONERS = {"default": default_partition, "min_cut": min_cut_partition}


@keywords_checked("partition.get")
def get(name_or_fn, memory_budget=None):
    """The partitioner named (``"default"``, ``"min_cut"``: ``CompileOptions.resolved_partitioner``
    makes ``"auto"`` one of them) or given. A ``memory_budget`` is honoured by ``"min_cut"`` only;
    with another partitioner it is refused, never a silent switch to min cut."""
    if memory_budget is not None:
        if isinstance(name_or_fn, str) and name_or_fn == "min_cut":
            return min_cut(budget=memory_budget)
        from ..errors import OptionError, caller_line
        raise OptionError(f"memory_budget={memory_budget!r} needs partitioner='min_cut'; "
                          f"partitioner={name_or_fn!r} has no budget", user_line=caller_line())
    if callable(name_or_fn):
        return name_or_fn
    try:
        return PARTITIONERS[name_or_fn]
    except KeyError:
        from ..errors import AotgradError
        raise AotgradError(f"unknown partitioner {name_or_fn!r}; choose one of {sorted(PARTITIONERS)} or pass a function") from None


__all__ = ["Partition", "default_partition", "min_cut_partition", "min_cut", "budget_partition",
           "PARTITIONERS", "get", "estimate", "measure_peak", "MemoryEstimate", "SavedTensor"]
