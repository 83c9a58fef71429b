"""Module attributes a forward rebinds (hook-style ``weight_norm`` / ``spectral_norm``) and reentrant
activation checkpointing, next to eager.

A rebound attribute is a graph output the compiled call binds again after every call
(``runtime.call.Rebound``): the module holds a tensor equal to eager's, whose backward reaches the
parameters; its reads are not guards (switching to ``eval()`` recompiles for ``training``, not for the
attribute). ``checkpoint(..., use_reentrant=True)`` traces as the non-reentrant one: same masks, same RNG
after the forward and the backward, no gradient where eager's reentrant one gives none.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import aotgrad
from aotgrad.errors import UnsupportedError
from tests.eager_check import check

ENTRIES = {
    "capture": None,
    "jit": lambda fn, args, kwargs, **opts: aotgrad.jit(fn),
    "min_cut": lambda fn, args, kwargs, **opts: aotgrad.capture(fn, *args, **kwargs).compile(partitioner="min_cut"),
}


def _normed(kind, module, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (nn.utils.spectral_norm if kind == "spectral" else nn.utils.weight_norm)(module, **kw)


def _twins(make):
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    return a, make()


@pytest.mark.parametrize("kind", ["spectral", "weight"])
def test_attribute_after_each_call_is_eagers(kind):
    eager, model = _twins(lambda: _normed(kind, nn.Linear(5, 3)))
    step = aotgrad.jit(model)
    x = torch.randn(4, 5)
    for mode in ("train", "train", "eval", "eval", "train"):
        eager.train(mode == "train"), model.train(mode == "train")
        torch.testing.assert_close(step(x), eager(x), rtol=0, atol=0)
        torch.testing.assert_close(model.weight, eager.weight, rtol=0, atol=0)
        assert model.weight.requires_grad and model.weight.grad_fn is not None
        for name, b in eager.named_buffers():
            assert torch.equal(b, dict(model.named_buffers())[name]), name
    # the attribute's backward reaches the parameters, as eager's does
    eager.weight.sum().backward(), model.weight.sum().backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        if p.grad is None:      # (the compiled backward gives a zero gradient where eager gives none, as check allows)
            assert q.grad is None or not q.grad.any(), name
        else:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert "2 compiled entries" in str(aotgrad.explain(step))      # train and eval, not one per call


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", ["spectral", "weight"])
def test_trains_like_eager(kind, entry):
    kw = {} if ENTRIES[entry] is None else {"compile": ENTRIES[entry]}
    check(None, make=lambda: (nn.Sequential(_normed(kind, nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 2)),
                              (torch.randn(3, 5, requires_grad=True),), {}), calls=3, **kw)


def test_optimizer_steps_match_eager():
    eager, model = _twins(lambda: _normed("spectral", nn.Linear(5, 3)))
    step = aotgrad.jit(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for i in range(3):
        x = torch.randn(4, 5)
        for m, f, opt in ((eager, eager, opts[0]), (model, step, opts[1])):
            opt.zero_grad()
            f(x).pow(2).sum().backward()
            opt.step()
    for (name, p), q in zip(eager.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(q, p, msg=name)


class _Carry(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.t = nn.Linear(4, 4), torch.ones(4)

    def forward(self, x):
        self.t = self.t * 0.5 + 1       # reads the value the call before bound
        return self.lin(x) * self.t


def test_carried_attribute_is_refused_naming_the_line():
    model = _Carry()
    before = model.t
    with pytest.raises(UnsupportedError, match="rebinds that attribute") as e:
        aotgrad.jit(model)(torch.randn(2, 4))
    assert "self.t = self.t * 0.5 + 1" in str(e.value.user_line)
    assert model.t is before


class _NotTensorBefore(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        self.last = y * 2       # made by the call: no tensor attribute to rebind
        return y


def test_new_attribute_still_refused():
    with pytest.raises(UnsupportedError, match="assigns `last`"):
        aotgrad.capture(_NotTensorBefore(), torch.randn(2, 4))


# --- reentrant checkpointing -----------------------------------------------------------------------

class _Ckpt(nn.Module):
    def __init__(self, preserve=True, p=0.5):
        super().__init__()
        self.a, self.b, self.preserve, self.p = nn.Linear(4, 4), nn.Linear(4, 4), preserve, p

    def block(self, h, scale):
        return F.dropout(self.b(h).relu() * scale, self.p, self.training)

    def forward(self, x):
        h = self.a(x)
        out = checkpoint(self.block, h, 2.0, use_reentrant=True, preserve_rng_state=self.preserve)
        return out.sum() + torch.rand(()) + h.sum()       # a draw after it: the stream's position matters


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("preserve", [True, False])
def test_reentrant_checkpoint_like_eager(entry, preserve):
    kw = {} if ENTRIES[entry] is None else {"compile": ENTRIES[entry]}
    check(None, make=lambda: (_Ckpt(preserve), (torch.randn(3, 4),), {}), calls=2, **kw)


def test_reentrant_checkpoint_without_grad_inputs_gives_no_parameter_grads():
    """Eager's reentrant checkpoint detaches outputs when no tensor argument requires grad: the
    parameters inside get no gradient (it warns); the compiled program does the same."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.out(checkpoint(self.inner, x, use_reentrant=True)).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = check(None, make=lambda: (M(), (torch.randn(3, 4),), {}))
    assert run.fn.inner.weight.grad is None and run.fn.out.weight.grad is not None


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_nested_reentrant_checkpoint(entry, monkeypatch):
    """Nested reentrant checkpoints run as non-reentrant ones in the trace, the inner one in the outer's
    recompute too (the joint's backward, after the forward's patches ended): eager's reentrant Function
    there would save other tensors than the forward did (torch 2.11 refuses: "a different number of
    tensors was saved"). Eager's own run, outside any trace, still takes the reentrant path."""
    from torch.utils import checkpoint as ckpt
    reentrant, real = [], ckpt.CheckpointFunction.forward

    def spied(ctx, run_function, *args):
        reentrant.append(run_function)
        return real(ctx, run_function, *args)
    monkeypatch.setattr(ckpt.CheckpointFunction, "forward", staticmethod(spied))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def inner(self, h):
            return F.dropout(self.l2(h), 0.3, True)

        def outer(self, h):
            return checkpoint(self.inner, self.l1(h).tanh(), use_reentrant=True)

        def forward(self, x):
            return checkpoint(self.outer, x, use_reentrant=True).sum()
    m, x = M(), torch.randn(3, 4, requires_grad=True)
    step = aotgrad.capture(m, x).compile() if entry == "capture" else aotgrad.jit(m)
    step(x).backward()
    assert reentrant == []
    check(None, make=lambda: (M(), (torch.randn(3, 4, requires_grad=True),), {}))
    assert reentrant        # eager's run
