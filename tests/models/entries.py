"""The four ways a user trains a model with aotgrad, each as ``check_training`` options."""
from __future__ import annotations

import torch

import aotgrad
from tests.eager_check import as_is, default_compile


def _dynamo(model, args, kwargs, **opts):
    torch._dynamo.reset()        # no graph or guard of an earlier model is reused
    return torch.compile(model, backend="aotgrad")


def _jit(model, args, kwargs, **opts):
    return aotgrad.jit(model)


ENTRIES = {
    "capture": dict(compile=default_compile),
    "torch.compile": dict(compile=_dynamo),
    "jit": dict(compile=_jit),
    "compiled_autograd": dict(compile=as_is, backward_context=lambda: aotgrad.compiled_autograd("eager")),
}
