"""aotgrad: an ahead-of-time autograd compiler for PyTorch.

    captured = aotgrad.capture(model, x, y)     # joint forward+backward graph
    print(captured)                              # read it
    step = captured.compile()                    # partition + compile
    loss = step(x, y); loss.backward()           # trains like eager
"""
from . import backends, errors
from .ir.verify import verify
from .capture.block_groups import block
from .capture.capture import capture
from .compiled_autograd import compiled_autograd
from .frontend.jit import Jit, jit
from .observe import trace
from .stages import Captured, Compiled, Exported, Setup
from .options import keywords_checked as _keywords_checked


def backend(fw_compiler="eager", bw_compiler=None, partitioner="auto", **compile_options):
    """A configured ``torch.compile`` backend: ``torch.compile(m, backend=aotgrad.backend(...))``."""
    from .frontend.dynamo import backend as make
    return make(fw_compiler, bw_compiler, partitioner, **compile_options)


@_keywords_checked("aotgrad.load")
def load(path: str, *, state: dict | None = None) -> "Exported":
    """The training step ``captured.export(path)`` wrote, runnable without the model's code
    (``state``: parameter and buffer values by name, for an artifact exported without them)."""
    from .export.loader import load as load_artifact
    return load_artifact(path, state=state)


@_keywords_checked("aotgrad.compile_cached")
def compile_cached(captured, fw_compiler="eager", bw_compiler=None, partitioner="default", memory_budget=None):
    """``captured.compile(...)`` that stores its partition on disk (``AOTGRAD_CACHE_DIR``) and reuses
    it for the same (possibly edited) joint graph, layout and options in a later process."""
    from .export.entry import compile_cached as cached
    return cached(captured, fw_compiler, bw_compiler, partitioner, memory_budget)


@_keywords_checked("aotgrad.explain")
def explain(obj) -> str:
    """Plain-text account of a ``jit`` function (entries, recompile reasons), a ``Compiled`` or a ``Captured``:
    stages with durations, graph sizes, saved activations, guards: ``obj.explain()``."""
    from .observe.explain import explain as explain_text
    return explain_text(obj)


__all__ = ["capture", "block", "Captured", "Compiled", "Exported", "Setup", "load", "jit", "Jit", "backend", "explain", "trace",
           "compile_cached",
           "compiled_autograd",
           "backends", "errors", "verify"]
