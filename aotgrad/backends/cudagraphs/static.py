"""Inputs that keep their storage between calls and are used in place.

Parameters and buffers are updated in place by optimizers, so a recording can
read them where they live instead of copying them into static buffers every
step. They are known from the graph's ``GraphInfo.static_inputs`` (see
:mod:`aotgrad.backends.graph_info`) or given explicitly as ``static_input_indices``.
"""
from __future__ import annotations

import torch.fx as fx

from ..graph_info import info_of


def static_inputs(gm: fx.GraphModule, given=()) -> frozenset[int]:
    return frozenset(info_of(gm).static_inputs) | frozenset(given)
