"""The usage family of tests/differential/usage.py (outputs kept across calls, writes between
forward and backward, two forwards before one backward, retain_graph twice, gradients kept across
steps) on a real GPU: CUDA graphs recorded into one pool per compiled function, replays writing
the recorded memory. Skipped without CUDA; the same family runs on CPU through the null runner."""
import pytest
import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg
from tests.differential.test_usage import KNOWN
from tests.differential.usage import KINDS, USAGES
from tests.eager_check import check_usage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_cuda(make):
    def made():
        fn, args, kwargs = make()
        if isinstance(fn, torch.nn.Module):
            fn = fn.cuda()
        args = tuple(a.detach().cuda().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in args)
        return fn, args, kwargs
    return made


def _compile(warmup, runner="cuda"):
    def compile(fn, args, kwargs):
        backend = cg.configure(warmup=warmup, runner=runner)
        return aotgrad.capture(fn, *args, **kwargs).compile(fw_compiler=backend)
    return compile


def _params():
    for warmup in (0, 1):
        for k in KINDS:
            for u in USAGES:
                marks = [pytest.mark.xfail(reason=KNOWN[k, u])] if (k, u) in KNOWN else []
                yield pytest.param(warmup, k, u, marks=marks, id=f"{k}-{u}-warmup{warmup}")


@pytest.mark.parametrize("warmup,kind,pattern", list(_params()))
def test_usage_matches_eager_on_cuda(warmup, kind, pattern):
    check_usage(_on_cuda(KINDS[kind]), USAGES[pattern], compile=_compile(warmup), rtol=1e-5, atol=1e-5)
