"""The entry points a program is compiled through, each as a ``compile(fn, args, kwargs) -> callable``
the way ``tests.eager_check.check`` takes it, plus the input variants it is called with.

``variants`` name the calls one compiled callable gets, each on fresh inputs compared with
eager: ``base`` (the program's own inputs), ``stride`` (every leaf input of two or more
dimensions stored transposed), ``offset`` (every leaf input at a storage offset), ``size``
(the program rebuilt with ``n + 2``). A variant that changes nothing for a program is left out.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg


@dataclass(frozen=True)
class Entry:
    name: str
    compile: Callable
    variants: tuple = ("base",)
    backward_context: Callable = contextlib.nullcontext
    reset: Callable = lambda: None
    tol: tuple = (0.0, 0.0)     # the least (rtol, atol) float values are compared with (a fusing compiler's)


def _capture(**compile_options):
    def compile(fn, args, kwargs):
        captured = aotgrad.capture(fn, *args, **kwargs)
        aotgrad.verify(captured)
        return captured.compile(**compile_options)
    return compile


def _jit(fn, args, kwargs):
    return aotgrad.jit(fn)


def _dynamo(fn, args, kwargs):
    compiled = torch.compile(fn, backend="aotgrad")

    def call(*a, **k):      # Dynamo wraps a backend's refusal: the typed error is its inner exception
        try:
            return compiled(*a, **k)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, aotgrad.errors.AotgradError):
                raise e.inner_exception from e
            raise
    return call


def _as_is(fn, args, kwargs):
    return fn


def _reset_dynamo():
    torch._dynamo.reset()


def _reset_compiled_autograd():
    from aotgrad.compiled_autograd import reset
    reset()


ENTRIES = {e.name: e for e in (
    Entry("capture", _capture()),
    Entry("capture_cudagraphs", _capture(fw_compiler=cg.configure(warmup=0))),
    # Inductor fuses and reorders float arithmetic: values within a tolerance; masks, integers,
    # metadata and the RNG stay exact.
    Entry("inductor", _capture(fw_compiler="inductor"), tol=(1e-4, 1e-4)),
    Entry("min_cut", _capture(partitioner="min_cut")),
    Entry("budget", _capture(memory_budget=0.5)),
    Entry("jit", _jit, ("base", "stride", "offset", "size")),
    Entry("dynamo", _dynamo, ("base", "offset"), reset=_reset_dynamo),
    Entry("compiled_autograd", _as_is, backward_context=lambda: aotgrad.compiled_autograd("eager"),
          reset=_reset_compiled_autograd),
)}
