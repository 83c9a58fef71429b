"""From a captured backward graph to what the engine runs on every later backward.

The captured graph's placeholders are the engine's lifted values, flat and in
order: tensors, sizes, scalars, then the hooks/ctx objects it uses. The
engine calls ``runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks,
packed)``; we pick the used hooks, switch compiled autograd off (a hook may
call ``backward`` itself) and call the compiled graph.
"""
from __future__ import annotations

import contextlib

import torch

from .. import backends
from ..errors import UnsupportedError
from .segments import SegmentedBackward

_engine = torch._C._dynamo.compiled_autograd


@contextlib.contextmanager
def engine_compiler_off():
    prior = _engine.set_autograd_compiler(None, False)
    try:
        yield
    finally:
        _engine.set_autograd_compiler(*prior)


def make_runtime(instance, gm, compile_fn, count_run):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pick = [_lifted_position(n.target) for n in placeholders]
    if compile_fn is backends.eager:   # runs opaque Python calls itself: one graph
        compiled = compile_fn(gm, [n.meta.get("val") for n in placeholders])
    else:
        compiled = SegmentedBackward(gm, compile_fn)

    def runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):
        if torch.is_grad_enabled():   # a cached structure met again under create_graph=True
            raise UnsupportedError("aotgrad.compiled_autograd cannot run a double backward "
                                   "(create_graph=True); run this backward outside the context")
        instance.size_guard.check(sizes)
        count_run()
        lifted = {"input": inputs, "size": sizes, "scalar": scalars, "hook": hooks}
        flat = [lifted[kind][i] for kind, i in pick]
        with engine_compiler_off():
            return list(compiled_fn(*flat))

    return runtime_wrapper, compiled


def _lifted_position(placeholder_name: str) -> tuple[str, int]:
    """``"size_12"`` -> ``("size", 12)``: which engine list and index a placeholder reads."""
    kind, index = placeholder_name.rsplit("_", 1)
    return kind, int(index)
