"""Distributed wrappers whose ``forward`` does bookkeeping outside its tensors, under ``aotgrad.jit``.

``DistributedDataParallel.forward`` prepares its reducer before and after the inner module runs
(``_pre_forward``/``_post_forward``): a graph captured once would do that once. ``aotgrad.jit``
runs that bookkeeping eagerly around the compiled inner module on every call (the reducer's hooks
on the parameters' gradient accumulators then see the compiled backward's gradients, as in eager).

FSDP2 (``fully_shard``) all-gathers a unit's parameters in a forward pre-hook, reshards them in
a forward hook and reduce-scatters their gradients from autograd hooks it puts on the unit's
inputs and outputs: collectives on sharded ``DTensor`` parameters that no graph of ours holds.
``aotgrad.jit`` runs the FSDP module eagerly, hooks included, and compiles the forward of each
innermost unit (a unit with no unit inside it) on its unsharded, plain parameters, the way
``torch.compile`` graph-breaks at FSDP's hooks: the gradients of those parameters are computed
by the compiled backward and flow into FSDP's hooks as eager's do. Code of an outer unit that is
not inside an inner one runs eagerly.

``aotgrad.capture`` of FSDP2 modules, and ``jit`` or ``capture`` of a whole step over them, hold the
collectives in the one graph instead (``inputs.fsdp_graph``). Refused before anything runs: ``capture``
of a DDP module (a ``Captured`` is one graph with no place for DDP's per-call reducer bookkeeping) and
FSDP1 (``FullyShardedDataParallel``) anywhere.
"""
from __future__ import annotations

import sys

import functools

import torch

from .._torch import top_saved_tensors_default_hooks
from .. import errors


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:       # a build without distributed support
        return None
    return DistributedDataParallel


def _fsdp_classes() -> tuple:
    """FSDP's module classes, if the program imported FSDP (a model holding FSDP modules did: importing
    it here for nothing would cost a second and a half of every first call)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return tuple(c for c in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None))
                 if c is not None)


def _fsdp2_class():
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def is_ddp(fn) -> bool:
    ddp = _ddp_class()
    return ddp is not None and isinstance(fn, ddp)


def _aotgrad_reduced(ddp) -> bool:
    """Switched to compiled autograd's bucketed reducer (``compiled_autograd.ddp``)."""
    return getattr(ddp, "_aotgrad_reducer", None) is not None


def check_ddp_for_jit(ddp) -> None:
    """DDP configurations whose forward ``jit`` cannot split into bookkeeping around the inner module."""
    missing = [m for m in ("_pre_forward", "_post_forward") if not hasattr(ddp, m)]
    python_reducer = getattr(ddp, "_use_python_reducer", False) and not _aotgrad_reduced(ddp)
    if missing or getattr(ddp, "_delay_all_reduce_all_params", False) or python_reducer:
        raise errors.UnsupportedError(
            "aotgrad.jit cannot run this DistributedDataParallel configuration's forward bookkeeping around a "
            "compiled module (python reducer, delayed all-reduce, or a torch without _pre_forward); jit the "
            "inner module and wrap it without those options", user_line=errors.caller_line())


_GRAPH = {"capture": "one captured graph", "jit": "one jitted graph",
          "step": "the one graph of a whole training step (aotgrad.jit or capture of a step calling opt.step())"}


def refuse_wrapped(fn, frontend: str) -> None:
    """Refuse a DDP module (for ``capture``) or FSDP1 modules anywhere in ``fn``'s tree.
    ``frontend``: ``capture``, ``jit`` or ``step``."""
    if not isinstance(fn, torch.nn.Module) or isinstance(fn, _UnitForward):
        return
    if frontend == "capture" and is_ddp(fn):
        raise errors.UnsupportedError(
            "aotgrad.capture of a DistributedDataParallel module would run DDP's reducer bookkeeping once, at "
            "capture, and later steps would get un-reduced gradients; use aotgrad.jit(ddp_model), which runs it "
            "around the compiled inner module on every call", user_line=errors.caller_line())
    fsdp = _fsdp_classes()
    if frontend in ("capture", "step"):     # FSDP2 runs in the graph (inputs.fsdp_graph): FSDP1 is left
        fsdp = tuple(c for c in fsdp if c is not _fsdp2_class())
    for name, m in fn.named_modules():
        if fsdp and isinstance(m, fsdp):
            # A whole step jit hands to Dynamo, which runs the hooks eagerly between its graphs.
            # Only FSDP1 (FullyShardedDataParallel) reaches here: its flat parameters are no unit's own.
            raise (errors.GraphBreakError if frontend == "step" else errors.UnsupportedError)(
                f"module {name or type(fn).__name__!r} is wrapped in FSDP1 (FullyShardedDataParallel): its hooks "
                f"all-gather flat parameters and reshard them on every call, which {_GRAPH[frontend]} cannot hold "
                "(torch.compile's fullgraph=True refuses them too); shard with FSDP2's fully_shard instead (aotgrad."
                "capture and aotgrad.jit of a model or a whole step run it in one graph), or use torch.compile or "
                "compiled autograd, which run FSDP1's hooks eagerly between graphs", user_line=errors.caller_line())


