"""Output lifetime: a replay overwrites the memory its previous outputs live in.

Outputs a user can keep are cloned out of static memory. Outputs consumed only
by the backward (saved tensors) are handed out in place, each tagged with the
recording and replay that produced it; a graph that receives a tagged tensor
after its recording was replayed again raises :class:`StaleOutputError`
naming it, instead of computing with overwritten data.
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
            recording, replay, name = tag
            if recording.replays != replay:
                raise StaleOutputError(
                    f"{name} (from {recording.name}, replay {replay}) was overwritten by replay "
                    f"{recording.replays}; run backward before the next forward call, or use the "
                    f"eager backend for steps that interleave forwards")
