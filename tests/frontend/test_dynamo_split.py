"""The Dynamo backend lets Dynamo split its graph where torch's own backends would: a refusal caused by
an exception Dynamo falls back on (a data-dependent output shape) re-raises that exception; any other
refusal stays a typed error (Dynamo wraps it in BackendCompilerFailed)."""
import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import aotgrad
from aotgrad import errors
from aotgrad.frontend.dynamo import _splittable
from tests.eager_check import check


def _refusal_from(cause):
    def trace():
        try:
            raise cause
        except Exception as e:
            raise errors.DataDependentError("refused") from e
    return trace


def test_a_dynamic_output_shape_refusal_re_raises_torch_s_exception():
    with pytest.raises(DynamicOutputShapeException):
        _splittable(_refusal_from(DynamicOutputShapeException(torch.ops.aten.nonzero.default)))


def test_other_refusals_stay_typed():
    # GuardOnDataDependentSymNode is not one Dynamo falls back on (aot_eager fails the compile too)
    with pytest.raises(errors.DataDependentError):
        _splittable(_refusal_from(GuardOnDataDependentSymNode("u0 > 0")))
    with pytest.raises(errors.MutationError):
        _splittable(lambda: (_ for _ in ()).throw(errors.MutationError("set_()")))


def test_masked_embed_trains_like_eager_under_torch_compile():
    def f(h, w, mask, embed):
        h = h * w
        h[mask] = embed
        return (h.sin() * 2).sum()

    def make():
        return (torch.randn(4, 5, 3), torch.randn(3, requires_grad=True), torch.rand(4, 5) > 0.5,
                torch.randn(3, requires_grad=True)), {}

    def compile(fn, args, kwargs):
        torch._dynamo.reset()
        return torch.compile(fn, backend="aotgrad")
    check(f, make=make, compile=compile)
