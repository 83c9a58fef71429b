"""Values and FX graphs as JSON, read back without running anything the format does not name.

Every value is a JSON scalar, a list, or a one-key object whose key says what it is
(``{"tuple": [...]}``, ``{"dtype": "float32"}``, ``{"node": "add_1"}``,
``{"@": "OutputInfo", ...}``). Decoding accepts only these tags; a graph's call targets
are resolved only against ``torch.ops`` namespaces in :data:`OP_NAMESPACES` and the
Python functions in :data:`PY_TARGETS`; dataclasses only against :data:`CLASSES`.
Anything else raises :class:`~aotgrad.errors.ExportFormatError` before a graph is built.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re

import torch
import torch.fx as fx

from .._torch import OpOverload
from ..errors import ExportFormatError
from ..ir.graphs import Ref, Unserializable, dump_graph
from . import sandbox

OP_NAMESPACES = ("aten", "prims", "aotgrad")
# The Python functions a static graph calls (sandbox.PY_FUNCTIONS): a multi-output op's element, and
# arithmetic on numbers a step reads with ``.item()``. Size arithmetic (``math.ceil``) appears only in
# symbolic graphs, which export refuses.
PY_TARGETS = {("_operator", f.__name__): f for f in sandbox.PY_FUNCTIONS}
DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DOTTED = re.compile(r"^(?!__)[A-Za-z0-9_]+(\.(?!__)[A-Za-z0-9_]+)*$")   # module paths: "h.0.attn.weight"
CLASSES: dict = {}      # dataclass name -> (class, {field: check}), filled by register()


def register(cls, fields: dict) -> None:
    """A dataclass a manifest may hold (stage metadata), by class name, with a type check per field."""
    CLASSES[cls.__name__] = (cls, fields)


def check_fields(cls, values: dict, error) -> None:
    """Every field of ``cls`` present, known and of its type; else ``error(sentence)``. (The format may
    know a field this version of ``cls`` lacks: the stage classes grow.)"""
    _, fields = CLASSES[cls.__name__]
    names = {f.name for f in dataclasses.fields(cls)}
    if names - set(fields):
        raise error(f"{cls.__name__} has fields {sorted(names - set(fields))} the export format does not know")
    for name in names:
        if name not in values or not fields[name](values[name]):
            raise error(f"{cls.__name__}.{name} is {_short(values.get(name))}, not a value the format allows")


def encode(v):
    """``v`` as JSON data; raises ``Unserializable`` for anything the format does not name."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if isinstance(v, (list, tuple)):
        items = [encode(x) for x in v]
        return items if type(v) is list else {"tuple": items}
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise Unserializable("a dict with non-string keys")
        return {"dict": {k: encode(x) for k, x in v.items()}}
    if isinstance(v, slice):
        return {"slice": [encode(v.start), encode(v.stop), encode(v.step)]}
    for tag, table in (("dtype", DTYPES), ("layout", _LAYOUTS), ("memory_format", _FORMATS)):
        if any(v is x for x in table.values()):
            return {tag: str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if dataclasses.is_dataclass(v) and CLASSES.get(type(v).__name__, (None,))[0] is type(v):
        values = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        check_fields(type(v), values, Unserializable)
        return {"@": type(v).__name__, **{k: encode(x) for k, x in values.items()}}
    raise Unserializable(f"a value of type {type(v).__name__} ({_short(v)})")


def _short(v) -> str:
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


def decode(v, env=None):
    """The value ``encode`` wrote; ``env`` maps node names to graph nodes."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode(x, env) for x in v]
    if not isinstance(v, dict) or not v:
        raise ExportFormatError(f"the artifact holds a value the format does not define: {_short(v)}")
    if "@" in v:
        return _decode_dataclass(v, env)
    if len(v) != 1:
        raise ExportFormatError(f"the artifact holds a value the format does not define: {_short(v)}")
    (tag, x), = v.items()
    return _decode_tagged(tag, x, env)


def _decode_tagged(tag, x, env):
    if tag == "tuple" and isinstance(x, list):
        return tuple(decode(i, env) for i in x)
    if tag == "dict" and isinstance(x, dict) and env is None:     # in graphs only as kwargs (keys become code)
        return {k: decode(i, env) for k, i in x.items()}
    if tag == "slice" and isinstance(x, list) and len(x) == 3:
        return slice(*(decode(i, env) for i in x))
    if tag == "float" and x in ("inf", "-inf", "nan"):
        return float(x)
    if tag == "node" and env is not None and x in env:
        return env[x]
    if tag == "device" and isinstance(x, str) and re.match(r"^[a-z]+(:\d+)?$", x):
        try:
            return torch.device(x)
        except RuntimeError:
            pass
    for name, table in (("dtype", DTYPES), ("layout", _LAYOUTS), ("memory_format", _FORMATS)):
        if tag == name and x in table:
            return table[x]
    raise ExportFormatError(f"the artifact holds a {tag!r} value the format does not define: {_short(x)}")


def _decode_dataclass(v, env):
    cls = CLASSES.get(v["@"], (None,))[0] if isinstance(v["@"], str) else None
    if cls is None:
        raise ExportFormatError(f"the artifact names a class {_short(v['@'])} the format does not define")
    fields = {k: decode(x, env) for k, x in v.items() if k != "@"}
    if set(fields) - {f.name for f in dataclasses.fields(cls)}:
        raise ExportFormatError(f"the artifact's {cls.__name__} has fields this aotgrad does not know")
    check_fields(cls, fields, ExportFormatError)
    return cls(**fields)


def encode_graph(gm: fx.GraphModule, tensors: dict, prefix: str) -> dict:
    """A graph as JSON; tensors its ``get_attr`` nodes read go into ``tensors`` under ``prefix``."""
    data = dump_graph(gm)
    nodes, dropped = [], set()
    for op, name, target, args, kwargs in data["nodes"]:
        if op == "call_function" and target[0] == "op" and target[1] in _PROFILER_RANGES:
            dropped.add(name)       # a profiler range (``Optimizer.step#AdamW.step``): no value, no effect
            continue
        if dropped and _names_in((args, kwargs)) & dropped:
            raise Unserializable(f"graph node {name} uses a profiler range's handle")
        if op == "call_function":
            target = _encode_target(target)
        nodes.append([op, name, target, _encode_refs(args), {"dict": {k: _encode_refs(v) for k, v in kwargs.items()}}])
    for target, value in data["attrs"].items():
        tensors[f"{prefix}{target}"] = value
    traces = {n.name: n.meta["stack_trace"] for n in gm.graph.nodes if isinstance(n.meta.get("stack_trace"), str)}
    return {"nodes": nodes, "attrs": sorted(data["attrs"]), "class": data["class"], "traces": traces,
            "values": _node_values(gm)}


_PROFILER_RANGES = ("profiler::_record_function_enter", "profiler::_record_function_enter_new",
                    "profiler::_record_function_exit")


def _names_in(v) -> set:
    if isinstance(v, Ref):
        return {v.name}
    if isinstance(v, (list, tuple)):
        return set().union(*map(_names_in, v)) if v else set()
    if isinstance(v, dict):
        return _names_in(list(v.values()))
    return set()


def _node_values(gm: fx.GraphModule) -> dict:
    """Each node's value as static ``TensorMeta`` data (memory estimates, printed shapes); a node whose
    value is not that (a symbolic size, an opaque object) is left out."""
    from ..ir.values import TensorMeta, value_out
    out = {}
    for n in gm.graph.nodes:
        v = value_out(n.meta.get("val"), {})
        if v is not None and _static_value(v, TensorMeta):
            out[n.name] = encode(v)
    return out


def _static_value(v, meta_cls) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_static_value(x, meta_cls) for x in v)
    if type(v) is meta_cls:
        return all(type(s) is int for s in (*v.shape, *v.stride, v.offset))
    return v is None or type(v) in (bool, int, float)


def _encode_target(spec) -> dict:
    kind, a, b = spec
    if kind == "op":
        op = _overload(a, b)
        why = sandbox.refusal(op) if op is not None else "it is not an operator overload"
        if why is not None:
            raise Unserializable(f"a graph that calls {a}.{b}: {why} (docs/export-format.md, the operator allowlist)")
        return {"op": f"{a}.{b}"}
    module = "_operator" if a == "operator" else a
    if (module, b) not in PY_TARGETS:
        raise Unserializable(f"graph target {a}.{b}")
    return {"py": f"{module}.{b}"}


def _encode_refs(v):
    if isinstance(v, Ref):
        return {"node": v.name}
    if isinstance(v, (list, tuple)):
        items = [_encode_refs(x) for x in v]
        return items if type(v) is list else {"tuple": items}
    if isinstance(v, dict):
        raise Unserializable("a graph node with a dict argument")
    if isinstance(v, slice):
        return {"slice": [_encode_refs(v.start), _encode_refs(v.stop), _encode_refs(v.step)]}
    return encode(v)


def decode_graph(data: dict, tensors: dict, prefix: str) -> fx.GraphModule:
    """The graph ``encode_graph`` wrote: every call target resolved through :func:`resolve_target`."""
    graph, env = fx.Graph(), {}
    try:
        for op, name, target, args, kwargs in data["nodes"]:
            if not isinstance(name, str) or not _IDENT.match(name) or name in env:
                raise ExportFormatError(f"a graph node is named {_short(name)}, not a fresh identifier")
            a, k = decode(args, env), _decode_kwargs(kwargs, env)
            if op == "placeholder" and target == name:
                node = graph.placeholder(name)
            elif op == "output":
                node = graph.output(a[0])
            elif op == "get_attr" and isinstance(target, str) and _DOTTED.match(target) and target in data["attrs"]:
                node = graph.create_node("get_attr", target, name=name)
            elif op == "call_function" and isinstance(a, tuple) and isinstance(k, dict):
                fn = resolve_target(target)
                if fn is operator.getitem and not (len(a) == 2 and isinstance(a[0], fx.Node) and type(a[1]) is int
                                                   and not k):
                    raise ExportFormatError(f"graph node {name} takes an element of something other than a node's "
                                            "result")
                if fn in sandbox.ARITHMETIC and not _numbers(fn, a, k):
                    raise ExportFormatError(f"graph node {name} calls {fn.__name__} on something other than one or "
                                            "two numbers (a power needs a float constant operand)")
                # Named as it is made: an automatic name (``getitem_15``) taken first and renamed
                # after would keep a later node from getting that very name.
                node = graph.create_node("call_function", fn, a, k, name=name)
            else:
                raise ExportFormatError(f"graph node {name} has an operation the format does not define ({_short(op)})")
            if op != "output":
                node._rename(name)
            env[name] = node
        traces = data.get("traces", {})
        for n in graph.nodes:       # the user's source lines, as text (inspect and saved-activation tables)
            if isinstance(traces.get(n.name), str):
                n.meta["stack_trace"] = traces[n.name]
        gm = fx.GraphModule(_attr_root(data["attrs"], tensors, prefix), graph, class_name=_ident(data["class"]))
        _keep_values(gm, env, data.get("values", {}))
        return gm
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ExportFormatError(f"a graph in the artifact is malformed ({type(e).__name__}: {_short(str(e))})") from None


def _numbers(fn, a: tuple, k: dict) -> bool:
    """Arithmetic on nodes and number constants only; a power with a float constant operand (a power of
    two integers read from a file could be made to take forever)."""
    if k or len(a) != (1 if fn is operator.neg else 2) \
            or not all(isinstance(x, fx.Node) or type(x) in (int, float) for x in a):
        return False
    return fn is not operator.pow or any(type(x) is float for x in a)


def _decode_kwargs(data, env) -> dict:
    """A node's keyword arguments: identifier keys (FX and our code generator write them as code)."""
    if not (isinstance(data, dict) and set(data) == {"dict"} and isinstance(data["dict"], dict)
            and all(isinstance(k, str) and _IDENT.match(k) for k in data["dict"])):
        raise ExportFormatError(f"a graph node's keyword arguments {_short(data)} are not identifiers and values")
    return {k: decode(v, env) for k, v in data["dict"].items()}


def _ident(name) -> str:
    """The graph's class name, where it is an identifier (make_fx names some ``<lambda>``)."""
    return name if isinstance(name, str) and _IDENT.match(name) else "ExportedGraph"


def _attr_root(attrs, tensors: dict, prefix: str) -> torch.nn.Module:
    root = torch.nn.Module()
    for target in attrs:
        if not isinstance(target, str) or not _DOTTED.match(target) or f"{prefix}{target}" not in tensors:
            raise ExportFormatError(f"graph constant {_short(target)} is not among the artifact's tensors")
        *path, last = target.split(".")
        owner = root
        for p in path:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        owner.register_buffer(last, tensors[f"{prefix}{target}"])
    return root


def _overload(qualified: str, overload: str):
    """The ``OpOverload`` ``ns::name`` + ``overload`` names, or None: exactly one overload, looked up
    only in :data:`OP_NAMESPACES`, never through a dunder or a packet's default."""
    ns, _, name = qualified.partition("::")
    if ns not in OP_NAMESPACES or not all(_IDENT.match(p) and not p.startswith("__") for p in (name, overload)):
        return None
    op = getattr(getattr(getattr(torch.ops, ns), name, None), overload, None)
    return op if isinstance(op, OpOverload) and f"{op._schema.name}.{op._overloadname}" == f"{qualified}.{overload}" \
        else None


def resolve_target(spec):
    """An operator overload the allowlist admits (``sandbox.refusal``) or ``operator.getitem``, by name."""
    if isinstance(spec, dict) and set(spec) == {"op"} and isinstance(spec["op"], str):
        qualified, _, overload = spec["op"].partition(".")
        op = _overload(qualified, overload)
        if op is None:
            raise ExportFormatError(f"operator {_short(spec['op'])} does not exist in this torch {torch.__version__} "
                                    "or is not one the format allows; export the step again with this torch; nothing "
                                    "was run")
        why = sandbox.refusal(op)
        if why is not None:
            raise ExportFormatError(f"the artifact's graphs call {spec['op']}, which a loaded step may not run: {why} "
                                    "(docs/export-format.md, the operator allowlist); nothing was run")
        return op
    if isinstance(spec, dict) and set(spec) == {"py"} and isinstance(spec["py"], str):
        module, _, name = spec["py"].partition(".")
        if (module, name) in PY_TARGETS:
            return PY_TARGETS[(module, name)]
    raise ExportFormatError(f"graph target {_short(spec)} is not an operator or function the format allows; "
                            "nothing was run")


def op_schemas(graphs) -> dict:
    """``{operator name: schema text}`` of every operator the graphs call (checked on load)."""
    return {f"{n.target._schema.name}.{n.target._overloadname}": str(n.target._schema)
            for gm in graphs for n in gm.graph.nodes
            if isinstance(n.target, OpOverload) and n.target._schema.name not in _PROFILER_RANGES}


def _keep_values(gm: fx.GraphModule, env: dict, stored) -> None:
    """Node values as data, rebuilt as fake tensors when something reads them (``values.with_values``)."""
    from ..ir.values import STORED, FakeValues, TensorMeta, keep
    if not isinstance(stored, dict) or not set(stored) <= set(env):
        raise ExportFormatError("a graph's node values name nodes it does not have")
    for name, data in stored.items():
        value = decode(data)
        if not _static_value(value, TensorMeta):
            raise ExportFormatError(f"the value of graph node {name} is not a static tensor description")
        env[name].meta[STORED] = value
    keep(gm, FakeValues({}))
