"""Batch norm's fake kernel keeps a non-contiguous input's layout where its real kernels lay the
result out as ``input.suggest_memory_format()`` says: the traces follow the real kernels, so what is
traced after the norm (a linear's backward viewing the gradient, a reshape, an ``as_strided``, the
output's own layout) is what eager does, under every entry point. The differential family is
``layout_batchnorm_*`` in ``tests/differential/p_layouts.py``."""
import pytest
import torch

import aotgrad
from aotgrad import errors
from tests.differential.p_layouts import _NormBlocks, _SeqNorm
from tests.eager_check import as_is, check

TAILS = ("linear", "reshape", "as_strided", "output")


def _jit(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("dynamic", (False, True))
def test_sequence_norm_matches_eager(tail, dynamic):
    torch.manual_seed(0)
    check(_SeqNorm(tail), (torch.randn(4, 5, 8, requires_grad=True),), calls=2, dynamic=dynamic)


@pytest.mark.parametrize("tail", ("linear", "output"))
def test_sequence_norm_under_jit_and_compiled_autograd(tail):
    torch.manual_seed(0)
    check(_SeqNorm(tail), (torch.randn(4, 5, 8, requires_grad=True),), compile=_jit, calls=2)
    check(_SeqNorm(tail), (torch.randn(4, 5, 8, requires_grad=True),), compile=as_is,
          backward_context=lambda: aotgrad.compiled_autograd())


def test_repeated_norm_blocks_match_eager():
    torch.manual_seed(0)
    check(_NormBlocks(), (torch.randn(4, 5, 8, requires_grad=True),), calls=2)


def test_a_view_eager_refuses_is_refused_at_capture():
    """``.view`` of the transposed result: eager raises, the capture refuses (before, the fake layout
    made the view look valid and the compiled graph failed as it ran)."""
    m, x = _SeqNorm("view"), torch.randn(4, 5, 8)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        m(x)
    with pytest.raises(errors.AotgradError, match="view"):
        aotgrad.capture(m, x)


def test_only_a_layout_the_fake_kernel_got_wrong_is_copied():
    """A contiguous input: the fake and real layouts agree, no copy is traced. A channels-last one:
    the forward agrees, the backward (given a contiguous gradient) is laid out channels-last by the
    real kernel, contiguous by the fake one: one copy."""
    def clones(m, x):
        return sum(n.target is torch.ops.aten.clone.default for n in aotgrad.capture(m, x).joint.graph.nodes)
    bn = torch.nn.BatchNorm2d(4)
    assert clones(bn, torch.randn(2, 4, 3, 3, requires_grad=True)) == 0
    assert clones(bn, torch.randn(2, 4, 3, 3, requires_grad=True).to(memory_format=torch.channels_last)) == 1
    assert clones(_SeqNorm("output"), torch.randn(4, 5, 8, requires_grad=True)) == 2      # forward, backward


def test_compiled_autograds_layout_mode_lets_higher_order_operators_through():
    """The mode compiled autograd's trace gained passes a higher order operator to the modes below
    (without it, torch refuses any HOP under a mode with no rule for it)."""
    from torch._higher_order_ops.cond import cond
    from aotgrad.compiled_autograd.capture import _KernelLayouts
    x = torch.randn(3)
    with _KernelLayouts():
        got = cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))
    torch.testing.assert_close(got, x + 1 if x.sum() > 0 else x - 1, rtol=0, atol=0)
