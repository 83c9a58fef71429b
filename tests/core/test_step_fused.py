"""A whole training step with a fused optimizer (``fused=True``: one ATen op over every parameter),
against eager, bitwise: parameters, optimizer state and losses over several steps, with a learning-rate
schedule (a new ``lr`` every step), two parameter groups, a tensor learning rate. ``aotgrad.jit`` hands
the step to Dynamo (the fused kernel reads the step's learning-rate input as a number); the staged
``capture`` refuses it by that cause. CPU here; the same rows on CUDA where there is one
(``AdamW(fused=True)`` is what CUDA users pick for speed)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad import errors

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
OPTIMIZERS = {
    "AdamW": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, fused=True),
    "Adam-amsgrad": lambda ps, lr: torch.optim.Adam(ps, lr=lr, amsgrad=True, fused=True),
    "SGD-momentum": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True, fused=True),
    "Adagrad": lambda ps, lr: torch.optim.Adagrad(ps, lr=lr, fused=True),
}


def _setup(device, opt_name, lr_kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    lr = torch.tensor(0.01, device=device if opt_name != "SGD-momentum" else "cpu") if lr_kind == "tensor" else 0.01
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}] \
        if lr_kind == "groups" else model.parameters()
    opt = OPTIMIZERS[opt_name](groups, lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if lr_kind == "schedule" else None

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        return loss
    return model, opt, step


def _state(model, opt) -> list:
    return [t for t in list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("lr_kind", ["float", "schedule", pytest.param("groups", marks=pytest.mark.slow),
                                     pytest.param("tensor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("entry", ["jit", "torch.compile"])
def test_fused_optimizer_step_is_eager_bitwise(device, opt_name, lr_kind, entry):
    if lr_kind == "tensor" and opt_name == "Adagrad":
        pytest.skip("Adagrad(fused=True) takes no tensor learning rate")
    if opt_name == "Adagrad" and device == "cuda":
        pytest.skip("torch's Adagrad(fused=True) runs on CPU only")
    m_e, o_e, step_e = _setup(device, opt_name, lr_kind)
    m_c, o_c, step_c = _setup(device, opt_name, lr_kind)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g).to(device), torch.randn(4, 1, generator=g).to(device))
               for _ in range(5)]
    compiled = aotgrad.jit(step_c) if entry == "jit" else torch.compile(step_c, backend="aotgrad")
    for i, (x, y) in enumerate(batches):
        loss_e, loss_c = step_e(x, y), compiled(x, y)
        assert torch.equal(loss_e, loss_c), (i, loss_e, loss_c)
    a, b = _state(m_e, o_e), _state(m_c, o_c)
    assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    assert [grp["lr"] for grp in o_e.param_groups] == [grp["lr"] for grp in o_c.param_groups]


@pytest.mark.parametrize("opt_name", ["AdamW", "SGD-momentum"])
def test_staged_capture_refuses_a_fused_step_and_changes_nothing(opt_name):
    m, o, step = _setup("cpu", opt_name, "float")
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    step(x, y)      # the optimizer's state exists
    before = copy.deepcopy(_state(m, o))
    with pytest.raises(errors.GraphBreakError, match=r"fused=True\) inside a captured training step"):
        aotgrad.capture(step, x, y)
    assert all(torch.equal(u, v) for u, v in zip(before, _state(m, o)))
