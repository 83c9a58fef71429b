"""What a partitioner needs to know about each node: may it be recomputed,
what does saving it cost in bytes, what does recomputing it cost in FLOPs.

Per-operator knowledge lives in the tables below or is read from the
operator's tags and schema. A *policy* names which ops may be recomputed.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ..analysis.ops import is_random
from .graphs import is_sym

aten = torch.ops.aten

# Never recomputed by any policy: the backward must reuse their forward result.
EXPENSIVE = frozenset(getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
    "cudnn_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward") if hasattr(aten, name))

MATMULS = EXPENSIVE

# Cheap ops that carry neither the pointwise tag nor an aliasing schema.
CHEAP_EXTRA = frozenset(getattr(aten, name) for name in (
    "_to_copy", "clone", "_unsafe_view", "expand_copy", "view_copy", "permute_copy", "t_copy",
    "transpose_copy", "unsqueeze_copy", "squeeze_copy", "slice_copy", "select_copy",
    "lift_fresh_copy", "full_like", "zeros_like", "ones_like", "empty_like", "scalar_tensor")
    if hasattr(aten, name))

# Ops whose output shares its first argument's storage though the schema says otherwise.
ALIASING_EXTRA = frozenset({aten._unsafe_view})


def packet(node: fx.Node):
    t = node.target
    return t.overloadpacket if isinstance(t, torch._ops.OpOverload) else None


def aliases_input(node: fx.Node) -> bool:
    """Whether the node's output is a view of (shares storage with) its first argument."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return packet(node) in ALIASING_EXTRA or any(r.alias_info is not None for r in t._schema.returns)


def is_cheap(node: fx.Node) -> bool:
    """Pointwise ops, views, reshapes, casts and unpacking a tuple."""
    if node.target is operator.getitem:
        return True
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in t.tags or aliases_input(node) or packet(node) in CHEAP_EXTRA


def is_expensive(node: fx.Node) -> bool:
    return packet(node) in EXPENSIVE


def never_recompute(node: fx.Node) -> bool:
    """Random ops (the backward must see the forward's mask), symbols and non-ops."""
    return node.op != "call_function" or is_random(node) or is_sym(node)


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
