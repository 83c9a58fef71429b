"""FX graphs as plain data: the first step of storing one (:mod:`aotgrad.store.codec` writes it
as JSON and reads it back through its allowlists).

``dump_graph(gm)`` lists each node as ``(op, name, target, args, kwargs)``,
naming ATen overloads (``aten::mm.default``) and Python functions
(``_operator.getitem``) by text and other nodes by a :class:`Ref`; tensors
that ``get_attr`` nodes read are kept by value. Each node's value (shapes, strides, dtypes,
symbolic sizes) and stack trace are kept as data (:mod:`.values`).
"""
from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import OpOverload
from .values import value_out


class Unserializable(Exception):
    """A graph holds something that cannot be written as data (a higher-order op, a Python object)."""


@dataclass(frozen=True)
class Ref:
    name: str


def _target_out(t):
    if isinstance(t, OpOverload):
        if t._schema.name in ("aotgrad::tensor_hook", "aotgrad::retain_grad"):
            raise Unserializable("a graph that calls a user's tensor hook cannot be stored")
        return ("op", t._schema.name, t._overloadname)
    if getattr(t, "__module__", None) in ("_operator", "operator", "builtins", "math", "torch", "torch._sym_node_impl") \
            or t in vars(operator).values() or t in vars(builtins).values():
        module = getattr(t, "__module__", None) or "builtins"
        return ("py", module, t.__qualname__)
    raise Unserializable(f"graph target {t!r} cannot be serialised")


def _arg_out(a):
    return fx.node.map_arg(a, lambda n: Ref(n.name))


def dump_graph(gm: fx.GraphModule, target_out=None) -> dict:
    """``gm`` as plain data; ``target_out(target)`` names a call target ``_target_out`` does not know
    (a repeated block's half, for the store's codec), or None."""
    nodes, attrs, meta, symbols = [], {}, {}, {}
    for n in gm.graph.nodes:
        target = n.target
        if n.op == "call_function":
            target = (target_out and target_out(n.target)) or _target_out(n.target)
        elif n.op == "get_attr":
            attrs[n.target] = _attr(gm, n.target)
        elif n.op not in ("placeholder", "output"):
            raise Unserializable(f"graph node {n.name} has op {n.op}")
        nodes.append((n.op, n.name, target, _arg_out(n.args), _arg_out(n.kwargs)))
        meta[n.name] = (value_out(n.meta.get("val"), symbols), n.meta.get("stack_trace"))
        if n.op == "placeholder" and meta[n.name][0] is None and isinstance(n.meta.get("val"), torch.Tensor):
            # a loader rebuilds each input from its recorded value: a size only the data decides has none
            raise Unserializable(f"a graph input whose size depends on data (`{n.name}` of size "
                                 f"{tuple(n.meta['val'].shape)}, from nonzero, unique or a mask)")
    return {"nodes": nodes, "attrs": attrs, "class": type(gm).__name__,
            "meta": meta, "symbols": symbols}


def _attr(gm, target):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise Unserializable(f"graph attribute {target} is a {type(value).__name__}, not a tensor")
    return value.detach()


