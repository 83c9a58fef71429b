"""Which graph inputs a graph writes to, read from operator schemas.

An argument annotated ``Tensor(a!)`` or ``Tensor(a!)[]`` is written by the op
(``alias_info.is_write``); a written value that is an input, or a view of one,
makes that input mutated. This covers tensors inside list arguments
(``_foreach_add_(Tensor(a!)[] self, ...)``) and the ``copy_(input, new)``
copy-backs functionalization leaves at the end of a graph.

    x = placeholder; v = aten.view(x, [4]); aten.add_(v, 1)  ->  written_inputs = (0,)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..._torch import OpOverload
from ...ir.ops import mutated_args


def _bound(node: fx.Node, op) -> dict:
    """The node's arguments keyed by schema name."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
    return out


def _is_view(op) -> bool:
    rets = op._schema.returns
    return len(rets) == 1 and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _nodes(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, fx.Node)]
    return []


def written_inputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Indices of the placeholders ``gm`` writes to, directly or through views."""
    root: dict[fx.Node, int] = {}
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        root[n] = i
    written = set()
    for n in gm.graph.nodes:
        op = n.target
        if n.op != "call_function" or not isinstance(op, OpOverload):
            continue
        args = _bound(n, op)
        for name in mutated_args(op):
            written.update(root[v] for v in _nodes(args.get(name)) if v in root)
        first = _nodes(n.args[:1])
        if _is_view(op) and first and first[0] in root:
            root[n] = root[first[0]]
    return tuple(sorted(written))
