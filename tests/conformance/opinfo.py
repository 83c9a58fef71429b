"""Samples from PyTorch's OpInfo databases, as functions of their tensors.

``op_db`` and ``autograd_function_db`` are both lists of OpInfo: each sample
``op.op(sample.input, *sample.args, **sample.kwargs)`` becomes a function of
the tensor leaves alone, with every non-tensor value baked in -- the same
construction as torch's own ``aot_autograd_check``.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from tests.conformance.harness import Sample
from tests.conformance.inputs import fresh, tensor_function

DEVICE = "cpu"
DTYPE = torch.float32

# Ops whose outputs are uninitialized memory, so only their metadata can be
# compared; eager and compiled values legitimately differ.
UNDEFINED_VALUES = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
    "new_empty_strided",
})


def load(db):
    if db == "opinfo":
        from torch.testing._internal.common_methods_invocations import op_db
        return op_db
    if db == "autograd_function":
        from torch.testing._internal.autograd_function_db import autograd_function_db
        return autograd_function_db
    raise ValueError(f"not an OpInfo database: {db}")


def key(op):
    """Unique name of a database entry: ``name`` or ``name.variant``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _metadata_only(fn):
    def wrapped(*args, **kwargs):
        return pytree.tree_map_only(torch.Tensor, torch.zeros_like, fn(*args, **kwargs))
    return wrapped


def _op_callable(op):
    if op.name in UNDEFINED_VALUES:
        return _metadata_only(op.op)
    return op.op


def _sample(op, index, s):
    fn, tensors = tensor_function(_op_callable(op), ((s.input, *s.args), s.kwargs), key(op))

    def make():
        return fn, tuple(fresh(tensors)), {}
    return Sample(index, make, backward=op.supports_autograd, desc=s.summary() if hasattr(s, "summary") else "")


def samples(op):
    """Every CPU float32 sample of ``op``, deterministically generated."""
    raw = op.sample_inputs(DEVICE, DTYPE, requires_grad=op.supports_autograd)
    return [_sample(op, i, s) for i, s in enumerate(raw)]
