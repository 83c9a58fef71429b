"""torch.compile's activation-checkpoint regions run as ``torch.utils.checkpoint`` runs eagerly.

Dynamo turns ``checkpoint(fn, *args, **options)`` into the higher-order op
``tag_activation_checkpoint(body, *args, **options)``. Its implementation is
written for a compiler that functionalizes the RNG itself: it forces
``preserve_rng_state=False`` and caches every op for the partitioner to
decide on, so a recomputed dropout would draw a fresh mask. This pass calls
the body through ``torch.utils.checkpoint.checkpoint`` with the user's own
options instead; capture then traces the region's recomputation in the
backward exactly as eager runs it, and ``passes.rng`` pairs its draws.

    tag_activation_checkpoint(wrap_body_0, x, w, use_reentrant=False)
    ->  eager_checkpoint(wrap_body_0, x, w, use_reentrant=False)
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from .cleanup import copy_module


def eager_checkpoint(body: fx.GraphModule, *args, **options):
    """``checkpoint(body, *args)`` with the options and ``context_fn`` the user gave Dynamo."""
    context_fn = body.meta.get("_checkpoint_context_fn")
    if context_fn is not None:
        options["context_fn"] = context_fn
    options["use_reentrant"] = False
    return checkpoint(body, *args, **options)


def _tagged(gm: fx.GraphModule) -> list[fx.Node]:
    hop = getattr(getattr(torch.ops, "higher_order", None), "tag_activation_checkpoint", None)
    return [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]


def untag_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo graph whose checkpoint regions (nested ones too) call ``eager_checkpoint``."""
    nested = {name: untag_checkpoints(sub) for name, sub in gm.named_children() if isinstance(sub, fx.GraphModule)}
    if not _tagged(gm) and all(nested[k] is getattr(gm, k) for k in nested):
        return gm
    gm = copy_module(gm)
    for name, sub in nested.items():
        sub.meta.update(getattr(gm, name).meta)
        setattr(gm, name, sub)
    for n in _tagged(gm):
        n.target = eager_checkpoint
    gm.recompile()
    return gm
