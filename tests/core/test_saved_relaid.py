"""An input whose layout or storage the epilogue changes (``t_()``, ``transpose_()``, ``unsqueeze_()``,
``as_strided_()``, ``set_()`` replayed on the caller's tensor) and that the backward reads. (Reading it
before the change and backwarding after raises in eager: the change bumps its version.)

The graph computes with the input as it came in; the epilogue then changes the caller's tensor. Where the
forward saves that input itself (the view fold turns the backward's ``t(t(x))`` into ``x``; a min-cut
partition may save ``x`` to recompute its view), the backward must read it as the graph had it: an alias
taken before the epilogue, sharing its version counter. Saving the caller's tensor made the backward see
the new layout (``mm`` of 4x3 by 4x2). Each program x partitioner x entry point, against eager."""
import pytest
import torch

import aotgrad
from tests.eager_check import check, default_compile


def _t(x, w):
    x.t_()
    return x @ w


def _transpose(x, w):
    x.transpose_(0, 1)
    return (x @ w).relu(), x.sum(0)


def _unsqueeze(x, w):
    x.unsqueeze_(0)
    return (x * w).sum(1)


def _as_strided(x, w):
    x.as_strided_((x.shape[1], x.shape[0]), (1, x.shape[1]))
    return x @ w


def _set(x, w, y):
    x.set_(y)               # the caller's x is pointed at y's storage; the backward reads y's values
    return x @ w


PROGRAMS = {
    "t_": (_t, lambda: (torch.randn(3, 4), torch.randn(3, 2, requires_grad=True))),
    "transpose_": (_transpose, lambda: (torch.randn(4, 3), torch.randn(4, 2, requires_grad=True))),
    "unsqueeze_": (_unsqueeze, lambda: (torch.randn(4, 3), torch.randn(1, 4, 3, requires_grad=True))),
    "as_strided_": (_as_strided, lambda: (torch.randn(3, 4), torch.randn(3, 2, requires_grad=True))),
    "set_": (_set, lambda: (torch.randn(4, 3), torch.randn(3, 2, requires_grad=True), torch.randn(4, 3))),
}


def _jit(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


def _dynamo(fn, args, kwargs, **opts):
    torch._dynamo.reset()
    return torch.compile(fn, backend=aotgrad.backend(**opts))


ENTRIES = {"capture": default_compile, "jit": _jit, "dynamo": _dynamo}


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_saved_input_relaid_by_the_epilogue(name, entry, partitioner):
    fn, make = PROGRAMS[name]
    opts = {} if partitioner == "default" else {"partitioner": partitioner}
    check(fn, make=lambda: (make(), {}), compile=ENTRIES[entry], **opts)
