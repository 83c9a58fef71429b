"""A non-leaf input written in place by every call: each backward passes through the earlier
calls' graphs too (the input's history grows), as in eager. A compiled step whose backward saves
nothing runs again when autograd reaches it again; one that saves tensors raises eager's own
"backward through the graph a second time" error, as eager does."""
import pytest
import torch

import aotgrad


def _add(a):
    a.add_(1)
    return a.view(-1)


def _mul(a, w):
    a.mul_(w)
    return a.view(-1)


def _steps(step, *extra, calls=2):
    torch.manual_seed(0)
    leaf = torch.randn(4, 3, requires_grad=True)
    a = leaf.add(0)
    for _ in range(calls):
        step(a, *extra).sum().backward()
    return leaf.grad, a.detach()


def _entries(fn, *extra):
    torch.manual_seed(0)
    example = torch.randn(4, 3, requires_grad=True).add(0)
    return {"capture": aotgrad.capture(fn, example, *extra).compile(), "jit": aotgrad.jit(fn)}


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_backward_through_an_earlier_call_that_saved_nothing(entry):
    want_grad, want_a = _steps(_add)
    got_grad, got_a = _steps(_entries(_add)[entry])
    torch.testing.assert_close(got_grad, want_grad)
    torch.testing.assert_close(got_a, want_a)


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_backward_through_an_earlier_call_that_saved_tensors_raises_as_eager(entry):
    w = torch.full((4, 3), 2.0, requires_grad=True)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _steps(_mul, w)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _steps(_entries(_mul, w)[entry], w)
