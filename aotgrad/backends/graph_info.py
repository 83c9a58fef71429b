"""What a graph compiler is told about the graph it compiles, beyond the graph.

Attached as ``gm.meta["aotgrad"]`` (by ``compile``) so that any ``(gm, example_inputs)``
compiler can read it and plain ones can ignore it. Backends read it, not the
placeholder names (a pass or a user may rename nodes). A graph that did not come
from ``compile`` has none: :func:`info_of` then reads the names ``Desc.ident``
gives, the only description such a graph has.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..ir.descriptors import BufferDesc, ParamDesc, TangentDesc


@dataclass(frozen=True)
class GraphInfo:
    kind: str                   # "forward", "backward" or "inference"
    input_names: tuple          # descriptor text per placeholder
    static_inputs: tuple        # placeholder indices holding parameters/buffers (same storage every call)
    mutated_inputs: tuple       # placeholder indices whose new value the graph returns for write-back
    saved_outputs: tuple        # output indices the forward saves for the backward
    function_id: int            # shared by the forward and backward of one compiled function
    saved_inputs: tuple = ()    # backward: placeholder indices holding the forward's saved values


def info_of(gm: fx.GraphModule) -> GraphInfo:
    """``gm``'s GraphInfo; for a plain graph, one read from its placeholder names (``function_id`` -1:
    paired with no other graph by id)."""
    info = gm.meta.get("aotgrad")
    if isinstance(info, GraphInfo):
        return info
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if any(n.startswith(TangentDesc.PREFIX) for n in names):
        saved = tuple(i for i, n in enumerate(names) if not n.startswith(TangentDesc.PREFIX))
        return GraphInfo("backward", tuple(names), (), (), (), -1, saved)
    static = tuple(i for i, n in enumerate(names) if n.startswith((ParamDesc.PREFIX, BufferDesc.PREFIX)))
    return GraphInfo("forward", tuple(names), static, (), (), -1)
