"""Distributed wrappers whose ``forward`` does bookkeeping outside its tensors.

``DistributedDataParallel.forward`` prepares its reducer before and after the
inner module runs (``_pre_forward``/``_post_forward``): a graph captured once
would do that once. ``aotgrad.jit`` runs that bookkeeping eagerly around the
compiled inner module on every call (the reducer's hooks on the parameters'
gradient accumulators then see the compiled backward's gradients, as in eager);
``aotgrad.capture`` of a DDP module, and FSDP-wrapped modules anywhere (their
forward hooks all-gather and reshard parameters), are refused before anything runs.
"""
from __future__ import annotations

import torch

from .. import errors


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:       # a build without distributed support
        return None
    return DistributedDataParallel


def _fsdp_classes() -> tuple:
    found = []
    try:
        from torch.distributed.fsdp import FSDPModule
        found.append(FSDPModule)
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        found.append(FullyShardedDataParallel)
    except ImportError:
        pass
    return tuple(found)


def is_ddp(fn) -> bool:
    ddp = _ddp_class()
    return ddp is not None and isinstance(fn, ddp)


def check_ddp_for_jit(ddp) -> None:
    """DDP configurations whose forward ``jit`` cannot split into bookkeeping around the inner module."""
    missing = [m for m in ("_pre_forward", "_post_forward") if not hasattr(ddp, m)]
    if missing or getattr(ddp, "_delay_all_reduce_all_params", False) or getattr(ddp, "_use_python_reducer", False):
        raise errors.UnsupportedError(
            "aotgrad.jit cannot run this DistributedDataParallel configuration's forward bookkeeping around a "
            "compiled module (python reducer, delayed all-reduce, or a torch without _pre_forward); jit the "
            "inner module and wrap it without those options", user_line=errors.caller_line())


def refuse_wrapped(fn, frontend: str) -> None:
    """Refuse a DDP module (for ``capture``) or FSDP-wrapped modules anywhere in ``fn``'s tree."""
    if not isinstance(fn, torch.nn.Module):
        return
    if frontend == "capture" and is_ddp(fn):
        raise errors.UnsupportedError(
            "aotgrad.capture of a DistributedDataParallel module would run DDP's reducer bookkeeping once, at "
            "capture, and later steps would get un-reduced gradients; use aotgrad.jit(ddp_model), which runs it "
            "around the compiled inner module on every call", user_line=errors.caller_line())
    fsdp = _fsdp_classes()
    for name, m in fn.named_modules():
        if fsdp and isinstance(m, fsdp):
            raise errors.UnsupportedError(
                f"module {name or type(fn).__name__!r} is FSDP-wrapped: its forward hooks all-gather and reshard "
                "parameters, which a captured graph would do once, at capture; compile the modules inside it "
                "before wrapping them instead", user_line=errors.caller_line())


def around_ddp(ddp, inner, args, kwargs):
    """One DDP step: DDP's own bookkeeping, eagerly, around ``inner`` (the compiled inner module)."""
    with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
        args, kwargs = ddp._pre_forward(*args, **kwargs)
        return ddp._post_forward(inner(*args, **kwargs))
