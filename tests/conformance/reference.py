"""PyTorch's own AOT autograd as a reference compiler for check().

Used only to validate this harness (``--reference``): a sample that fails
here is a limit of the harness or of PyTorch, not of aotgrad. PyTorch's
data-dependent tracing errors are mapped onto aotgrad's typed errors so the
two runs classify the same situation the same way.
"""
from __future__ import annotations

import functools

import torch
from torch._functorch.aot_autograd import aot_function, aot_module
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


def aot_function_compile(fn, args, kwargs, *, dynamic=False, **opts):
    """check()-style compile through torch's aot_function / aot_module (nop compilers)."""
    if isinstance(fn, torch.nn.Module):
        return _typed(aot_module(fn, fw_compiler=nop, bw_compiler=nop, dynamic=dynamic))
    return _typed(aot_function(fn, fw_compiler=nop, bw_compiler=nop, dynamic=dynamic))
