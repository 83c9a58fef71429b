"""Inputs a trace through plain fake tensors cannot stand for: tensor subclasses (TwoTensor and the
other subclasses of ``torch.testing._internal``), nested tensors, freed storages. Each is refused with
a typed error naming the user's line before anything runs, at every entry point, or behaves like
eager; none may crash the process (the differential family is ``tests/differential/p_aotdispatch.py``)."""
import pytest
import torch
from torch import nn

import aotgrad
from aotgrad.errors import UnsupportedError
from tests.differential.entries import ENTRIES
from tests.eager_check import assert_close, assert_refused, check


class Tagged(torch.Tensor):
    """A ``__torch_function__`` subclass: every op's result is a Tagged again."""


def _two(rg=True):
    from torch.testing._internal.two_tensor import TwoTensor
    return TwoTensor(torch.randn(3, 3), torch.randn(3, 3)).requires_grad_(rg)


def _logging():
    from torch.testing._internal.logging_tensor import LoggingTensor
    return LoggingTensor(torch.randn(3, 3))


def _wrapper():
    from torch.testing._internal.subclasses import WrapperSubclass
    return WrapperSubclass(torch.randn(3, 3, requires_grad=True))


# TwoTensor and WrapperSubclass (traceable wrapper subclasses) are traced now: tests/core/test_subclasses.py;
# jagged nested tensors too: tests/core/test_subclass_nested.py.
SUBCLASS_INPUTS = {"LoggingTensor": _logging,
                   "torch_function subclass": lambda: torch.randn(3, 3).as_subclass(Tagged)}


@pytest.mark.parametrize("entry", ["capture", "jit", "dynamo"])
@pytest.mark.parametrize("kind", list(SUBCLASS_INPUTS))
def test_subclass_input_beside_a_plain_one_is_refused_with_the_call_line(entry, kind):
    if (entry, kind) == ("dynamo", "LoggingTensor"):
        pytest.skip("Dynamo does not trace a subclass without __tensor_flatten__: it runs the frame eagerly")
    def make():
        torch.manual_seed(0)
        return (lambda a, b: (a * 2).sum() + b.sum()), (SUBCLASS_INPUTS[kind](), torch.randn(3, requires_grad=True)), {}
    torch._dynamo.reset()
    e = assert_refused(None, make=make, compile=ENTRIES[entry].compile)
    assert isinstance(e, UnsupportedError), e
    assert e.user_line, e       # the call that passed it
    assert "subclass" in str(e)


@pytest.mark.parametrize("entry", ["capture", "jit", "dynamo"])
def test_wrapper_subclass_input_beside_a_plain_one_trains_like_eager(entry):
    """The plain one's eager .grad is a WrapperSubclass (it met one): it comes back as one."""
    def make():
        torch.manual_seed(0)
        return (lambda a, b: (a * 2).sum() + b.sum()), (_wrapper(), torch.randn(3, requires_grad=True)), {}
    torch._dynamo.reset()
    check(None, make=make, compile=ENTRIES[entry].compile)


def test_subclass_parameter_and_a_plain_bias_beside_it_train_like_eager():
    def make(bias):
        m = nn.Linear(3, 3, bias=bias)
        m.weight = nn.Parameter(_two(rg=False))
        return m, (torch.randn(2, 3),), {}
    check(None, make=lambda: make(False))
    check(None, make=lambda: make(True))    # eager's bias.grad is a TwoTensor (the gradient met the weight's)


def test_subclass_made_inside_the_function_runs_like_eager():
    from torch.testing._internal.two_tensor import TwoTensor

    def f(x, y):
        return (TwoTensor(x, y) * 2).a.sum()
    check(f, (torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)))


def test_untraceable_subclass_made_inside_is_refused_at_its_line():
    from torch.testing._internal.logging_tensor import LoggingTensor

    def f(x):
        return (LoggingTensor(x) * 2).elem.sum()
    e = assert_refused(f, (torch.randn(3),))
    assert "LoggingTensor" in str(e) and "__tensor_flatten__" in str(e)


def test_parameter_subclasses_and_plain_tensors_are_not_refused():
    class MyParam(nn.Parameter):
        pass
    m = nn.Linear(3, 3)
    m.weight = MyParam(torch.randn(3, 3))
    check(m, (torch.randn(2, 3),))


def test_resizing_a_traced_storage_is_refused_at_its_line():
    def f(a):
        out = a.sin()
        out.untyped_storage().resize_(0)    # an intermediate's (an input's is replayed: p_storage.py)
        return out
    e = assert_refused(f, (torch.randn(8),))
    assert "storage" in str(e) and "resize_(0)" in e.user_line


def test_an_input_whose_storage_was_freed_compiles_when_unread():
    def make():
        x = torch.zeros(8)
        x.untyped_storage().resize_(0)
        return (lambda a, b: b * 2), (x, torch.randn(8, requires_grad=True)), {}
    check(None, make=make)


def test_freed_storages_compare_by_size_without_reading_them():
    a, b = torch.zeros(8), torch.zeros(8)
    a.untyped_storage().resize_(0)
    b.untyped_storage().resize_(0)
    assert_close(a, b, "freed", 0, 0)
    with pytest.raises(AssertionError, match="storage of 0 vs 32 bytes"):
        assert_close(a, torch.zeros(8), "freed", 0, 0)


def test_compiled_autograd_refuses_a_nested_backward_before_running_it():
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged,
                                    requires_grad=True)
    with pytest.raises(UnsupportedError, match="NestedTensor") as info:
        with aotgrad.compiled_autograd("eager"):
            (nt.sin() * 2).values().sum().backward()
    assert "test_subclass_inputs.py" in info.value.user_line
    assert nt.grad is None
