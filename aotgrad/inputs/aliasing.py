"""Inputs that share storage, when one of them is mutated.

Functionalization sees each input as its own tensor, so a write through one
alias would not reach the other. Such a group is replaced by one *synthetic
base* input; inside the graph each member is regenerated as a view of it, so
functionalization propagates the write, and at run time the real base is
passed and written back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir.descriptors import BaseDesc
from ..ir.records import ViewMeta
from ..errors import MutationError


@dataclass(frozen=True)
class AliasGroup:
    members: tuple          # flat input indices
    views: tuple            # ViewMeta of each member on the base's storage


@dataclass(frozen=True)
class Rebase:
    """How a flat input list becomes the graph's inputs: untouched inputs first, then one base per group."""
    n_inputs: int
    groups: tuple
    kept: tuple             # flat indices passed through

    def graph_inputs(self, flat: list) -> list:
        return [flat[i] for i in self.kept] + [real_base([flat[i] for i in g.members], g) for g in self.groups]

    def descs(self, descs) -> list:
        return [descs[i] for i in self.kept] + [
            BaseDesc(tuple(descs[i] for i in g.members)) for g in self.groups]

    def wrap(self, flat_fn):
        """``flat_fn`` on the graph's inputs: members regenerated as views of their base."""
        n_kept = len(self.kept)

        def fn(*graph_inputs):
            flat = [None] * self.n_inputs
            for i, t in zip(self.kept, graph_inputs):
                flat[i] = t
            for g, base in zip(self.groups, graph_inputs[n_kept:]):
                for i, v in zip(g.members, g.views):
                    flat[i] = base.as_strided(v.size, v.stride, v.offset)
            return flat_fn(*flat)
        fn.__name__ = flat_fn.__name__
        return fn


def _key(t: torch.Tensor):
    return t.untyped_storage()._cdata if t.device.type != "meta" else id(t)


def find_groups(tensors, mutated: set) -> list[AliasGroup]:
    """Groups of inputs sharing a storage where some member is mutated."""
    by_storage: dict = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            by_storage.setdefault(_key(t), []).append(i)
    groups = []
    for members in by_storage.values():
        if len(members) > 1 and mutated & set(members):
            groups.append(AliasGroup(tuple(members), tuple(ViewMeta.of(tensors[i]) for i in members)))
    return groups


def rebase(n_inputs: int, groups) -> Rebase:
    grouped = {i for g in groups for i in g.members}
    return Rebase(n_inputs, tuple(groups), tuple(i for i in range(n_inputs) if i not in grouped))


def real_base(members: list, group: AliasGroup) -> torch.Tensor:
    """The tensor whose storage all members view, with autograd history where there is one."""
    first = members[0]
    if all(m is first for m in members):
        return first if first._base is None else first._base
    bases = {id(m._base) if m._base is not None else id(m) for m in members}
    root = first._base if first._base is not None else first
    if len(bases) == 1:
        return root
    if any(m.requires_grad for m in members):
        raise MutationError("inputs share storage without a common base tensor and require grad; "
                            "pass views of one base tensor instead")
    storage = first.untyped_storage()
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage)
