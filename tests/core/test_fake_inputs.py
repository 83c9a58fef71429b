"""Fake copies of a capture's inputs made from meta tensors (aotgrad._torch.plain_fake): the
graph must be what ``FakeTensorMode.from_tensor`` copies give, for every input that path takes and
for the ones it leaves to from_tensor (shared storages, views, grads already present)."""
import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad._torch import FakeTensorMode, plain_fake
from tests.eager_check import check

REACHED = []        # a parameter also reachable outside the module tree


class Reaches(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        REACHED[:] = [self.lin.weight]

    def forward(self, x):
        return (self.lin(x) * REACHED[0].sum()).sum()


def test_plain_fake_matches_from_tensor():
    t = torch.randn(3, 5).t().contiguous().requires_grad_()
    t.grad = torch.ones_like(t)
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    fake = plain_fake(mode, t)
    ref = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True).from_tensor(t)
    for attr in ("shape", "dtype", "device", "requires_grad", "is_leaf"):
        assert getattr(fake, attr) == getattr(ref, attr), attr
    assert fake.stride() == ref.stride() and fake.grad is not None and fake.grad.shape == t.shape
    assert mode.from_tensor(t) is fake        # registered in the memo: one fake per real tensor


def test_plain_fake_leaves_other_tensors_to_from_tensor():
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    base = torch.randn(4, 4)
    assert plain_fake(mode, base[1]) is None                                  # a view
    assert plain_fake(mode, torch.randn(2, requires_grad=True) * 2) is None   # not a leaf
    assert plain_fake(mode, torch.randn(3, dtype=torch.complex64).conj()) is None     # conjugate bit
    assert plain_fake(mode, torch.randn(4, 4)[:, :2].contiguous()) is not None
    leaf = torch.randn(16, requires_grad=True)
    assert plain_fake(mode, leaf.view(4, 4)) is None                          # a view that requires grad
    # A view of its whole storage (a buffer registered as mask.view(1, 1, n, n)): its own layout.
    for view in (torch.randn(16).view(1, 4, 4), torch.randn(4, 4).t()):
        fake = plain_fake(mode, view)
        assert fake.shape == view.shape and fake.stride() == view.stride() and not fake._is_view()


def test_parameter_reached_through_a_global_is_refused():
    # Not baked in as a constant (its gradient would be lost): refused before anything runs.
    with pytest.raises(aotgrad.errors.UnsupportedError, match="requires grad but is not an input"):
        aotgrad.capture(Reaches(), torch.randn(2, 4))


def test_inputs_sharing_a_storage_keep_their_aliasing():
    def f(a, b):
        return a * 2 + b.sum()
    base = torch.randn(6)
    # a and b are two non-view tensors on one storage (b is a detach of a): from_tensor's shared fakes.
    check(f, make=lambda: ((lambda a: (a, a.detach()))(base.clone().requires_grad_()), {}))


def test_parameters_that_already_have_grads():
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    m(x).sum().backward()       # .grad set before capture, as in a training loop that recompiles
    before = [p.grad.clone() for p in m.parameters()]
    step = aotgrad.capture(m, x).compile()
    step(x).sum().backward()
    for p, g in zip(m.parameters(), before):
        assert torch.allclose(p.grad, 2 * g)     # accumulated onto the grads that were there
