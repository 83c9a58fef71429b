"""Input writes inside an inference graph, for a backend that fuses them (Inductor).

A graph returns the new value of each input it writes in place, and the epilogue copies it into
the input (``runtime/epilogue.py``): one more pass over the memory of every written tensor. For a
whole training step that is every parameter and every optimizer state tensor. Given
``copy_(input, new value)`` at the end of the graph instead, Inductor writes the update straight
into the input's memory from the kernel that computes it, as eager's in-place update does; the
graph returns the input itself there, and the epilogue does not copy a value onto itself.

Only plain data writes move: an input whose metadata the function also changes (``t_()``,
``resize_``) keeps its epilogue, which changes the metadata before it copies the data.

``early=True`` (the eager backend, which frees each value after its last use) also brings each
write forward, right after its value and the last node that reads the input or any view of it (by
the operators' schemas): a whole training step's optimizer then holds each new parameter and state
value only until its write, as eager's in-place update does, instead of every one of them until the
epilogue. The computations themselves keep their traced order (run inside the backward, an update
would add its temporaries to the backward's peak).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .cleanup import copy_module

_COPY = torch.ops.aten.copy_.default


def writes_in_graph(gm: fx.GraphModule, analysis, early: bool = False) -> fx.GraphModule:
    """A copy of the inference graph ``gm`` that writes its data mutations into its inputs and returns
    those inputs in place of the new values (``gm`` itself when it writes none); ``early``: each
    write as soon as it can run (module docstring)."""
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
    if early:
        _bring_forward(new.graph)
    new.recompile()
    return new


def _bring_forward(graph: fx.Graph) -> None:
    """Move each input write right after the later of its value and the last other node that reads
    its input's memory (the input or a view of it). Nothing else moves: writes read only their input
    and value, so the other nodes keep the order they were traced in."""
    writes = [n for n in graph.nodes if n.op == "call_function" and n.target is _COPY and n.args[0].op == "placeholder"]
    position = {n: k for k, n in enumerate(graph.nodes)}
    for w in writes:
        x, value = w.args
        readers = [u for a in _aliases(x) for u in a.users if u is not w and u.op != "output"]
        anchor = max([value, *readers], key=position.__getitem__)
        if anchor.next is not w:
            anchor.append(w)


def _aliases(x: fx.Node) -> set:
    """``x`` and every node whose value may share its memory: views of it and of those, by the
    operators' schemas (a loaded graph's fake values do not tell which share a storage); a target
    without a schema counts as a view."""
    found, todo = {x}, [x]
    while todo:
        for u in todo.pop().users:
            if u not in found and u.op == "call_function" and _may_alias(u.target):
                found.add(u)
                todo.append(u)
    return found


def _may_alias(target) -> bool:
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)
