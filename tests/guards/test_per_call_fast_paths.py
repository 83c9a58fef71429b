"""The per-call fast paths (issue #61): each shortcut still raises, recompiles or refuses where the
full check would. A saved view of a parameter that is already a view of the caller's tensor
(the eager backend's ``t()``) skips the storage comparison: a write to the parameter after the
forward must still raise eager's version error at backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import aotgrad


def _outcome(fn):
    try:
        fn()
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)
    return None


def _write_after_forward(step, model, x, write):
    loss = step(x).square().sum()
    write(model)
    loss.backward()


@pytest.mark.parametrize("write", ["weight", "weight_view_base", "bias"])
def test_a_saved_view_of_a_parameter_written_after_the_forward_raises_as_eager(write):
    outcomes = []
    for compiled in (False, True):
        torch.manual_seed(0)
        lin = nn.Linear(3, 2)      # its input requires grad: eager's addmm saves its weight
        if write == "weight_view_base":       # a parameter that is itself a view of another tensor
            lin.weight = nn.Parameter(torch.randn(2, 2, 3)[0])
        model, x = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), lin), torch.randn(5, 4)
        step = aotgrad.capture(model, x).compile() if compiled else model

        def mutate(m):
            with torch.no_grad():
                (m[2].bias if write == "bias" else m[2].weight).add_(1.0)
        outcomes.append(_outcome(lambda: _write_after_forward(step, model, x, mutate)))
    assert outcomes == [write != "bias" or None] * 2


def test_an_unwritten_saved_view_trains_like_eager():
    from tests.eager_check import check
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (torch.randn(5, 4, requires_grad=True),))
