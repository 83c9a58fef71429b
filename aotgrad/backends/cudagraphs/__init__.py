"""``"cudagraphs"``: record each forward/backward graph as a CUDA graph and replay it.

A :class:`CudaGraphs` compiler wraps a graph as follows: inputs it writes to
are found from schemas (:mod:`.mutation`), parameters and buffers are used in
place (:mod:`.static`), ops a CUDA graph cannot hold run eagerly between
graphed segments (:mod:`.segments`), each input shape is warmed up, recorded
and replayed (:mod:`.recording`) by a runner (:mod:`.runners`), and outputs
that a later replay would overwrite are cloned or checked (:mod:`.lifetime`).

The forward and the backward of one compiled function share one memory pool:
``compile`` compiles a function's forward and then its backward, and a
backward graph (``GraphInfo.kind``) is paired with the forward
compiled just before it (both carry one ``GraphInfo.function_id``; a plain graph pairs
when it reads that forward's traced output values).

Graphs without CUDA tensors use the :class:`~.runners.NullRunner`: same
logic, no CUDA graph, useful on CPU and in tests.

Output lifetime (:mod:`.lifetime`): outputs are handed out in recorded memory, and a replay
first moves what the caller still holds out of its way; so outputs kept across calls, two
forwards before one backward and ``retain_graph=True`` behave as in eager, and a saved input
written in place before the backward raises eager's version-counter error.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from ...options import CudaGraphsOptions
from .lifetime import StaleOutputError
from .mutation import written_inputs
from .recording import Graphed
from .runners import CudaRunner, NullRunner, Pool
from .segments import split
from .static import static_inputs
from ..graph_info import info_of

__all__ = ["Config", "CudaGraphsOptions", "CudaGraphs", "StaleOutputError", "cudagraphs", "configure"]


# The options live with every other compile option (``CompileOptions(cudagraphs={...})`` reaches
# them), checked when given; ``Config`` is the name this backend has always used for them.
Config = CudaGraphsOptions


def _device_type(example_inputs) -> str:
    cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)
    return "cuda" if cuda else "cpu"


def _output_names(gm: fx.GraphModule) -> list[str]:
    return [getattr(o, "name", f"output {i}") for i, o in enumerate(gm.graph.output_node().args[0])]


def _output_vals(gm: fx.GraphModule) -> list:
    """Per output position, the id of its traced value (None for a constant)."""
    return [id(o.meta.get("val")) if isinstance(o, fx.Node) else None for o in gm.graph.output_node().args[0]]


class CudaGraphs:
    """A configured cudagraphs compiler: ``(gm, example_inputs) -> callable``."""

    def __init__(self, config: Config = Config()):
        self.config = config
        self._forward = None             # (pool, weakref to the forward) compiled last, awaiting its backward
        self.last_compiled = None        # weak reference to the graph compiled last, for inspection

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        use_cuda = self.config.runner == "cuda" or (
            self.config.runner == "auto" and _device_type(example_inputs) == "cuda")
        info = info_of(gm)
        backward = info.kind == "backward"
        pool, forward = self._pair(gm, info, use_cuda) if backward else (Pool(use_cuda), None)
        runner = (lambda: CudaRunner(pool.handle)) if use_cuda else (lambda: NullRunner(pool))
        compiled = _wrap(gm, self.config, runner, "cuda" if use_cuda else "cpu", pool)
        compiled.forward = forward
        self._forward = None if backward else (pool, weakref.ref(compiled), _output_vals(gm), info)
        self.last_compiled = weakref.ref(compiled)
        return compiled

    def _pair(self, bw_gm, info, use_cuda: bool):
        """The pool of the forward compiled just before ``bw_gm``, and that forward, if ``bw_gm`` is
        its backward."""
        if self._forward is None:
            return Pool(use_cuda), None
        pool, ref, fw_vals, fw_info = self._forward
        phs = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
        saved = [phs[i] for i in info.saved_inputs]
        if min(info.function_id, fw_info.function_id) >= 0:
            ours = info.function_id == fw_info.function_id
        else:   # a plain graph: the same traced value objects on both sides, not just equal names
            ours = all(id(n.meta.get("val")) in fw_vals for n in saved)
        if not ours:
            return Pool(use_cuda), None
        return pool, ref()


def _wrap(gm, config, make_runner, device_type, pool):
    top, parts = split(gm, device_type)
    in_place = static_inputs(gm, config.static_input_indices)
    if parts is None:
        return Graphed(gm.forward, type(gm).__name__, config, in_place, written_inputs(gm),
                       make_runner, _output_names(gm), pool=pool)
    for name, capturable in parts.items():
        if capturable:
            sub = getattr(top, name)
            graphed = Graphed(sub.forward, f"{type(gm).__name__}.{name}", config,
                              _sub_static(top, name, in_place), written_inputs(sub), make_runner,
                              pool=pool)
            setattr(top, name, _Module(graphed))
    return _Segmented(top, pool)


def _sub_static(top, name, in_place) -> frozenset:
    """Static inputs of a segment: those it reads straight from a static graph input."""
    phs = [n for n in top.graph.nodes if n.op == "placeholder"]
    call = next(n for n in top.graph.nodes if n.op == "call_module" and n.target == name)
    return frozenset(i for i, a in enumerate(call.args) if a in phs and phs.index(a) in in_place)


class _Module(torch.nn.Module):
    def __init__(self, graphed):
        super().__init__()
        self.graphed = graphed

    def forward(self, *args):
        return self.graphed(*args)


class _Segmented:
    """Graphed segments and eager segments called in order by the split graph."""

    def __init__(self, top, pool):
        self.top, self.pool = top, pool

    def __call__(self, *args):
        return self.top(*args)


def configure(**options) -> CudaGraphs:
    """A cudagraphs compiler with options, e.g. ``configure(max_recordings=4)``; unknown names are
    refused with the closest known one. ``CompileOptions(fw_compiler="cudagraphs", cudagraphs={...})``
    does the same through the compile options."""
    return CudaGraphs(CudaGraphsOptions.of("cudagraphs.configure", **options))


cudagraphs = CudaGraphs()
