"""The entry points a program is compiled through, each as a ``compile(fn, args, kwargs) -> callable``
the way ``tests.eager_check.check`` takes it, plus the input variants it is called with.

``variants`` name the calls one compiled callable gets, each on fresh inputs compared with
eager: ``base`` (the program's own inputs), ``stride`` (every leaf input of two or more
dimensions stored transposed), ``offset`` (every leaf input at a storage offset), ``size``
(the program rebuilt with ``n + 2``), ``resize`` (with ``n + 3``: a graph that recompiled for the
``size`` call with symbolic sizes must not have specialised them to that call's). A variant that changes nothing for a program is left out. A
``staged`` entry (``capture(dynamic=True)``) may refuse a variant with ``InputMismatchError`` (a baked
constant, a size the trace specialised): that call is then compared as "refused", not as a failure.

``backend`` names the compiler the table reports (``cudagraphs`` runs the null runner on CPU and
records real CUDA graphs on CUDA); ``tol`` is the float tolerance ``(rtol, atol)`` a backend that
reorders arithmetic (Inductor's fused kernels) needs at least. Only floating values take it:
integer and bool outputs, the RNG state and all metadata stay exact (``tests.eager_check``).
``export`` is not a ``compile``: its cases run through ``exported.run`` (a fresh process loads
the artifacts and trains them).
"""
from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import dataclass
from typing import Callable

import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg
from tests.eager_check import unreadable


@dataclass(frozen=True)
class Entry:
    name: str
    compile: Callable
    variants: tuple = ("base",)
    backward_context: Callable = contextlib.nullcontext
    reset: Callable = lambda: None
    backend: str = "eager"
    tol: tuple = (0.0, 0.0)
    staged: bool = False    # a capture()d step: inputs it was not captured for are InputMismatchError


def _capture(dynamic=False, **compile_options):
    def compile(fn, args, kwargs):
        captured = aotgrad.capture(fn, *args, dynamic=dynamic, **kwargs)
        aotgrad.verify(captured)
        return captured.compile(**compile_options)
    return compile


def _jit(**compile_options):
    return lambda fn, args, kwargs: aotgrad.jit(fn, **compile_options)


def _dynamo(**compile_options):
    backend = aotgrad.backend(**compile_options) if compile_options else "aotgrad"
    return lambda fn, args, kwargs: _unwrapped(torch.compile(fn, backend=backend))


def _unwrapped(compiled):
    def call(*a, **k):      # Dynamo wraps a backend's refusal: the typed error is its inner exception
        try:
            return compiled(*a, **k)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, aotgrad.errors.AotgradError):
                raise e.inner_exception from e
            raise
    return call


def _stored_first(compile, fn, args, kwargs):
    """Compile and call a copy of the program once (its disk-cache entry is stored), leaving the
    RNG as it was: what a first process does before the one under test starts."""
    if any(unreadable(t) for t in _all_tensors(fn, args, kwargs)):
        return      # deepcopy would read the freed storage (a segfault in torch, eager too)
    state = torch.random.get_rng_state()
    try:
        fn2, args2, kwargs2 = copy.deepcopy((_own_closure(fn), args, kwargs))
        compile(fn2, args2, kwargs2)(*args2, **kwargs2)
    except Exception:       # inputs that cannot be copied, or a refusal: the entry under test gives its own
        pass
    finally:
        torch.random.set_rng_state(state)


def _own_closure(fn):
    """``fn`` with copies of the tensors and generators its closure holds (deepcopy shares a function as
    it is): the first process's call must not write the closure tensors of the program under test, nor
    move its generators on."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    def held(c):
        try:
            return c.cell_contents
        except ValueError:      # an empty cell
            return None
    cells = tuple(types.CellType(copy.deepcopy(held(c))) if isinstance(held(c), (torch.Tensor, torch.Generator)) else c
                  for c in fn.__closure__)
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


def _all_tensors(fn, args, kwargs):
    state = list(fn.parameters()) + list(fn.buffers()) if isinstance(fn, torch.nn.Module) else []
    return state + [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _jit_warm(fn, args, kwargs):
    """``jit`` served from the disk cache: a new ``jit`` of the program, as a second process makes,
    finds the entry a first one stored and loads it instead of capturing."""
    _stored_first(_jit(), fn, args, kwargs)
    return aotgrad.jit(fn)


def _dynamo_warm(fn, args, kwargs):
    """``torch.compile(backend="aotgrad")`` served from the disk cache after Dynamo traces again."""
    _stored_first(_dynamo(), fn, args, kwargs)
    torch._dynamo.reset()
    return _dynamo()(fn, args, kwargs)


def _as_is(fn, args, kwargs):
    return fn


def _reset_dynamo():
    torch._dynamo.reset()


def _reset_compiled_autograd():
    from aotgrad.compiled_autograd import reset
    reset()


def _exported(fn, args, kwargs):
    raise AssertionError("the export entry runs through tests.differential.exported.run, not a compile")


# Inductor reorders float arithmetic (fused reductions, vectorised loops): values within this, grads x10.
INDUCTOR_TOL = (1e-4, 1e-4)
ALL_VARIANTS = ("base", "stride", "offset", "size", "resize")

ENTRIES = {e.name: e for e in (
    Entry("capture", _capture()),
    Entry("capture_cudagraphs", _capture(fw_compiler=cg.configure(warmup=0)), backend="cudagraphs"),
    Entry("min_cut", _capture(partitioner="min_cut")),
    Entry("budget", _capture(memory_budget=0.5)),
    Entry("jit", _jit(), ALL_VARIANTS),
    Entry("capture_dynamic", _capture(dynamic=True), ("base", "size", "resize"), staged=True),
    Entry("dynamo", _dynamo(), ALL_VARIANTS, reset=_reset_dynamo),
    Entry("jit_warm", _jit_warm, ("base", "stride", "size", "resize")),
    Entry("dynamo_warm", _dynamo_warm, ("base",), reset=_reset_dynamo),
    Entry("compiled_autograd", _as_is, backward_context=lambda: aotgrad.compiled_autograd("eager"),
          reset=_reset_compiled_autograd),
    Entry("inductor", _capture(fw_compiler="inductor"), backend="inductor", tol=INDUCTOR_TOL),
    Entry("jit_inductor", _jit(fw_compiler="inductor"), ALL_VARIANTS, backend="inductor", tol=INDUCTOR_TOL),
    Entry("dynamo_inductor", _dynamo(fw_compiler="inductor"), ALL_VARIANTS, reset=_reset_dynamo,
          backend="inductor", tol=INDUCTOR_TOL),
    Entry("export", _exported),
)}
