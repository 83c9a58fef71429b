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


def test_two_forwards_before_the_backwards_match_eager():
    model, args = _cuda(models.make_mlp)()
    compiled = aotgrad.capture(model, *args).compile(fw_compiler=cg.configure(warmup=0))
    compiled(*args).backward()
    model.zero_grad()
    xs = [torch.randn_like(args[0]) for _ in range(2)]
    first, second = compiled(xs[0], args[1]), compiled(xs[1], args[1])
    second.backward()
    first.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for x in xs:
        model(x, args[1]).backward()
    for g, want in zip(got, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)


def test_a_replay_of_another_shape_does_not_overwrite_saved_tensors():
    """Shapes recorded in one pool: a later capture may sit in an earlier one's freed temporaries."""
    w = torch.randn(64, 64, device="cuda", requires_grad=True)

    def f(x, w):
        return (x @ w).tanh().exp().sum()
    compiled = aotgrad.capture(f, torch.randn(32, 64, device="cuda"), w,
                               dynamic=True).compile(fw_compiler=cg.configure(warmup=0))
    xs = [torch.randn(n, 64, device="cuda") for n in (32, 48, 32, 48)]
    for x in xs[:2]:
        compiled(x, w).backward()       # record both shapes, forward and backward
    w.grad = None
    losses = [compiled(x, w) for x in xs]           # four forwards, then the backwards
    for loss in reversed(losses):
        loss.backward()
    got, w.grad = w.grad, None
    for x in xs:
        f(x, w).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-4, atol=1e-4)


@torch.library.custom_op("aotgrad_test::scaled_by_its_max", mutates_args=())
def _scaled_by_its_max(x: torch.Tensor) -> torch.Tensor:
    return x / float(x.abs().max())         # a host sync: no CUDA graph can capture it


@_scaled_by_its_max.register_fake
def _(x):
    return torch.empty_like(x)


_scaled_by_its_max.register_autograd(lambda ctx, g: g * ctx.scale,
                                     setup_context=lambda ctx, inputs, output: setattr(
                                         ctx, "scale", 1 / inputs[0].detach().abs().max()))


def test_a_capture_that_fails_runs_without_graphs_and_leaves_cuda_usable():
    """An op that syncs inside a graph aotgrad takes for capturable fails its capture: that shape
    runs without CUDA graphs (a warning names the op's error), the numbers and the random stream are
    eager's, and the process is left usable: the current stream is the caller's, and eager draws
    do not raise "Offset increment outside graph capture" (the failed capture's generator state)."""
    def f(x):
        return torch.nn.functional.dropout(_scaled_by_its_max(x.sin()), 0.5) * 2
    before = torch.cuda.current_stream()
    with pytest.warns(UserWarning, match="could not be recorded"):
        check(f, (torch.randn(64, device="cuda", requires_grad=True),), calls=3,
              fw_compiler=cg.configure(warmup=0), rtol=1e-6, atol=1e-6)
    assert torch.cuda.current_stream() == before
    torch.rand(4, device="cuda")
