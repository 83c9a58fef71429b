"""Programs through capture -> export -> load, compared with eager by ``tests/eager_check.py``
(outputs, views, in-place effects, RNG, gradients). The loaded step is given the compiled
copy's own parameters and buffers (``aotgrad.load(path, state=...)``), so the checker sees
its gradients and buffer updates where it sees a compiled function's."""
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import aotgrad
from tests.eager_check import check, check_training


def exported(fn, args, kwargs, **opts):
    captured = aotgrad.capture(fn, *args, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        path = captured.export(f"{tmp}/step.aotgrad", values=False)
        state = {}
        if isinstance(fn, nn.Module):
            state = {**dict(fn.named_parameters()), **dict(fn.named_buffers())}
        return aotgrad.load(path, state=state)


class Counter(nn.Module):
    """A buffer the forward rebinds, a tied weight, BatchNorm statistics."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, idx, target):
        self.count = self.count + 1
        return F.cross_entropy(self.head(self.bn(self.emb(idx))), target)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def block(self, x):
        return F.dropout(self.b(F.gelu(self.a(x))), 0.3, training=True)

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False).sum()


def mutate_and_view(a, b, *, scale=2.0, mode="sum"):
    a.mul_(scale)
    y = torch.sin(a) * b
    return {"loss": y.sum() if mode == "sum" else y.mean(), "row": a[0], "t": a.t(), "tail": y.view(-1)[2:5]}


def random_inside(x):
    noise = torch.randn_like(x)
    return F.dropout(x * noise, 0.5, training=True) + torch.rand(3)


def test_mutations_views_and_constants():
    check(mutate_and_view, (torch.randn(3, 3), torch.randn(3, 3, requires_grad=True)),
          {"scale": 3.0, "mode": "sum"}, compile=exported)


def test_random_ops_draw_like_eager():
    check(random_inside, (torch.randn(4, 3, requires_grad=True),), compile=exported)


def test_tied_rebound_buffer_batchnorm_module():
    check(Counter().train(), (torch.randint(10, (8,)), torch.randint(10, (8,))), compile=exported)


def test_checkpoint_with_dropout():
    torch.manual_seed(0)
    check(Checkpointed(), (torch.randn(4, 5, requires_grad=True),), compile=exported)


def test_inference_step_under_no_grad():
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval(), (torch.randn(3, 4),), compile=exported,
          call_context=torch.no_grad, backward=False)


def test_trains_three_steps_with_adam():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Dropout(0.2), nn.Linear(8, 1)), \
            (torch.randn(5, 6),)
    check_training(lambda: (lambda m, a: (_Loss(m), a))(*make()), compile=exported,
                   optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))


class _Loss(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).square().mean()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(dtype):
    check(lambda x, w: (x @ w).relu().sum(), (torch.randn(3, 4, dtype=dtype), torch.randn(4, 2, dtype=dtype,
                                                                                        requires_grad=True)),
          compile=exported, rtol=1e-2 if dtype is torch.bfloat16 else 1.3e-6, atol=1e-2)
