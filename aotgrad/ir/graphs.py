"""FX graphs as plain picklable data, and back, without re-tracing.

``dump_graph(gm)`` lists each node as ``(op, name, target, args, kwargs)``,
naming ATen overloads (``aten::mm.default``) and Python functions
(``_operator.getitem``) by text and other nodes by a :class:`Ref`; tensors
that ``get_attr`` nodes read are kept by value. ``load_graph`` rebuilds an
equal ``GraphModule`` in one pass. Each node's value (shapes, strides, dtypes,
symbolic sizes) and stack trace are kept as data (:mod:`.values`): a loaded graph
gets its traces back at once and its fake values from ``values.with_values``.
"""
from __future__ import annotations

import builtins
import importlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import OpOverload, append_node, lazy_graph_module
from .values import STORED, FakeValues, keep, value_out

FORMAT = 1


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


def _target_in(spec):
    kind, a, b = spec
    if kind == "op":
        ns, name = a.split("::")
        return getattr(getattr(getattr(torch.ops, ns), name), b)
    obj = importlib.import_module(a)
    for part in b.split("."):
        obj = getattr(obj, part)
    return obj


def _arg_out(a):
    return fx.node.map_arg(a, lambda n: Ref(n.name))


def _arg_in(a, env):
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, (list, tuple)):
        return type(a)(_arg_in(x, env) for x in a)
    if isinstance(a, dict):
        return {k: _arg_in(v, env) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_arg_in(a.start, env), _arg_in(a.stop, env), _arg_in(a.step, env))
    return a


def dump_graph(gm: fx.GraphModule) -> dict:
    nodes, attrs, meta, symbols = [], {}, {}, {}
    for n in gm.graph.nodes:
        target = n.target
        if n.op == "call_function":
            target = _target_out(n.target)
        elif n.op == "get_attr":
            attrs[n.target] = _attr(gm, n.target)
        elif n.op not in ("placeholder", "output"):
            raise Unserializable(f"graph node {n.name} has op {n.op}")
        nodes.append((n.op, n.name, target, _arg_out(n.args), _arg_out(n.kwargs)))
        meta[n.name] = (value_out(n.meta.get("val"), symbols), n.meta.get("stack_trace"))
    return {"format": FORMAT, "nodes": nodes, "attrs": attrs, "class": type(gm).__name__,
            "meta": meta, "symbols": symbols}


def _attr(gm, target):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise Unserializable(f"graph attribute {target} is a {type(value).__name__}, not a tensor")
    return value.detach().clone() if not isinstance(value, torch.nn.Parameter) else value


def load_graph(data: dict, values: FakeValues | None = None) -> fx.GraphModule:
    """The graph ``data`` describes; ``values`` rebuilds its fake values on demand (pass one
    ``FakeValues`` for graphs that share symbols, as a joint and its partition do)."""
    assert data["format"] == FORMAT, data["format"]
    graph, env = fx.Graph(), {}
    for op, name, target, args, kwargs in data["nodes"]:
        a, k = _arg_in(args, env), _arg_in(kwargs, env)
        if op == "output":
            node = graph.output(a[0])
        else:       # a stored graph's nodes were checked when it was made: appended as they are
            node = append_node(graph, op, name, _target_in(target) if op == "call_function" else target, a, k)
        env[name] = node
    root = torch.nn.Module()
    for target, value in data["attrs"].items():
        *path, last = target.split(".")
        owner = root
        for p in path:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        setattr(owner, last, value) if isinstance(value, torch.nn.Parameter) else owner.register_buffer(last, value)
    gm = lazy_graph_module(root, graph, data["class"])     # backends write their own code
    _restore_meta(gm, data, values)
    return gm


def _restore_meta(gm, data, values) -> None:
    stored = data.get("meta", {})
    for n in gm.graph.nodes:
        val, trace = stored.get(n.name, (None, None))
        n.meta[STORED] = val
        if trace:
            n.meta["stack_trace"] = trace
    keep(gm, values if values is not None else FakeValues(data.get("symbols", {})))
