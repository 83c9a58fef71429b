"""CUDA-only parts of a training step, against eager: ``torch.amp.GradScaler`` with fp16 autocast in a
whole step, and NCCL (one rank) DDP / FSDP2 under every entry point. Skipped without CUDA; the fused
optimizers' rows are in tests/core/test_step_fused.py (CPU and CUDA)."""
from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aotgrad
from aotgrad import errors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).cuda()


def _batches(n=4):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(16, 32, device="cuda", generator=g), torch.randn(16, 1, device="cuda", generator=g))
            for _ in range(n)]


def _close(a, b, tol=1e-5) -> bool:
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


ENTRIES = {"jit": aotgrad.jit, "torch.compile": lambda f: torch.compile(f, backend="aotgrad")}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_grad_scaler_whole_step(entry):
    def make():
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=2)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ((model(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss
        return model, scaler, step
    m_e, s_e, step_e = make()
    m_c, s_c, step_c = make()
    torch._dynamo.reset()
    compiled = ENTRIES[entry](step_c)
    for x, y in _batches():
        assert torch.allclose(step_e(x, y), compiled(x, y), rtol=1e-4, atol=1e-5)
    assert s_e.get_scale() == s_c.get_scale()
    assert _close(list(m_e.parameters()), list(m_c.parameters()), 1e-4)


@pytest.fixture(scope="module")
def nccl():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _wrap(kind, model):
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[0])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cuda", (1,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(x, y):
        loss = ((fn(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, opt


def _local(ps):
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in ps]


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
@pytest.mark.parametrize("entry", ["jit(model)", "torch.compile(model)", "jit(step)", "torch.compile(step)"])
def test_nccl_one_rank(nccl, kind, entry):
    eager = _wrap(kind, _mlp())
    step_e, _ = _train(eager, eager)
    model = _wrap(kind, _mlp())
    torch._dynamo.reset()
    if entry.endswith("(model)"):
        wrapped = aotgrad.jit(model) if entry.startswith("jit") else torch.compile(model, backend="aotgrad")
        step_c, _ = _train(model, wrapped)
    else:
        step, _ = _train(model, model)
        step_c = aotgrad.jit(step) if entry.startswith("jit") else torch.compile(step, backend="aotgrad")
    try:
        for x, y in _batches():
            assert torch.allclose(step_e(x, y), step_c(x, y), rtol=1e-5, atol=1e-6)
    except errors.AotgradError as e:     # a typed refusal is allowed; it is printed for the GPU notes
        print(f"REFUSED {kind} {entry}: {type(e).__name__}: {str(e)[:300]}")
        return
    assert _close(_local(eager.parameters()), _local(model.parameters()))
    print(f"OK {kind} {entry}")
