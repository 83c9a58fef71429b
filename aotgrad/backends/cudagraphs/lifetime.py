"""Output lifetime: a replay overwrites the memory its previous outputs live in.

Outputs a user can keep are cloned out of static memory. Outputs consumed only
by the backward (saved tensors) are handed out in place, each tagged with the
memory pool and its replay count when they were handed out; a compiled graph
that receives a tagged tensor after another replay in that pool (which may
have written over it: graphs in one pool reuse each other's freed memory)
raises :class:`StaleOutputError` naming it, instead of computing with
overwritten data.
"""
from __future__ import annotations

import torch

from ...errors import AotgradError


class StaleOutputError(AotgradError):
    """A cudagraphs output was used after a later replay overwrote its memory."""


def alias(t: torch.Tensor, tag) -> torch.Tensor:
    """A new tensor over ``t``'s memory carrying ``tag`` (``t`` itself stays untagged)."""
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    out._aotgrad_replay = tag
    return out


def check_fresh(args) -> None:
    for a in args:
        tag = getattr(a, "_aotgrad_replay", None) if isinstance(a, torch.Tensor) else None
        if tag is not None:
            pool, replay, name = tag
            if pool.replays != replay:
                raise StaleOutputError(
                    f"{name} may have been overwritten: {pool.replays - replay} later CUDA graph "
                    f"replay(s) ran in its memory pool; run backward before the next forward "
                    f"call, or use the eager backend for steps that interleave forwards")
