"""The comparisons themselves: each deliberately wrong "compiler" below must be caught by
``check`` or ``refusal_guard`` (a comparison that cannot fail tests nothing)."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from aotgrad.errors import UnsupportedError
from tests.eager_check import assert_refused, check, refusal_guard


def wrong(transform):
    """A compile that runs the program eagerly and then spoils its result with ``transform``."""
    def compile(fn, args, kwargs):
        return lambda *a, **k: transform(fn(*a, **k), a)
    return compile


def x_rg():
    return torch.randn(4, 3, requires_grad=True)


def _same_storage_not_a_view(out, a):
    return torch.empty(0).set_(out.untyped_storage(), out.storage_offset(), out.shape, out.stride())


@pytest.mark.parametrize("fn,transform,rg,message", [
    (lambda x: x[1], lambda out, a: out.clone(), True, "alias"),
    (lambda x: x[1], _same_storage_not_a_view, False, "is view"),
    (lambda x: x.t(), lambda out, a: out.contiguous(), True, "strides"),
    (lambda x: x * 2, lambda out, a: out.detach(), True, "requires_grad"),
    (lambda x: x * 2, lambda out, a: out.detach().requires_grad_(), True, "is_leaf"),
    (lambda x: x * 2, lambda out, a: (torch.rand(()), out)[1], True, "RNG"),
    (lambda x: x * 2, lambda out, a: (a[0].data.add_(1), out)[1], True, "input tensor 0 after call"),
    (lambda x: x + 0, lambda out, a: a[0], False, "alias"),
], ids=["copy for a view", "storage shared but not a view", "strides", "requires_grad", "is_leaf", "rng",
        "input mutation", "input returned"])
def test_each_difference_is_caught(fn, transform, rg, message):
    with pytest.raises(AssertionError, match=message):
        check(fn, (torch.randn(4, 3, requires_grad=rg),), compile=wrong(transform))


def test_a_retained_grad_that_goes_missing_is_caught():
    def f(x):
        y = x.sin()
        y.retain_grad()
        return y

    def forgets(out, a):
        return a[0].sin()
    with pytest.raises(AssertionError, match="retained grad"):
        check(f, (x_rg(),), compile=wrong(forgets))


def test_a_backward_that_draws_randomness_is_caught():
    class Noisy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g + 0 * torch.rand_like(g)
    with pytest.raises(AssertionError, match="after the backward"):
        check(lambda x: x * 2, (x_rg(),), compile=wrong(lambda out, a: Noisy.apply(out)))


def test_a_double_backward_that_drops_second_order_terms_is_caught():
    class FirstOrderOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.pow(3)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 3 * x.detach() ** 2     # detached: no second-order term

    def compile(fn, args, kwargs):
        return lambda x: FirstOrderOnly.apply(x)
    with pytest.raises(AssertionError, match="grad"):
        check(lambda x: x.pow(3), (x_rg(),), compile=compile, double_backward=True)


def _refusing(spoil):
    def compile(fn, args, kwargs):
        spoil(fn, args)
        raise UnsupportedError("refused")
    return compile


@pytest.mark.parametrize("spoil,message", [
    (lambda m, a: m.weight.data.mul_(2), "param weight"),
    (lambda m, a: a[0].data.zero_(), "input tensor 0"),
    (lambda m, a: torch.rand(()), "RNG"),
    (lambda m, a: setattr(m, "weight", nn.Parameter(m.weight.detach().clone())), "replaced"),
    (lambda m, a: setattr(m, "cache", FakeTensorMode().from_tensor(torch.randn(2))), "tracing tensors"),
], ids=["parameter", "input", "rng", "replaced parameter", "fake tensor left"])
def test_an_unclean_refusal_is_caught(spoil, message):
    with pytest.raises(AssertionError, match=message):
        refusal_guard(_refusing(spoil))(nn.Linear(3, 3), (torch.randn(2, 3),), {})


def test_a_clean_refusal_is_returned():
    e = assert_refused(nn.Linear(3, 3), (torch.randn(2, 3),), compile=_refusing(lambda m, a: None))
    assert isinstance(e, UnsupportedError)


def test_a_call_that_succeeds_is_not_a_refusal():
    with pytest.raises(AssertionError, match="succeeded"):
        assert_refused(lambda x: x * 2, (torch.randn(3),))
