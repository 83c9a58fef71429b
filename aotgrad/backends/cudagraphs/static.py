"""Inputs that keep their storage between calls and are used in place.

Parameters and buffers are updated in place by optimizers, so a recording can
read them where they live instead of copying them into static buffers every
step. They are known from the descriptor-derived placeholder names
(``p_<name>``/``b_<name>``, see :meth:`aotgrad.ir.descriptors.Desc.ident`)
or given explicitly as ``static_input_indices``.
"""
from __future__ import annotations

import torch.fx as fx

_STATIC_PREFIXES = ("p_", "b_")


def static_inputs(gm: fx.GraphModule, given=()) -> frozenset[int]:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    found = {i for i, name in enumerate(names) if name.startswith(_STATIC_PREFIXES)}
    return frozenset(found | set(given))
