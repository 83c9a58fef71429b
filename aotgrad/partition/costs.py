"""What a partitioner needs to know about each node: may it be recomputed,
what does saving it cost in bytes, what does recomputing it cost in FLOPs.

Per-operator knowledge lives in aotgrad.ir.ops (tables, tags and schemas).
A *policy* names which ops may be recomputed.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ..ir.ops import has_side_effect, is_cheap, is_expensive, packet
from .default import is_sym

def never_recompute(node: fx.Node) -> bool:
    """Random ops (the backward must see the forward's mask), collectives (every rank must issue the
    same ones in the same order, whatever its shapes), symbols and non-ops."""
    return node.op != "call_function" or has_side_effect(node) or is_sym(node)


def _cheap_policy(node):
    return is_cheap(node)


def _save_matmuls(node):
    return not is_expensive(node)


def _save_nothing(node):
    return True


def _save_everything(node):
    return False


POLICIES = {
    "cheap": _cheap_policy,              # recompute pointwise/views/reshapes; save the rest
    "save_matmuls": _save_matmuls,       # save only matmul/conv/attention outputs (and what cannot be recomputed)
    "save_nothing": _save_nothing,       # save only what cannot be recomputed (random, inputs)
    "save_everything": _save_everything,  # recompute nothing (what the default partitioner saves)
}
# Policies under which what may be recomputed must be (JAX's dots_saveable,
# nothing_saveable); under the others the min cut saves whatever is cheaper.
STRICT = frozenset({"save_matmuls", "save_nothing"})


def may_recompute(node: fx.Node, policy) -> bool:
    return not never_recompute(node) and POLICIES.get(policy, policy)(node)


def as_int(x) -> int:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else 1
    return int(x)


def tensor_bytes(v) -> int:
    """Bytes of the storage a tensor value needs (its span, for strided outputs)."""
    if not isinstance(v, torch.Tensor):
        return 0
    span = 1
    for size, stride in zip(v.shape, v.stride()):
        if as_int(size) == 0:
            return 0
        span += (as_int(size) - 1) * abs(as_int(stride))
    return span * v.element_size()


def node_bytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return sum(tensor_bytes(x) for x in v)
    return tensor_bytes(v)


def flops(node: fx.Node) -> int:
    """FLOPs to recompute a node: the flop counter's formula, else one per output element."""
    fn = flop_registry.get(packet(node))
    if fn is not None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        try:
            return as_int(fn(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:   # a formula that cannot read these (symbolic) shapes
            pass
    return max(1, node_bytes(node) // 4)
