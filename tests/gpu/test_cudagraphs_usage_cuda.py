"""The usage family of tests/differential/usage.py (outputs kept across calls, writes between
forward and backward to inputs, parameters, buffers and views of them, two and three forwards
before the backwards in every order, retain_graph, a no_grad call between, other batch sizes
recorded in one pool) on a real GPU: CUDA graphs recorded into one pool per compiled function,
replays writing the recorded memory. Through ``capture`` (static, or ``dynamic=True`` for the
patterns that change the batch size) for every kind, and through ``aotgrad.jit`` and
``torch.compile`` for a few. Skipped without CUDA; the same family runs on CPU through the null
runner (tests/differential/test_usage.py)."""
import pytest
import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg
from tests.differential.test_usage import KNOWN, OTHER_GRAD_MODE
from tests.differential.usage import KINDS, RESHAPING, USAGES
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


def _compile(entry, warmup, dynamic):
    options = {"fw_compiler": "cudagraphs", "cudagraphs": {"warmup": warmup, "runner": "cuda"}}

    def compile(fn, args, kwargs):
        if entry == "jit":
            return aotgrad.jit(fn, **options)
        if entry == "dynamo":
            torch._dynamo.reset()
            return torch.compile(fn, backend=aotgrad.backend(**options))
        return aotgrad.capture(fn, *args, dynamic=dynamic, **kwargs).compile(**options)
    return compile


# Kinds also run through jit and torch.compile: a module, an input returned, a host sync between segments.
FRONTEND_KINDS = ("saved_exp", "input_returned", "split_by_a_host_sync", "buffers_updated_in_place")


def _params():
    for entry in ("capture", "jit", "dynamo"):
        for warmup in (0, 1) if entry == "capture" else (0,):
            for k in KINDS if entry == "capture" else FRONTEND_KINDS:
                for u in USAGES:
                    if entry == "capture" and u in OTHER_GRAD_MODE:
                        continue        # a captured step runs under its grad mode only (test_usage's rule)
                    marks = [pytest.mark.xfail(reason=KNOWN[k, u])] if (k, u) in KNOWN else []
                    yield pytest.param(entry, warmup, k, u, marks=marks, id=f"{k}-{u}-{entry}-warmup{warmup}")


@pytest.mark.parametrize("entry,warmup,kind,pattern", list(_params()))
def test_usage_matches_eager_on_cuda(entry, warmup, kind, pattern):
    compile = _compile(entry, warmup, dynamic=pattern in RESHAPING)
    check_usage(_on_cuda(KINDS[kind]), USAGES[pattern], compile=compile, rtol=1e-5, atol=1e-5)
