"""Samples from PyTorch's ``module_db``, run through the module path.

Each sample constructs the module from ``module_inputs_func`` (CPU, float32,
training mode) and calls it with the sample's forward args, so the compiler
sees a real ``nn.Module`` with parameters and buffers, as a user would pass it.
"""
from __future__ import annotations

import torch

from tests.conformance.harness import SEED, Sample
from tests.conformance.inputs import fresh

DEVICE = "cpu"
DTYPE = torch.float32


def load(db="modules"):
    from torch.testing._internal.common_modules import module_db
    return module_db


def key(info):
    return info.name


def _build(info, module_input):
    """Fresh (module, args, kwargs); same parameters every time (fixed seed)."""
    ctor, fwd = fresh((module_input.constructor_input.args, module_input.constructor_input.kwargs)), \
        fresh((module_input.forward_input.args, module_input.forward_input.kwargs))
    torch.manual_seed(SEED)
    m = info.module_cls(*ctor[0], **ctor[1]).to(DEVICE).to(DTYPE).train(True)
    if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin):
        # As torch's own test does: lazy parameters take their shapes from a
        # first call; capturing that initialization is out of scope here.
        with torch.no_grad():
            m(*fresh(fwd[0]), **fresh(fwd[1]))
    return m, tuple(fwd[0]), dict(fwd[1])


def _sample(info, index, module_input):
    def make():
        return _build(info, module_input)
    return Sample(index, make, backward=True, desc=module_input.desc or "")


def samples(info):
    inputs = info.module_inputs_func(info, device=DEVICE, dtype=DTYPE,
                                     requires_grad=True, training=True)
    return [_sample(info, i, mi) for i, mi in enumerate(inputs) if mi.forward_input is not None]
