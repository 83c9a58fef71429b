"""The size assumptions a capture made, checked before each run of it.

The engine reuses a captured backward for every autograd graph of the same
structure, whatever its sizes. The trace made three kinds of assumption about
the lifted sizes: where a size was 0 or 1, broadcasting and empty-tensor
decisions were taken on that value; other sizes were treated as >= 2; sizes equal at
capture share a symbol. A run whose sizes break one of these would compute
with the wrong graph, so it stops with an error naming the size instead.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..errors import InputMismatchError


@dataclass(frozen=True)
class SizeGuard:
    constants: tuple    # (index, value): sizes traced as constants, or symbols seen as 0 or 1
    groups: tuple       # tuples of indices traced as one symbol (each >= 2)

    @classmethod
    def of(cls, lifted: list) -> "SizeGuard":
        constants, groups = [], defaultdict(list)
        for i, v in enumerate(lifted):
            hint = v.node.hint if isinstance(v, torch.SymInt) else v
            if isinstance(v, torch.SymInt) and hint >= 2:
                groups[v.node.expr].append(i)
            elif isinstance(hint, int):
                # 0 and 1 decide broadcasting and empty-tensor paths, which the trace
                # took on the capture's values (guards are not recorded, see capture.py).
                constants.append((i, hint))
        return cls(tuple(constants), tuple(tuple(g) for g in groups.values()))

    def violation(self, values) -> str | None:
        """Why ``values`` may not use this capture, or ``None``."""
        for i, v in self.constants:
            if values[i] != v:
                return f"lifted size {i} was {v} when captured (0 and 1 are specialised), now {values[i]}"
        for group in self.groups:
            first = values[group[0]]
            if first < 2:
                return f"lifted size {group[0]} was symbolic (>= 2) when captured, now {first}"
            for i in group[1:]:
                if values[i] != first:
                    return (f"lifted sizes {group[0]} and {i} were equal when captured (one symbol), "
                            f"now {first} and {values[i]}")
        return None

    def check(self, values) -> None:
        why = self.violation(values)
        if why is not None:
            raise InputMismatchError(
                f"compiled_autograd: {why}; call aotgrad.compiled_autograd.reset() before this "
                "backward, or keep such sizes fixed")
