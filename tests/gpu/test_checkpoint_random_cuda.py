"""Activation checkpointing with dropout on CUDA: the recomputation in the backward redraws eager's
Philox numbers, so the CUDA generator's (seed, offset) after the backward is eager's and gradients
are bitwise eager's on the eager backend (``tests.eager_check`` compares the CUDA generator state
after the forward and after the backward). Skipped without CUDA."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import aotgrad
from tests.eager_check import check, default_compile
from tests.models.entries import ENTRIES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXACT = dict(rtol=0, atol=0)
# compiled_autograd refuses saved-tensor hooks (its documented limit): the forward entries only.
CASES = {**{k: (v, EXACT) for k, v in ENTRIES.items() if k != "compiled_autograd"},
         "inductor": (dict(compile=default_compile, fw_compiler="inductor"), dict(rtol=1e-4, atol=1e-4))}


class Layer(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.fc, self.reentrant = nn.Linear(32, 32), reentrant

    def body(self, x):
        return F.dropout(self.fc(x).relu(), 0.3, True) + torch.rand_like(x) * 0.1

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=self.reentrant)


class Stack(nn.Module):
    def __init__(self, reentrant=False):
        super().__init__()
        self.layers = nn.ModuleList([Layer(reentrant) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = F.dropout(layer(x), 0.1, True)
        return x


@pytest.mark.parametrize("entry", sorted(CASES))
def test_checkpointed_dropout_redraws_eagers_numbers(entry):
    opts, tol = CASES[entry]
    torch.manual_seed(0)
    model, x = Stack().cuda(), torch.randn(8, 32, device="cuda", requires_grad=True)
    check(model, (x,), calls=2, **opts, **tol)


def test_selective_checkpoint_policy_with_dropout():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def f(x, w):
        def body(x):
            return F.dropout(torch.mm(x, w).sin(), 0.5, True).cos()
        return checkpoint(body, x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum()
    x, w = (torch.randn(16, 16, device="cuda", requires_grad=True) for _ in range(2))
    check(f, (x, w), calls=2, **EXACT)
