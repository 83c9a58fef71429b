"""What every benchmark shares: the systems under comparison and a timer.

A *system* turns a model whose ``forward`` returns the loss, and example
args, into a training step ``step(*args) -> loss`` that uses the model's live
parameters.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def eager(model: torch.nn.Module, args=()) -> Callable:
    return model


def torch_aot(model: torch.nn.Module, args=()) -> Callable:
    """PyTorch's own AOT autograd with no-op compilers: the reference we beat.

    Goes through ``aot_function`` over ``functional_call`` rather than
    ``aot_module`` because ``aot_module`` rejects tied weights (GPT's
    embedding/lm_head). ``functional_call`` runs only while tracing; each call
    afterwards just passes the parameter list.
    """
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function

    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    state = [*model.parameters(), *model.buffers()]

    def flat_step(state, *args):
        return torch.func.functional_call(model, dict(zip(names, state)), args)

    compiled = aot_function(flat_step, fw_compiler=nop, bw_compiler=nop)
    return lambda *args: compiled(state, *args)


def aotgrad_eager(model: torch.nn.Module, args=()) -> Callable:
    import aotgrad

    return aotgrad.capture(model, *args).compile(fw_compiler="eager")


# aotgrad captures when the step is made, so every system is handed the
# example args; the others trace lazily on the first call.
SYSTEMS = {"eager": eager, "torch_aot": torch_aot, "aotgrad": aotgrad_eager}


def train_once(step: Callable, args) -> float:
    loss = step(*args)
    loss.backward()
    return loss.item()


def per_call_us(fn: Callable, *, iters: int, repeats: int, warmup: int = 20) -> float:
    """Median over ``repeats`` of the mean time per call in a loop of ``iters``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)
