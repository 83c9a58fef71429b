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


def explain(obj) -> str:
    """Plain-text account of a ``jit`` function's entries and recompiles, or a ``Compiled``'s stages."""
    if isinstance(obj, Jit):
        return obj.explain()
    return str(obj)


__all__ += ["jit", "Jit", "explain"]
