"""Per-operator facts read from operator schemas and tags, not if-chains."""
from __future__ import annotations

import torch
import torch.fx as fx


def is_random(node: fx.Node) -> bool:
    """Ops that draw from the RNG (dropout masks, rand, bernoulli)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in t.tags


def mutated_args(op: torch._ops.OpOverload) -> list[str]:
    """Names of the arguments an operator writes to (``alias_info.is_write``)."""
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
