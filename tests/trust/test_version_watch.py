"""Eager autograd checks the version counter of every tensor it saved: an input written in place
between the forward and the backward raises "one of the variables needed for gradient computation
has been modified by an inplace operation". A compiled forward that saves the functional value of
an input the program wrote, instead of the input, would miss that write; ``version_checks`` watches
the inputs eager saves and the compiled forward does not save as themselves. Twins: the same write
where eager saves the input (raises) and where it does not (no error), written by the user, through a
view, or by a second call; and a write eager does not count (batch norm's statistics), which must not
raise where eager does not. Each compared with eager through ``check_usage``."""
import pytest
import torch
import torch.nn as nn

import aotgrad
from tests.eager_check import check_usage

COMPILERS = {"capture": lambda fn, args, kwargs: aotgrad.capture(fn, *args, **kwargs).compile(),
             "jit": lambda fn, args, kwargs: aotgrad.jit(fn),
             "dynamo": lambda fn, args, kwargs: torch.compile(fn, backend="aotgrad")}


def saves_written_input(x, w):
    x.mul_(2)
    return (x * w).sum()            # mul saves x, as written: eager checks x's version at backward


def writes_unsaved_input(x, w):
    x.mul_(2)
    return (w * 3).sum() + x.sum()  # nothing saves x: a later write is harmless in eager


def saves_input_read_only(x, w):
    return (x * w).sum()


def _make(fn):
    def make():
        return fn, (torch.randn(5), torch.randn(5, requires_grad=True)), {}
    return make


def _write_then_backward(call, fn, args, kwargs):
    x, w = args
    loss = call(x, w)
    x.add_(1)
    loss.backward()
    return loss, w.grad


def _view_write_then_backward(call, fn, args, kwargs):
    x, w = args
    loss = call(x, w)
    x[1:3].zero_()
    loss.backward()
    return loss, w.grad


def _second_call_then_first_backward(call, fn, args, kwargs):
    x, w = args
    first = call(x, w)
    second = call(x, w)            # writes x again: the first backward sees a newer x
    first.backward()
    second.backward()
    return first, second, w.grad


USAGES = {"user_write": _write_then_backward, "view_write": _view_write_then_backward,
          "second_call": _second_call_then_first_backward}


@pytest.mark.parametrize("compiler", sorted(COMPILERS))
@pytest.mark.parametrize("usage", sorted(USAGES))
@pytest.mark.parametrize("program", [saves_written_input, writes_unsaved_input, saves_input_read_only],
                         ids=lambda f: f.__name__)
def test_writes_before_backward_raise_exactly_where_eager_raises(program, usage, compiler):
    torch._dynamo.reset()
    check_usage(_make(program), USAGES[usage], compile=COMPILERS[compiler])


def _bn_two_forwards(call, fn, args, kwargs):
    (x,) = args
    a = call(x).sum()
    b = call(x * 2).sum()           # updates the running statistics again: eager does not bump them
    a.backward()
    b.backward()
    return a, b


@pytest.mark.parametrize("compiler", sorted(COMPILERS))
def test_a_write_eager_does_not_count_does_not_raise(compiler):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), (torch.randn(4, 3, requires_grad=True),), {}
    torch._dynamo.reset()
    check_usage(make, _bn_two_forwards, compile=COMPILERS[compiler])


def test_the_compiled_error_names_eager_s_cause():
    x, w = torch.randn(5), torch.randn(5, requires_grad=True)
    loss = aotgrad.jit(saves_written_input)(x, w)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*an input of the compiled function"):
        loss.backward()
