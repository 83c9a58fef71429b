"""DistributedDataParallel's gradient reduction from a compiled backward: a bucketed reducer in Python.

DDP's C++ reducer hooks every gradient accumulator with a C++ function the compiled-autograd engine
cannot capture (it raises "Compiled autograd is not compatible with C++ DDP Reducer"). Entering
``aotgrad.compiled_autograd`` switches each live DDP module to this reducer, once and for good
(eager backwards then reduce through it too): the C++ reducer's hooks are removed, DDP's forward
takes its Python-reducer path, and buffers are broadcast and ``no_sync`` recorded here instead.

A post-accumulate-grad hook per parameter marks it ready; the compiled backward calls it right
after that gradient's accumulation (``accumulate.run_early``), where eager's engine would. A bucket
(DDP's own size-based assignment: last parameters first, then, rebuilt once as DDP does, in the
order the first reduced backward produced gradients) is all-reduced asynchronously as soon as it
and every bucket before it are ready: bucket order is the one every rank agrees on. A final
callback issues the rest (a parameter without a gradient counts as zero, as DDP's buckets do),
waits, and writes the averaged gradients back. The arithmetic is DDP's: each gradient times
1/world_size into the bucket, then summed. Nothing here is gloo- or CPU-specific.
"""
from __future__ import annotations

import gc
import time
import weakref

import torch
import torch.distributed as dist

from .._torch import ddp_bucket_assignment, ddp_bucket_limits, queue_engine_callback
from .. import errors

_SEEN: "weakref.WeakSet" = weakref.WeakSet()     # DDP modules built since this module was imported
_scanned = [False]                               # the one search for DDP modules built before that


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:      # a build without distributed support
        return None
    return DistributedDataParallel


def _on_register(module, name, submodule):
    """DDP's constructor assigns ``self.module``: remember the DDP (weakly) as it is built."""
    if name == "module":
        ddp = _ddp_class()
        if ddp is not None and isinstance(module, ddp):
            _SEEN.add(module)


torch.nn.modules.module.register_module_module_registration_hook(_on_register)


def live_ddp_modules() -> list:
    """Every DDP module alive; the first call also finds those built before aotgrad was imported."""
    ddp = _ddp_class()
    if ddp is None or not dist.is_available() or not dist.is_initialized():
        return []
    if not _scanned[0]:
        _scanned[0] = True
        classes = [ddp, *_subclasses(ddp)]
        _SEEN.update(o for o in gc.get_referrers(*classes) if isinstance(o, ddp))
    return list(_SEEN)


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def prepare() -> None:
    """Switch every live DDP module still on its C++ reducer to ``BucketReducer``; one this reducer
    cannot stand in for keeps its C++ reducer (``refuse_cpp_reducer`` names it if it is used)."""
    for ddp in live_ddp_modules():
        if getattr(ddp, "_aotgrad_reducer", None) is None and getattr(ddp, "reducer", None) is not None \
                and not ddp._use_python_reducer and _unsupported(ddp) is None:
            convert(ddp)


def refuse_cpp_reducer(error: BaseException) -> None:
    """The engine's refusal of a C++ DDP reducer, before the backward ran, as a typed error."""
    if not isinstance(error, RuntimeError) or "C++ DDP Reducer" not in str(error):
        return
    line = errors.user_frame(error.__traceback__)
    reasons = sorted({why for ddp in live_ddp_modules() if not converted(ddp)
                      for why in [_unsupported(ddp)] if why is not None})
    if not reasons:
        raise errors.UnsupportedError(
            "a DistributedDataParallel module created inside this aotgrad.compiled_autograd block still runs DDP's "
            "C++ reducer, which cannot run inside a compiled backward (the block switches the DDP modules alive "
            "when it starts to aotgrad's reducer); create the model before entering the block", user_line=line
        ) from error
    raise errors.UnsupportedError(
        f"compiled autograd cannot reduce the gradients of a DistributedDataParallel module with "
        f"{' / '.join(reasons)}: DDP's C++ reducer, which implements it, cannot run inside a compiled backward; "
        "run that model's backward outside aotgrad.compiled_autograd", user_line=line) from error


def _unsupported(ddp) -> str | None:
    what = [why for cond, why in (
        (getattr(ddp, "_comm_hooks", None), "a registered communication hook"),
        (getattr(ddp, "_delay_all_reduce_all_params", False), "delay_all_reduce_named_params"),
        (getattr(ddp, "mixed_precision", None) is not None, "DDP's mixed_precision"),
        (any(hasattr(p, "_in_backward_optimizers") for p in ddp._module_parameters), "optimizers in backward"),
        (getattr(getattr(ddp, "_join_config", None), "enable", False), "the Join context"),
        (not hasattr(ddp.reducer, "_remove_autograd_hooks"), "a torch whose DDP reducer keeps its hooks")) if cond]
    return what[0] if what else None


