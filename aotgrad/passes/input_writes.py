"""Input writes inside an inference graph, for a backend that fuses them (Inductor).

A graph returns the new value of each input it writes in place, and the epilogue copies it into
the input (``runtime/epilogue.py``): one more pass over the memory of every written tensor. For a
whole training step that is every parameter and every optimizer state tensor. Given
``copy_(input, new value)`` at the end of the graph instead, Inductor writes the update straight
into the input's memory from the kernel that computes it, as eager's in-place update does; the
graph returns the input itself there, and the epilogue does not copy a value onto itself.

Only plain data writes move: an input whose metadata the function also changes (``t_()``,
``resize_``) keeps its epilogue, which changes the metadata before it copies the data.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .cleanup import copy_module

_COPY = torch.ops.aten.copy_.default


def writes_in_graph(gm: fx.GraphModule, analysis) -> fx.GraphModule:
    """A copy of the inference graph ``gm`` that writes its data mutations into its inputs and returns
    those inputs in place of the new values (``gm`` itself when it writes none)."""
    written = [(k, i) for k, i in enumerate(i for i, info in enumerate(analysis.inputs) if info.mutates_data)
               if not analysis.inputs[i].mutates_metadata]
    if not written:
        return gm
    new = copy_module(gm)
    inputs = new.graph.find_nodes(op="placeholder")
    out = new.graph.find_nodes(op="output")[0]
    values = list(out.args[0])
    for k, i in written:
        x, value = inputs[i], values[k]
        want, got = x.meta.get("val"), getattr(value, "meta", {}).get("val")
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) \
                or (want.shape, want.dtype, want.device) != (got.shape, got.dtype, got.device):
            continue
        with new.graph.inserting_before(out):
            write = new.graph.call_function(_COPY, (x, value))
        write.meta["val"] = want
        values[k] = write
    out.args = (type(out.args[0])(values),)
    new.recompile()
    return new
