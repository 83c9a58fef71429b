"""Split a graph into regions a CUDA graph can hold and regions that run eagerly.

A node cannot be captured when it synchronises with the host (``.item()``:
tag ``data_dependent_output``), produces a shape that depends on data
(``nonzero``: tag ``dynamic_output_shape``, or an unbacked size), or touches
a tensor on another device than the graphed one (CPU tensors in a CUDA
graph). Consecutive nodes of the same kind form one segment.

    a = mm(x, w); s = _local_scalar_dense(a.sum()); b = mul(a, s)
      -> [capturable: mm, sum] [eager: _local_scalar_dense] [capturable: mul]
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..._torch import OpOverload, pytree

_HOST_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def _vals(node: fx.Node) -> list:
    return pytree.tree_leaves(node.meta.get("val"))


def _unbacked(v) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    return bool(free_unbacked_symbols(v))


def why_not_capturable(node: fx.Node, device_type: str) -> str | None:
    """Why ``node`` must run outside a graph, or None when it can be captured."""
    if node.op != "call_function":
        return None
    op = node.target
    if isinstance(op, OpOverload) and any(t in op.tags for t in _HOST_TAGS):
        return f"{op} synchronises with the host or has a data-dependent shape"
    for v in _vals(node) + [a.meta.get("val") for a in node.all_input_nodes]:
        if isinstance(v, torch.Tensor) and v.device.type != device_type:
            return f"{node.name} uses a tensor on {v.device}, not {device_type}"
        if isinstance(v, (torch.Tensor, torch.SymInt)) and _unbacked(v):
            return f"{node.name} has a data-dependent shape"
    return None


def segment_ids(gm: fx.GraphModule, device_type: str) -> tuple[dict[fx.Node, int], dict[int, bool]]:
    """Each compute node's segment, and whether each segment is capturable."""
    ids, capturable, current, cur_cap = {}, {}, -1, None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        cap = why_not_capturable(n, device_type) is None
        if cap != cur_cap:
            current, cur_cap = current + 1, cap
            capturable[current] = cap
        ids[n] = current
    return ids, capturable


def split(gm: fx.GraphModule, device_type: str):
    """``(top, {submodule name: capturable})``; ``top`` calls ``submod_<i>`` in order.

    Returns ``(gm, None)`` when the whole graph is one capturable segment.
    """
    ids, capturable = segment_ids(gm, device_type)
    if all(capturable.values()) and len(capturable) <= 1:
        return gm, None
    top = _split_module(gm, lambda n: ids[n])
    return top, {f"submod_{i}": cap for i, cap in capturable.items()}


def _split_module(gm: fx.GraphModule, callback) -> fx.GraphModule:
    """``split_module`` with every submodule returning a tuple, even of one value."""
    import inspect

    from torch.fx.passes.split_module import split_module
    if "tuple_return" in inspect.signature(split_module).parameters:
        return split_module(gm, None, callback, keep_original_order=True, tuple_return=True)
    # torch 2.11 has no ``tuple_return``: a one-output submodule returns the bare
    # value and its caller uses it directly. Wrap it and unpack it as torch 2.13 does.
    top = split_module(gm, None, callback, keep_original_order=True)
    for call in list(top.graph.find_nodes(op="call_module")):
        sub = getattr(top, call.target)
        out = sub.graph.output_node()
        if isinstance(out.args[0], (tuple, list)):
            continue
        out.args = ((out.args[0],),)
        sub.recompile()
        with top.graph.inserting_after(call):
            item = top.graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item)
    top.recompile()
    return top