def convert(ddp) -> "BucketReducer":
    """Move ``ddp`` from its C++ reducer to a ``BucketReducer`` (idempotent)."""
    if getattr(ddp, "_aotgrad_reducer", None) is not None:
        return ddp._aotgrad_reducer
    assert _unsupported(ddp) is None, _unsupported(ddp)
    ddp.reducer._remove_autograd_hooks()
    # A first-iteration static-graph sink would queue the C++ reducer's delayed all-reduce.
    ddp._static_graph_delay_allreduce_enqueued = True
    ddp._use_python_reducer = True
    ddp._aotgrad_reducer = BucketReducer(ddp)
    ddp.register_forward_pre_hook(lambda m, args: pre_forward(m), prepend=True)
    ddp.register_forward_hook(lambda m, args, out: post_forward(m))
    return ddp._aotgrad_reducer


def converted(ddp) -> bool:
    return getattr(ddp, "_aotgrad_reducer", None) is not None


def pre_forward(ddp) -> None:
    """What DDP's C++-reducer forward does before the module runs, less the reducer: buffer broadcast."""
    if ddp._check_sync_bufs_pre_fwd():
        ddp._sync_buffers()


def post_forward(ddp) -> None:
    """...and after it: whether this forward's backward reduces (``no_sync``), buffer broadcast."""
    if ddp._check_sync_bufs_post_fwd():
        ddp._sync_buffers()
    ddp.require_forward_param_sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync


def _buckets(params: list, limits: list) -> list:
    """DDP's assignment by size (the first bucket smaller), in the order of ``params``."""
    return [[params[i] for i in bucket] for bucket in ddp_bucket_assignment(params, limits)]


class BucketReducer:
    """Per-backward state: which parameters are ready, the next bucket to issue, issued work."""

    def __init__(self, ddp):
        self.ddp = weakref.ref(ddp)
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.params = [p for p in ddp._module_parameters if p.requires_grad]
        self.limits = ddp_bucket_limits(ddp)
        # As DDP: last parameters first until the first backward shows the order gradients come in.
        self._assign(list(reversed(_buckets(self.params, self.limits))))
        self.order: list | None = [] if not ddp.find_unused_parameters else None
        self.timeline: list = []     # the last backward's (bucket index or "end", time.perf_counter())
        self.find_unused = ddp.find_unused_parameters
        self.used: set = set()
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _assign(self, buckets: list) -> None:
        self.buckets = buckets
        self.bucket_of = {id(p): k for k, b in enumerate(buckets) for p in b}

    def _reset(self) -> None:
        self.ready: set = set()
        self.pending = [len(b) for b in self.buckets]
        self.next = 0
        self.issued: list = []
        self.active = False

    def _ready(self, param) -> None:
        ddp = self.ddp()
        self.used.add(id(param))         # as DDP's local-used map: across no_sync backwards too
        if ddp is None or not ddp.require_forward_param_sync or id(param) in self.ready:
            return
        if not self.active:
            self.active, self.timeline = True, []
            queue_engine_callback(self._finish)
        self.ready.add(id(param))
        if self.order is not None:
            self.order.append(param)
        self.pending[self.bucket_of[id(param)]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._issue(self.next)

    def _issue(self, k: int) -> None:
        # A parameter no backward since the last reduction reached counts as zero, as in DDP's bucket.
        grads = [p.grad if p.grad is not None and id(p) in self.used else torch.zeros_like(p)
                 for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / self.world)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.timeline.append((k, time.perf_counter()))
        self.issued.append((k, flat, work))
        self.next = k + 1

    def _finish(self) -> None:
        """End of the backward: issue what is left, wait, write the averages into ``.grad``."""
        try:
            while self.next < len(self.buckets):
                self._issue(self.next)
            self.timeline.append(("end", time.perf_counter()))
            used = self._globally_used()
            for k, flat, work in self.issued:
                work.wait()
                self._write_back(self.buckets[k], flat, used)
            self._rebuild()
        finally:
            self.used = set()
            self._reset()

    def _rebuild(self) -> None:
        """Once, after the first reduced backward, as DDP's ``_rebuild_buckets``: buckets in the order
        gradients became ready, rank 0's order on every rank (bucket order must agree across ranks)."""
        order, self.order = self.order, None
        if order is None or len(order) != len(self.params):
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        ranks = torch.tensor([index[id(p)] for p in order], dtype=torch.int64, device=self.params[0].device)
        dist.broadcast(ranks, group=self.group, group_src=0)
        self._assign(_buckets([self.params[i] for i in ranks.tolist()], self.limits))

    def _globally_used(self):
        """With ``find_unused_parameters``, DDP leaves the gradient of a parameter no rank used alone."""
        if not self.find_unused:
            return None
        params = [p for b in self.buckets for p in b]
        mask = torch.tensor([id(p) in self.used for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(mask, group=self.group)
        return {id(p) for p, m in zip(params, mask.tolist()) if m}

    @staticmethod
    def _write_back(params, flat, used) -> None:
        offset = 0
        for p in params:
            n = p.numel()
            if used is None or id(p) in used:
                value = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
            offset += n
