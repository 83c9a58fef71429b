"""The distributed cases, run inside each rank by ``harness``: ``{wrapper}-{entry}-{variant}``.

wrapper: ``ddp`` (DistributedDataParallel) or ``fsdp`` (FSDP2 ``fully_shard`` on every layer, then
the root). entry: ``compile`` (torch.compile, backend aotgrad), ``jit``, ``ca`` (eager forward, the
backward under ``aotgrad.compiled_autograd``), ``jitca`` / ``compileca`` (a compiled forward, then that), ``cainside`` (the DDP
built inside the compiled-autograd block: refused), ``capture`` (the staged capture of the model: one
graph with FSDP2's all-gathers and reduce-scatters in it; of a DDP model, refused). variant:
``plain``; ``nosync`` (two micro-batches, the first under ``no_sync``); ``unused``
(``find_unused_parameters``, one layer used on rank 0 only, one never); ``static``
(``static_graph``); ``bf16`` (FSDP2 ``MixedPrecisionPolicy``); ``ckpt`` (checkpoint_wrapper-ed
blocks, each its own FSDP unit); ``ckptout`` (``checkpoint`` called around an FSDP unit); ``mixed``
(compiled-autograd and eager backwards alternate on one DDP model); ``single`` (FSDP2 on the
root only: one unit); ``buckets`` (a bucket per parameter, rebuilt in gradient order); ``bucketlist`` (``bucket_cap_mb_list``:
a cap per bucket); both also report whether the reducer's buckets are the ones eager DDP rebuilt; ``bn`` (BatchNorm: DDP broadcasts buffers from rank 0 every forward); ``commhook`` (a DDP
communication hook, which compiled autograd refuses).

Each case trains a fresh model 3 SGD steps next to the same model under eager DDP/FSDP2, each rank
on its own data, and reports per step whether the reduced gradients (FSDP2: this rank's shards)
and the parameters after the step equal eager's.
"""
from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import aotgrad
from aotgrad import errors

STEPS = 3


class MLP(nn.Module):
    """Three layers; ``extra`` runs on rank 0 only and ``never`` on no rank (the ``unused`` variant)."""

    def __init__(self, rank=0, branches=False, ckpt_outside=False, norm=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.branches, self.rank, self.ckpt_outside = branches, rank, ckpt_outside
        if branches:
            self.extra, self.never = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.norm(self.fc1(x)))
        h = torch.tanh(checkpoint(self.fc2, h, use_reentrant=False) if self.ckpt_outside else self.fc2(h))
        if self.branches and self.rank == 0:
            h = h + self.extra(h)
        return self.fc3(h)


class Blocks(nn.Module):
    """Checkpointed blocks (``checkpoint_wrapper``), then a head."""

    def __init__(self):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(checkpoint_wrapper(nn.Sequential(nn.Linear(6 if i == 0 else 16, 16), nn.Tanh()))
                                    for i in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model(wrapper, variant, rank, world):
    if variant == "ckpt":
        model = Blocks()
    else:
        model = MLP(rank, branches=variant == "unused", ckpt_outside=variant == "ckptout", norm=variant == "bn")
    if wrapper == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=variant == "unused",
                                                  static_graph=variant == "static",
                                                  bucket_cap_mb=1e-4 if variant == "buckets" else None,
                                                  **({"bucket_cap_mb_list": [1e-4, 1e-3]} if variant == "bucketlist" else {}))
        if variant == "commhook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            ddp.register_comm_hook(None, allreduce_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mesh": init_device_mesh("cpu", (world,))}
    if variant == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = list(model.blocks) if variant == "ckpt" else [] if variant == "single" else [model.fc1, model.fc2, model.fc3]
    for unit in units:
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return model


