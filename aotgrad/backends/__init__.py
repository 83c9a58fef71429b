"""Graph compilers behind a registry.

A compiler is ``(gm: GraphModule, example_inputs: list) -> callable``; it gets
a forward or backward graph and fake example inputs and returns what runs it.
"""
from __future__ import annotations

from typing import Callable

from ..errors import AotgradError

_REGISTRY: dict[str, Callable] = {}     # name -> backend, filled by register(): process-wide by design


def register(name: str, compiler: Callable) -> None:
    _REGISTRY[name] = compiler


def get(name_or_fn) -> Callable:
    if callable(name_or_fn):
        return name_or_fn
    try:
        return _REGISTRY[name_or_fn]
    except KeyError:
        raise AotgradError(f"unknown backend {name_or_fn!r}; registered: {sorted(_REGISTRY)}") from None


def compilers(options) -> tuple:
    """The forward and backward compilers a ``CompileOptions`` names. With ``options.cudagraphs``,
    one cudagraphs compiler so configured serves both halves (it pairs each forward with its backward)."""
    fw_name = options.fw_compiler
    bw_name = options.bw_compiler if options.bw_compiler is not None else fw_name
    configured = None
    if options.cudagraphs is not None:
        from .cudagraphs import CudaGraphs
        configured = CudaGraphs(options.cudagraphs)

    def pick(name):
        return configured if configured is not None and isinstance(name, str) and name == "cudagraphs" else get(name)
    return pick(fw_name), pick(bw_name)


def list() -> list[str]:  # noqa: A001 - the public name the API promises
    return sorted(_REGISTRY)


def eager(gm, example_inputs):
    """Run the graph as straight-line Python calling each ATen op: the reference backend."""
    from ..runtime.codegen import python_function
    info = gm.meta.get("aotgrad")
    # A backward takes its inputs boxed, so saved activations die at their last use.
    return python_function(gm, type(gm).__name__.lower(), boxed=info is not None and info.kind == "backward")


register("eager", eager)

# Imported after ``register`` exists; neither imports Inductor or CUDA at import time.
# Aliased so that ``aotgrad.backends.inductor``/``.cudagraphs`` stay the modules.
from .inductor import inductor as _inductor  # noqa: E402

register("inductor", _inductor)

from .cudagraphs import cudagraphs as _cudagraphs  # noqa: E402

register("cudagraphs", _cudagraphs)
