"""Leave the RNG where eager leaves it when a pass ends rewound.

``with torch.random.fork_rng(): m = dropout(x)`` draws a mask and puts the
global RNG state back. The compiled graph draws the mask from the real RNG,
so it must put the state back too: ``aotgrad::rng_state`` reads the
generator's state before the first draw past where eager's stream ends and
``aotgrad::set_rng_state`` restores it after the pass's last draw.

    m = bernoulli(e, 0.5) @(cpu, fw, 0), stream ends at 0
    ->  s = aotgrad.rng_state("cpu"); m = bernoulli(e, 0.5); aotgrad.set_rng_state(s, "cpu")
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ir.ops import RNG_META

_LIB = torch.library.Library("aotgrad", "FRAGMENT")
_LIB.define("rng_state(Device device) -> Tensor")
_LIB.define("set_rng_state(Tensor state, Device device) -> ()")


def _module(device: torch.device):
    return torch if device.type == "cpu" else getattr(torch, device.type)


def _rng_state(device):
    mod = _module(device)
    return mod.get_rng_state() if device.type == "cpu" else mod.get_rng_state(device)


def _set_rng_state(state, device):
    mod = _module(device)
    mod.set_rng_state(state) if device.type == "cpu" else mod.set_rng_state(state, device)


def _fake_rng_state(device):
    n = torch.get_rng_state().numel() if device.type == "cpu" else 16
    return torch.empty(n, dtype=torch.uint8)


_LIB.impl("rng_state", _rng_state, "CompositeExplicitAutograd")
_LIB.impl("set_rng_state", _set_rng_state, "CompositeExplicitAutograd")
torch.library.register_fake("aotgrad::rng_state", _fake_rng_state, lib=_LIB)
torch.library.register_fake("aotgrad::set_rng_state", lambda state, device: None, lib=_LIB)


def restore_after(graph: fx.Graph, first_past_end: fx.Node, last: fx.Node, dev: str, phase: str) -> None:
    """Save the state before ``first_past_end`` and restore it after ``last`` (both random nodes)."""
    device = torch.device(dev)
    tag = (dev, phase, -1)      # keeps both nodes in the pass (forward or backward) that drew
    with graph.inserting_before(first_past_end):
        state = graph.call_function(torch.ops.aotgrad.rng_state.default, (device,))
    with graph.inserting_after(last):
        restore = graph.call_function(torch.ops.aotgrad.set_rng_state.default, (state, device))
    val = first_past_end.meta.get("val")
    mode = getattr(val if not isinstance(val, (tuple, list)) else val[0], "fake_mode", None)
    if mode is not None:
        with mode:
            state.meta["val"] = _fake_rng_state(device)
    state.meta[RNG_META] = restore.meta[RNG_META] = tag
    restore.meta["val"] = None
