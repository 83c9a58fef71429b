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

_engine = torch._C._dynamo.compiled_autograd


@contextlib.contextmanager
def engine_compiler_off():
    prior = _engine.set_autograd_compiler(None, False)
    try:
        yield
    finally:
        _engine.set_autograd_compiler(*prior)


def make_runtime(instance, gm, compile_fn, state):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pick = [_lifted_position(n.target) for n in placeholders]
    compiled = compile_fn(gm, [n.meta.get("val") for n in placeholders])

    def runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):
        state.runs += 1
        lifted = {"input": inputs, "size": sizes, "scalar": scalars, "hook": hooks}
        flat = [lifted[kind][i] for kind, i in pick]
        with engine_compiler_off():
            return compiled_fn(*flat)

    return runtime_wrapper, compiled


def _lifted_position(placeholder_name: str) -> tuple[str, int]:
    """``"size_12"`` -> ``("size", 12)``: which engine list and index a placeholder reads."""
    kind, index = placeholder_name.rsplit("_", 1)
    return kind, int(index)
