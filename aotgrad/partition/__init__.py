"""Partitioners split a joint graph into forward and backward graphs.

A partitioner is a pure function ``(joint, layout) -> Partition``.
"""
from .default import Partition, default_partition

PARTITIONERS = {"default": default_partition}


def get(name_or_fn):
    if callable(name_or_fn):
        return name_or_fn
    try:
        return PARTITIONERS[name_or_fn]
    except KeyError:
        from ..errors import AotgradError
        raise AotgradError(f"unknown partitioner {name_or_fn!r}; choose one of {sorted(PARTITIONERS)} or pass a function") from None


__all__ = ["Partition", "default_partition", "PARTITIONERS", "get"]
