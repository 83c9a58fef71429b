"""PyTorch's own AOT autograd as a reference compiler for check().

Used only to validate this harness (``--reference``): a sample that fails
here is a limit of the harness or of PyTorch, not of aotgrad. PyTorch's
data-dependent tracing errors are mapped onto aotgrad's typed errors so the
two runs classify the same situation the same way.
"""
from __future__ import annotations

import functools

import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.compilers import nop
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException,
                                           UnsupportedOperatorException)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from aotgrad.errors import DataDependentError, UnsupportedError

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException,
                   GuardOnDataDependentSymNode)


def _typed(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _DATA_DEPENDENT as exc:
            raise DataDependentError(f"{type(exc).__name__}: {exc}") from exc
        except UnsupportedOperatorException as exc:
            raise UnsupportedError(f"{type(exc).__name__}: {exc}") from exc
    return call


def _keep_tuple(fn):
    """Wrap ``fn`` to remember its output's type at trace time.

    aot_function returns a list where ``fn`` returned a tuple (or a
    ``torch.return_types`` struct); check() compares structure strictly, so
    the reference gives the type back rather than count a known difference.
    """
    seen = {}

    def traced(*args, **kwargs):
        out = fn(*args, **kwargs)
        seen["type"] = type(out)
        return out

    def restore(out):
        kind = seen.get("type")
        if isinstance(out, list) and kind is not None and issubclass(kind, tuple):
            return kind(out) if not hasattr(kind, "_fields") else kind(*out)
        return out
    return traced, restore


def aot_function_compile(fn, args, kwargs, *, dynamic=False, **opts):
    """check()-style compile through torch's aot_function / aot_module (nop compilers)."""
    if isinstance(fn, torch.nn.Module):
        return _module_compile(fn, dynamic)
    traced, restore = _keep_tuple(fn)
    compiled = _typed(aot_function(traced, fw_compiler=nop, bw_compiler=nop, dynamic=dynamic))
    return lambda *a, **k: restore(compiled(*a, **k))


def _module_compile(module, dynamic):
    """What aot_module does (parameters and buffers as leading inputs), plus _keep_tuple."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))

    def call(params, buffers, *args, **kwargs):
        return torch.func.functional_call(module, {**params, **buffers}, args, kwargs)
    traced, restore = _keep_tuple(call)
    compiled = _typed(aot_function(traced, fw_compiler=nop, bw_compiler=nop, dynamic=dynamic,
                                   num_params_buffers=len(params) + len(buffers)))
    return lambda *a, **k: restore(compiled(params, buffers, *a, **k))