def _local(t):
    return None if t is None else (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(model, step, backward, rank, variant):
    """Per step: the gradients after reduction; then the parameters after the last SGD step."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    grads = []
    for i in range(STEPS):
        opt.zero_grad()
        micro = 2 if variant == "nosync" else 1
        for j in range(micro):
            torch.manual_seed(100 * rank + 10 * i + j)       # each rank its own data: reduction matters
            x, y = torch.randn(4, 6), torch.randn(4, 1)
            sync = model.no_sync() if j < micro - 1 else contextlib.nullcontext()
            with sync:
                backward(((step(x) - y) ** 2).mean())
        grads.append([_local(p.grad) for p in params])
        opt.step()
    return grads, [_local(p) for p in params] + [_local(b) for b in model.buffers()]


def _same(a, b, tol):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol)


_CA_RUNS = [0]


def _ca_backward(loss):
    with aotgrad.compiled_autograd("eager") as ca:
        loss.backward()
    _CA_RUNS[0] += ca.runs


def _compiled(entry, step) -> int:
    """How many graphs the entry point compiled: a case where nothing compiled proves nothing."""
    if entry in ("jit", "jitca"):
        units = getattr(step.around, "units", None)
        entries = sum(len(j.entries) for _, j in units) if units else len(step.entries)
        return entries if entry == "jit" or _CA_RUNS[0] else 0
    if entry == "ca":
        return _CA_RUNS[0]
    if entry == "capture":      # one graph, FSDP2's collectives inside it
        return 1
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return graphs if entry == "compile" or _CA_RUNS[0] else 0


def run(name: str, rank: int, world: int):
    wrapper, entry, variant = name.split("-")
    gc.collect()       # earlier cases' DDP modules: compiled autograd would switch every live one
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    aotgrad.compiled_autograd.reset()
    _CA_RUNS[0] = 0
    if entry == "capture" and wrapper == "ddp":
        try:
            aotgrad.capture(_model(wrapper, variant, rank, world), torch.randn(4, 6))
        except errors.AotgradError as e:
            return {"refused": type(e).__name__, "message": str(e)}
        return {"refused": None}
    if entry == "cainside":        # the model built, run and differentiated all inside the block
        try:
            with aotgrad.compiled_autograd("eager"):
                model = _model(wrapper, variant, rank, world)     # held: a freed DDP reduces nothing
                model(torch.randn(4, 6)).sum().backward()
        except errors.AotgradError as e:
            return {"refused": type(e).__name__, "message": str(e)}
        return {"refused": None}
    eager = _model(wrapper, variant, rank, world)
    want_grads, want_params = _train(eager, eager, lambda loss: loss.backward(), rank, variant)
    model = _model(wrapper, variant, rank, world)
    step = {"compile": lambda: torch.compile(model, backend="aotgrad"), "jit": lambda: aotgrad.jit(model),
            "ca": lambda: model, "jitca": lambda: aotgrad.jit(model),
            "compileca": lambda: torch.compile(model, backend="aotgrad"),
            "capture": lambda: aotgrad.capture(model, torch.randn(4, 6)).compile()}[entry]()
    backward = _ca_backward if entry in ("ca", "jitca", "compileca") else (lambda loss: loss.backward())
    if variant == "mixed":       # the reducer compiled autograd switched the model to, in eager backwards
        calls = iter(range(100))
        backward = lambda loss: (_ca_backward if next(calls) % 2 == 0 else torch.Tensor.backward)(loss)
    try:
        got_grads, got_params = _train(model, step, backward, rank, variant)
    except errors.AotgradError as e:
        return {"refused": type(e).__name__, "message": str(e)}
    tol = 1e-2 if variant == "bf16" else 1e-5
    out = {"grads": [all(_same(a, b, tol) for a, b in zip(w, g)) for w, g in zip(want_grads, got_grads)],
           "params": all(_same(a, b, tol) for a, b in zip(want_params, got_params)),
           "compiled": _compiled(entry, step)}
    if variant.startswith("bucket"):    # the reducer's buckets, by bytes, are the ones eager DDP rebuilt
        ours = [sum(p.numel() * p.element_size() for p in b) for b in model._aotgrad_reducer.buckets]
        out["buckets"] = ", ".join(map(str, ours)) == eager._get_ddp_logging_data().get("rebuilt_bucket_sizes")
    return out
