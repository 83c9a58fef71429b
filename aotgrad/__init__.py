"""aotgrad: an ahead-of-time autograd compiler for PyTorch.

    captured = aotgrad.capture(model, x, y)     # joint forward+backward graph
    print(captured)                              # read it
    step = captured.compile()                    # partition + compile
    loss = step(x, y); loss.backward()           # trains like eager
"""
from . import backends, errors
from .analysis.verify import verify
from .capture.capture import capture
from .stages import Captured, Compiled, Setup

__all__ = ["capture", "Captured", "Compiled", "Setup", "backends", "errors", "verify"]
from .frontend.jit import Jit, jit


def backend(fw_compiler="eager", bw_compiler=None, partitioner="default", **compile_options):
    """A configured ``torch.compile`` backend: ``torch.compile(m, backend=aotgrad.backend(...))``."""
    from .frontend.dynamo import backend as make
    return make(fw_compiler, bw_compiler, partitioner, **compile_options)


def explain(obj) -> str:
    """Plain-text account of a ``jit`` function's entries and recompiles, or a ``Compiled``'s stages."""
    if isinstance(obj, Jit):
        return obj.explain()
    return str(obj)


__all__ += ["jit", "Jit", "explain", "backend"]