def split_for_jit(jit) -> None:
    """Set ``jit.fn``/``jit.around`` for a distributed wrapper: ``around(call, args, kwargs)`` runs one step."""
    fn = jit.fn
    if jit.around is not None:      # a whole training step (inputs.step): FSDP2 runs in its graph (inputs.fsdp_graph)
        refuse_wrapped(fn, "step")
        return
    if is_ddp(fn):
        check_ddp_for_jit(fn)
        jit.fn, jit.around = fn.module, functools.partial(around_ddp, fn)
    elif isinstance(fn, torch.nn.Module) and not isinstance(fn, _UnitForward):
        units = innermost_units(fn)
        if units:
            jit.around = FsdpUnits(fn, units, jit)
            return
    refuse_wrapped(jit.fn, "jit")


def around_ddp(ddp, inner, args, kwargs):
    """One DDP step: DDP's own bookkeeping, eagerly, around ``inner`` (the compiled inner module)."""
    with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
        if _aotgrad_reduced(ddp):      # its forward hooks do the bookkeeping a Python reducer needs
            from ..compiled_autograd import ddp as reducer
            reducer.pre_forward(ddp)
            out = inner(*args, **kwargs)
            reducer.post_forward(ddp)
            return out
        args, kwargs = ddp._pre_forward(*args, **kwargs)
        return ddp._post_forward(inner(*args, **kwargs))


def innermost_units(module) -> list:
    """FSDP2 units with no FSDP unit below them, in module order; other FSDP versions are refused."""
    fsdp2 = _fsdp2_class()
    if fsdp2 is None or not any(isinstance(m, fsdp2) for m in module.modules()):
        return []
    if len(_fsdp_classes()) > 1 and any(isinstance(m, _fsdp_classes()[1]) for m in module.modules()):
        refuse_wrapped(module, "jit")      # FSDP1 mixed in: its flat parameters are not a unit's own
    return [m for m in module.modules() if isinstance(m, fsdp2)
            and not any(isinstance(c, fsdp2) for c in list(m.modules())[1:])]


class _UnitForward(torch.nn.Module):
    """An FSDP unit's own ``forward`` without its hooks, as a module whose tree is the unit's: called
    between FSDP's pre- and post-forward hooks, its parameters are the unsharded, plain ones."""

    def __init__(self, unit):
        super().__init__()
        self.unit = unit

    def forward(self, *args, **kwargs):
        return type(self.unit).forward(self.unit, *args, **kwargs)


class FsdpUnits:
    """One jitted step of an FSDP2 module: the module runs eagerly with FSDP's hooks, and each innermost
    unit's forward is its own ``aotgrad.jit`` while the step runs (put back after, even on error)."""

    def __init__(self, root, units, jit):
        self.root = root
        make = functools.partial(type(jit), dynamic=jit.dynamic, compile_options=jit.compile_options,
                                 recompile_limit=jit.recompile_limit)
        base = jit.name or "model"
        self.units = [(u, make(_UnitForward(u), name=f"{base}.{n}" if n else base)) for n, u in _named(root, units)]

    def __call__(self, call, args, kwargs):
        saved = [(u, u.__dict__.get("forward")) for u, _ in self.units]
        try:
            for u, inner in self.units:
                u.forward = functools.partial(_unit_call, inner, u)
            return self.root(*args, **kwargs)
        finally:
            for u, old in saved:
                if old is None:
                    u.__dict__.pop("forward", None)
                else:
                    u.forward = old


def _named(root, units) -> list:
    names = {id(m): n for n, m in root.named_modules()}
    return [(names[id(u)], u) for u in units]


def _unit_call(inner, unit, *args, **kwargs):
    if top_saved_tensors_default_hooks(True) is not None:
        raise errors.UnsupportedError(
            f"FSDP unit {type(unit).__name__} is called under torch.utils.checkpoint (or saved-tensor hooks) "
            "inside aotgrad.jit: checkpoint's recomputation in backward would run the unit's forward eagerly, "
            "not the compiled one; checkpoint inside the unit instead (checkpoint_wrapper before fully_shard)",
            user_line=errors.caller_line())
    return inner(*args, **kwargs)
