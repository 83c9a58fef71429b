"""Fake copies of a capture's inputs made from meta tensors (aotgrad._torch.plain_fake): the
graph must be what ``FakeTensorMode.from_tensor`` copies give, for every input that path takes and
for the ones it leaves to from_tensor (shared storages, views, grads already present). Fake tensors
made without FakeTensor's constructor (aotgrad._torch.fresh_fakes) must be the ones it makes."""
import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad import _torch
from aotgrad._torch import FakeTensor, FakeTensorMode, fresh_fakes, plain_fake
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


@pytest.mark.parametrize("unsafe", [True, False])
def test_fresh_fakes_are_what_the_constructor_makes(unsafe):
    """The fast path copies a proven prototype's state: every attribute, the dispatch keys, the data
    pointer policy and what ops on it give must be the constructor's; a meta device, FakeTensor's
    debug mode and a failed proof take the constructor itself."""
    mode = FakeTensorMode()
    mode._allow_unsafe_data_ptr_access = unsafe
    cpu = torch.device("cpu")
    fast, = fresh_fakes(mode, [((3, 5), (1, 3), torch.float16, cpu)])
    ref = FakeTensor(mode, torch.empty_strided((3, 5), (1, 3), dtype=torch.float16, device="meta"), cpu)
    assert _torch._FAKE_STATES[mode][cpu] is not None        # the fast path was taken
    assert type(fast) is FakeTensor and fast.fake_mode is mode and fast.__dict__.keys() == ref.__dict__.keys()
    assert all(fast.__dict__[k] is v or fast.__dict__[k] == v for k, v in ref.__dict__.items())
    assert torch._C._dispatch_keys(fast) == torch._C._dispatch_keys(ref)
    assert (fast.shape, fast.stride(), fast.dtype, fast.device, fast.requires_grad) == \
        (ref.shape, ref.stride(), ref.dtype, ref.device, ref.requires_grad)
    with mode:
        out, expect = (fast.float() @ fast.float().t()).relu_(), (ref.float() @ ref.float().t()).relu_()
    assert (type(out), out.shape, out.stride(), out.device) == (type(expect), expect.shape, expect.stride(), expect.device)
    assert fast.nonzero_memo is None and fast.item_memo is None
    with pytest.warns(UserWarning) if unsafe else pytest.raises(RuntimeError):
        fast.untyped_storage().data_ptr()
    meta, = fresh_fakes(mode, [((2,), (1,), torch.float32, torch.device("meta"))])      # the constructor's
    assert meta.device.type == "meta" and _torch._FAKE_STATES[mode][torch.device("meta")] is None


def test_fresh_fakes_fall_back_where_the_proof_fails(monkeypatch):
    mode = FakeTensorMode()
    cpu = torch.device("cpu")
    monkeypatch.setattr(_torch, "_made_fake", lambda meta, state, unsafe: torch.Tensor._make_subclass(
        FakeTensor, meta, False, dispatch_device=True, device_for_backend_keys=state[0]))   # no state copied
    fake, = fresh_fakes(mode, [((2, 2), (2, 1), torch.float32, cpu)])
    assert _torch._FAKE_STATES[mode][cpu] is None and fake.fake_mode is mode
    monkeypatch.undo()
    monkeypatch.setattr(_torch.FakeTensorConfig, "debug", True)     # the constructor's traceback then
    a, b = fresh_fakes(FakeTensorMode(), [((2,), (1,), torch.float32, cpu)] * 2)
    assert a._debug_trace is not b._debug_trace         # each its own, not a prototype's copied


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
