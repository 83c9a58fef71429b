"""Clean-up passes run on every joint graph."""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

from ..analysis.ops import is_random


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta.update(getattr(gm, "meta", {}))
    return new


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop nodes nothing uses, keeping random ops so the RNG advances as in eager.

    ``a = relu(x); b = sin(x); return a``  ->  ``a = relu(x); return a``
    """
    gm = _copy(gm)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or is_random(n))
    gm.recompile()
    return gm


def remove_detach(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``detach(x)`` by ``x``: graphs run without autograd, so detach is a copy of a name.

    ``d = detach(r); y = threshold_backward(g, d)``  ->  ``y = threshold_backward(g, r)``
    """
    gm = _copy(gm)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()
    return gm
