"""The cudagraphs backend on a real GPU (CUDAGraph, side stream, shared pool).
Skipped without CUDA; the same logic runs on CPU in test_cudagraphs.py."""
import copy

import pytest
import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg
from aotgrad.backends.cudagraphs.runners import CudaRunner
from examples import models
from tests.eager_check import check, check_training

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda(make):
    def made():
        model, args = make()
        return model.cuda(), tuple(a.cuda() for a in args)
    return made


def test_uses_the_cuda_runner_and_replays():
    backend = cg.configure(warmup=1)
    model, args = _cuda(models.make_mlp)()
    check(model, args, calls=4, fw_compiler=backend,
          make=lambda: (copy.deepcopy(model), args, {}))
    bw = backend.last_compiled()
    (rec,) = bw.recordings.values()
    assert isinstance(rec.runner, CudaRunner)


def test_gpt_trains_like_eager_with_dropout():
    backend = cg.configure(warmup=1)
    check_training(_cuda(lambda: models.make_gpt_tiny(batch=2, dropout=0.1)), steps=4,
                   fw_compiler=backend,
                   batches=lambda step: [t.cuda() for t in
                                         models.gpt_batch(models.GPT_TINY, batch=2, seed=100 + step)],
                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), rtol=1e-4, atol=1e-4)


def test_cnn_batchnorm_running_stats():
    check_training(_cuda(lambda: models.make_cnn(batch=4)), steps=4, fw_compiler="cudagraphs",
                   batches=lambda step: [t.cuda() for t in models.cnn_batch(batch=4, seed=100 + step)],
                   rtol=1e-4, atol=1e-4)


def test_stale_saved_tensor_raises():
    model, args = _cuda(models.make_mlp)()
    compiled = aotgrad.capture(model, *args).compile(fw_compiler=cg.configure(warmup=0))
    compiled(*args).backward()
    first, second = compiled(*args), compiled(*args)
    second.backward()
    with pytest.raises(cg.StaleOutputError):
        first.backward()
