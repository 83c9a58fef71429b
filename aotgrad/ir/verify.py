"""Checks that a graph keeps the contract its stage promises."""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import OpOverload
from ..errors import GraphContractError
from .ops import mutated_args
from ..options import keywords_checked


def _vals(nodes):
    return [n.meta.get("val") if isinstance(n, fx.Node) else n for n in nodes]


def _same_meta(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
            str(x) == str(y) for x, y in zip(a.shape, b.shape))
    return (a is None) == (b is None)


def verify_graph(gm: fx.GraphModule) -> None:
    """A functional ATen graph: well formed, and no operator writes to its arguments."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise GraphContractError(f"the graph is malformed: {e}") from e
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, OpOverload) and mutated_args(n.target):
            raise GraphContractError(f"node {n.name} calls {n.target}, which mutates "
                                     f"{', '.join(mutated_args(n.target))}; joint graphs must be functional")


def verify_joint(gm: fx.GraphModule, captured) -> None:
    """``gm`` may replace ``captured.joint``: same inputs and outputs, functional."""
    verify_graph(gm)
    old_in = [n for n in captured.joint.graph.nodes if n.op == "placeholder"]
    new_in = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(old_in) != len(new_in):
        raise GraphContractError(f"the edited joint graph has {len(new_in)} inputs, the captured one {len(old_in)}")
    old_out = list(captured.joint.graph.output_node().args[0])
    new_out = list(gm.graph.output_node().args[0])
    if len(old_out) != len(new_out):
        raise GraphContractError(f"the edited joint graph has {len(new_out)} outputs, the captured one {len(old_out)}")
    for kind, descs, a, b in (("input", captured.input_descs, old_in, new_in),
                              ("output", captured.output_descs, old_out, new_out)):
        for d, x, y in zip(descs, _vals(a), _vals(b)):
            if not _same_meta(x, y):
                raise GraphContractError(f"{kind} '{d}' changed from {_show(x)} to {_show(y)}")


@keywords_checked("aotgrad.verify")
def verify(captured) -> None:
    """Check a Captured's joint graph against its own contract (run after every pass in tests)."""
    verify_joint(captured.joint, captured)


def _show(v):
    return f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
