"""Values and FX graphs as JSON, read back without running anything the format does not name.

Every value is a JSON scalar, a list, or a one-key object whose key says what it is
(``{"tuple": [...]}``, ``{"dtype": "float32"}``, ``{"node": "add_1"}``,
``{"@": "OutputInfo", ...}``). Decoding accepts only these tags; a graph's call targets
are resolved only against ``torch.ops`` namespaces in :data:`OP_NAMESPACES` and the
Python functions in :data:`PY_TARGETS`; dataclasses only against :data:`CLASSES`.
Anything else raises :class:`~aotgrad.errors.ExportFormatError` before a graph is built.

A symbolic size (a sympy expression, :mod:`.symbolic`) is data only where the reader asks for
it (``symbolic=True``: the disk cache, whose entries may be dynamic); an export artifact is static.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re

import sympy
import torch
import torch.fx as fx

from .._torch import OpOverload, append_node, lazy_graph_module
from ..errors import ExportFormatError
from ..ir.graphs import Ref, Unserializable, dump_graph
from ..partition.blocks import BlockPart
from . import sandbox, symbolic as exprs

OP_NAMESPACES = ("aten", "prims", "aotgrad")
# The Python functions a static graph calls (sandbox.PY_FUNCTIONS): a multi-output op's element, and
# arithmetic on numbers a step reads with ``.item()``. Size arithmetic (``math.ceil``) appears only in
# symbolic graphs, which export refuses.
PY_TARGETS = {("_operator", f.__name__): f for f in sandbox.PY_FUNCTIONS}
# A symbolic graph's size arithmetic (the disk cache keeps dynamic graphs; an artifact is static).
SIZE_TARGETS = {**PY_TARGETS, **{(f.__module__ if f.__module__ != "operator" else "_operator", f.__name__): f
                                 for f in sandbox.SIZE_FUNCTIONS}}
DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEVICE = re.compile(r"^[a-z]+(:\d+)?$")
_DOTTED = re.compile(r"^(?!__)[A-Za-z0-9_]+(\.(?!__)[A-Za-z0-9_]+)*$")   # module paths: "h.0.attn.weight"
CLASSES: dict = {}      # dataclass name -> (class, {field: check}), filled by register()


def register(cls, fields: dict) -> None:
    """A dataclass a manifest may hold (stage metadata), by class name, with a type check per field."""
    CLASSES[cls.__name__] = (cls, fields)


def check_fields(cls, values: dict, error) -> None:
    """Every field of ``cls`` present (or, written before it was added, defaulted), known and of its
    type; else ``error(sentence)``. (The format may know a field this version of ``cls`` lacks: the
    stage classes grow.)"""
    _, fields = CLASSES[cls.__name__]
    names = {f.name for f in dataclasses.fields(cls)}
    if names - set(fields):
        raise error(f"{cls.__name__} has fields {sorted(names - set(fields))} the export format does not know")
    defaulted = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for name in names:
        if name not in values and name in defaulted:
            continue        # written before the field was added: its default
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
        return items if isinstance(v, list) else {"tuple": items}
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
    if isinstance(v, sympy.Basic):
        return exprs.encode(v)
    if dataclasses.is_dataclass(v) and CLASSES.get(type(v).__name__, (None,))[0] is type(v):
        values = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        check_fields(type(v), values, Unserializable)
        return {"@": type(v).__name__, **{k: encode(x) for k, x in values.items()}}
    raise Unserializable(f"a value of type {type(v).__name__} ({_short(v)})")


def _short(v) -> str:
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


def decode(v, env=None, symbolic=False):
    """The value ``encode`` wrote; ``env`` maps node names to graph nodes; ``symbolic`` admits
    symbolic sizes (sympy expressions)."""
    t = type(v)
    if v is None or t is int or t is str or t is bool or t is float:
        return v
    if t is list:
        return [decode(x, env, symbolic) for x in v]
    if t is not dict or not v:
        raise ExportFormatError(f"the artifact holds a value the format does not define: {_short(v)}")
    if "@" in v:
        return _decode_dataclass(v, env, symbolic)
    if len(v) != 1:
        raise ExportFormatError(f"the artifact holds a value the format does not define: {_short(v)}")
    (tag, x), = v.items()
    if tag == "node" and env is not None and type(x) is str and x in env:      # most of a graph's arguments
        return env[x]
    return _decode_tagged(tag, x, env, symbolic)


def _decode_tagged(tag, x, env, sym):
    if tag == "tuple" and isinstance(x, list):
        if all(type(i) is int for i in x):      # sizes and strides: most of what a graph's values hold
            return tuple(x)
        return tuple([decode(i, env, sym) for i in x])
    if tag == "dict" and isinstance(x, dict) and env is None:     # in graphs only as kwargs (keys become code)
        return {k: decode(i, env, sym) for k, i in x.items()}
    if tag == "slice" and isinstance(x, list) and len(x) == 3:
        return slice(*(decode(i, env, sym) for i in x))
    if tag in exprs.TAGS:
        if not sym:
            raise ExportFormatError(f"the artifact holds a symbolic size ({_short(x)}); an exported step is static")
        return exprs.decode(tag, x, ExportFormatError)
    if tag == "float" and x in ("inf", "-inf", "nan"):
        return float(x)
    if tag == "device" and isinstance(x, str) and _DEVICE.match(x):
        try:
            return torch.device(x)
        except RuntimeError:
            pass
    for name, table in (("dtype", DTYPES), ("layout", _LAYOUTS), ("memory_format", _FORMATS)):
        if tag == name and x in table:
            return table[x]
    raise ExportFormatError(f"the artifact holds a {tag!r} value the format does not define: {_short(x)}")


def _decode_dataclass(v, env, sym):
    cls = CLASSES.get(v["@"], (None,))[0] if isinstance(v["@"], str) else None
    if cls is None:
        raise ExportFormatError(f"the artifact names a class {_short(v['@'])} the format does not define")
    fields = {k: decode(x, env, sym) for k, x in v.items() if k != "@"}
    if set(fields) - {f.name for f in dataclasses.fields(cls)}:
        raise ExportFormatError(f"the artifact's {cls.__name__} has fields this aotgrad does not know")
    check_fields(cls, fields, ExportFormatError)
    return cls(**fields)


def encode_graph(gm: fx.GraphModule, tensors: dict, prefix: str, symbolic: bool = False) -> dict:
    """A graph as JSON; tensors its ``get_attr`` nodes read go into ``tensors`` under ``prefix``.
    ``symbolic`` admits a dynamic graph's size arithmetic and symbolic node values."""
    parts: dict = {}       # name -> a repeated block's half the graph calls (partition.blocks)
    data = dump_graph(gm, lambda t: _block_out(t, parts))
    nodes, dropped = [], set()
    for n, (op, name, target, args, kwargs) in zip(gm.graph.nodes, data["nodes"]):
        if op == "call_function" and target[0] == "op" and target[1] in _PROFILER_RANGES:
            dropped.add(name)       # a profiler range (``Optimizer.step#AdamW.step``): no value, no effect
            continue
        if dropped and _names_in((args, kwargs)) & dropped:
            raise Unserializable(f"graph node {name} uses a profiler range's handle")
        if op == "call_function" and target[0] == "block":
            target = {"block": target[1]}
        elif op == "call_function":
            target = _encode_target(target, symbolic)
            if n.target in sandbox.ARITHMETIC and not _numbers(n.target, n.args, n.kwargs):
                raise Unserializable(f"graph node {name}: {n.target.__name__} of two integers or of other values")
        nodes.append([op, name, target, _encode_refs(args), {"dict": {k: _encode_refs(v) for k, v in kwargs.items()}}])
    for target, value in data["attrs"].items():
        tensors[f"{prefix}{target}"] = value
    traces = {n.name: n.meta["stack_trace"] for n in gm.graph.nodes if isinstance(n.meta.get("stack_trace"), str)}
    values = {name: encode(v) for name, (v, _) in data["meta"].items()
              if name not in dropped and _stored_value(v, symbolic)}
    out = {"nodes": nodes, "attrs": sorted(data["attrs"]), "class": data["class"], "traces": traces, "values": values}
    if data["symbols"]:
        if not symbolic:
            raise Unserializable("a graph with symbolic sizes")
        out["symbols"] = data["symbols"]
    if parts:
        out["blocks"] = {name: encode_graph(p.gm, tensors, f"{prefix}{name}/", symbolic) for name, p in parts.items()}
    return out


def _block_out(t, parts: dict):
    """``("block", name)`` for a call of a repeated block's half (its graph goes into ``blocks``)."""
    if type(t) is not BlockPart:
        return None
    parts.setdefault(t.__name__, t)
    return ("block", t.__name__, None)


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


def _stored_value(v, symbolic: bool) -> bool:
    """A node value as static ``TensorMeta`` data (memory estimates, printed shapes), or with sizes as
    checked sympy text where ``symbolic``; a value that is neither (an opaque object) is left out."""
    from ..ir.values import SymText, TensorMeta
    if isinstance(v, (list, tuple)):
        return all(_stored_value(x, symbolic) for x in v)
    if type(v) is TensorMeta:
        return all(type(s) is int or symbolic and exprs.text_ok(s) for s in (*v.shape, *v.stride, v.offset))
    if type(v) is SymText:
        return symbolic and exprs.text_ok(v.expr)
    return v is None or type(v) in (bool, int, float)


def _encode_target(spec, symbolic: bool) -> dict:
    kind, a, b = spec
    if kind == "op":
        op = _overload(a, b)
        why = sandbox.refusal(op) if op is not None else "it is not an operator overload"
        if why is not None:
            raise Unserializable(f"a graph that calls {a}.{b}: {why} (docs/export-format.md, the operator allowlist)")
        return {"op": f"{a}.{b}"}
    module = "_operator" if a == "operator" else a
    if (module, b) not in (SIZE_TARGETS if symbolic else PY_TARGETS):
        raise Unserializable(f"graph target {a}.{b}")
    return {"py": f"{module}.{b}"}


def _encode_refs(v):
    if isinstance(v, Ref):
        return {"node": v.name}
    if isinstance(v, (list, tuple)):
        items = [_encode_refs(x) for x in v]
        return items if isinstance(v, list) else {"tuple": items}
    if isinstance(v, dict):
        raise Unserializable("a graph node with a dict argument")
    if isinstance(v, slice):
        return {"slice": [_encode_refs(v.start), _encode_refs(v.stop), _encode_refs(v.step)]}
    return encode(v)


def decode_graph(data: dict, tensors: dict, prefix: str, values=None, symbolic: bool = False) -> fx.GraphModule:
    """The graph ``encode_graph`` wrote: every call target resolved through :func:`resolve_target`.
    ``values`` (a ``FakeValues``) rebuilds its node values, shared by graphs that share symbols."""
    graph, env = fx.Graph(), {}
    parts = _Parts(data.get("blocks", {}), tensors, prefix, values, symbolic)
    try:
        for op, name, target, args, kwargs in data["nodes"]:
            if not isinstance(name, str) or not _IDENT.match(name) or name in env:
                raise ExportFormatError(f"a graph node is named {_short(name)}, not a fresh identifier")
            a, k = decode(args, env, symbolic), _decode_kwargs(kwargs, env, symbolic)
            if op == "placeholder" and isinstance(target, str) and _IDENT.match(target) and not target.startswith("__"):
                node = graph.create_node("placeholder", target, name=name)     # the target is the parameter name
            elif op == "output":
                node = graph.output(a[0])
            elif op == "get_attr" and isinstance(target, str) and _DOTTED.match(target) and target in data["attrs"]:
                node = graph.create_node("get_attr", target, name=name)
            elif op == "call_function" and isinstance(a, tuple) and isinstance(k, dict):
                # Arguments are decoded nodes and constants (no raw symbolic value): appended without fx's scan.
                node = append_node(graph, "call_function", name, _checked_call(name, target, a, k, symbolic, parts), a, k)
            else:
                raise ExportFormatError(f"graph node {name} has an operation the format does not define ({_short(op)})")
            if op != "output":
                node._rename(name)
            env[name] = node
        traces = data.get("traces", {})
        for n in graph.nodes:       # the user's source lines, as text (inspect and saved-activation tables)
            if isinstance(traces.get(n.name), str):
                n.meta["stack_trace"] = traces[n.name]
        gm = lazy_graph_module(_attr_root(data["attrs"], tensors, prefix), graph, _ident(data["class"]))
        _keep_values(gm, env, data.get("values", {}), values, symbolic and data.get("symbols", {}))
        return gm
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ExportFormatError(f"a graph in the artifact is malformed ({type(e).__name__}: {_short(str(e))})") from None


def _checked_call(name, target, a, k, symbolic, parts):
    """The function a node calls, where its arguments are ones it may take. (Named as it is made: an
    automatic name (``getitem_15``) taken first and renamed after would keep a later node from getting
    that very name.)"""
    if isinstance(target, dict) and set(target) == {"block"}:
        if not (len(a) == 1 and isinstance(a[0], list) and all(isinstance(x, fx.Node) for x in a[0]) and not k):
            raise ExportFormatError(f"graph node {name} calls a block's half with other than one list of nodes")
        return parts.get(target["block"])
    fn = resolve_target(target, symbolic)
    if fn is operator.getitem and not (len(a) == 2 and isinstance(a[0], fx.Node) and type(a[1]) is int and not k):
        raise ExportFormatError(f"graph node {name} takes an element of something other than a node's result")
    if fn in sandbox.ARITHMETIC and not _numbers(fn, a, k):
        raise ExportFormatError(f"graph node {name} calls {fn.__name__} on something other than one or two numbers "
                                "(a power needs a float constant operand)")
    return fn


class _Parts:
    """The halves of repeated blocks a stored graph calls (its ``blocks``), each decoded once, by the
    same rules as the graph (a half calls no block)."""
    _NAME = re.compile(r"^block(\d{1,9})_(forward|backward)$")

    def __init__(self, stored, tensors, prefix, values, symbolic):
        if not isinstance(stored, dict):
            raise ExportFormatError("a graph's blocks are not a table of graphs")
        self.stored, self.args, self.made = stored, (tensors, prefix, values, symbolic), {}

    def get(self, name) -> BlockPart:
        m = self._NAME.match(name) if isinstance(name, str) else None
        if m is None or name not in self.stored:
            raise ExportFormatError(f"a graph calls a block's half {_short(name)} it does not hold; nothing was run")
        if name not in self.made:
            tensors, prefix, values, symbolic = self.args
            data = self.stored[name]
            if not isinstance(data, dict) or data.get("blocks"):
                raise ExportFormatError(f"the block's half {name} is not a graph, or calls another block")
            self.made[name] = BlockPart(int(m[1]), m[2], decode_graph(data, tensors, f"{prefix}{name}/", values,
                                                                      symbolic))
        return self.made[name]


def _numbers(fn, a: tuple, k: dict) -> bool:
    """Arithmetic on nodes and number constants only; a power with a float constant operand (a power of
    two integers read from a file could be made to take forever)."""
    if k or len(a) != (1 if fn is operator.neg else 2) \
            or not all(isinstance(x, fx.Node) or type(x) in (int, float) for x in a):
        return False
    return fn is not operator.pow or any(type(x) is float for x in a)


def _decode_kwargs(data, env, symbolic=False) -> dict:
    """A node's keyword arguments: identifier keys (FX and our code generator write them as code)."""
    if not (isinstance(data, dict) and set(data) == {"dict"} and isinstance(data["dict"], dict)
            and all(isinstance(k, str) and _IDENT.match(k) for k in data["dict"])):
        raise ExportFormatError(f"a graph node's keyword arguments {_short(data)} are not identifiers and values")
    return {k: decode(v, env, symbolic) for k, v in data["dict"].items()}


def _ident(name) -> str:
    """The graph's class name, where it is an identifier or ``<lambda>`` (make_fx's name for some)."""
    return name if isinstance(name, str) and (_IDENT.match(name) or name == "<lambda>") else "ExportedGraph"


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


def resolve_target(spec, symbolic: bool = False):
    """An operator overload the allowlist admits (``sandbox.refusal``) or ``operator.getitem``, by name."""
    if isinstance(spec, dict) and set(spec) == {"op"} and isinstance(spec["op"], str):
        return _allowed_op(spec["op"])
    if isinstance(spec, dict) and set(spec) == {"py"} and isinstance(spec["py"], str):
        module, _, name = spec["py"].partition(".")
        table = SIZE_TARGETS if symbolic else PY_TARGETS
        if (module, name) in table:
            return table[(module, name)]
    raise ExportFormatError(f"graph target {_short(spec)} is not an operator or function the format allows; "
                            "nothing was run")


@functools.lru_cache(maxsize=4096)
def _allowed_op(name: str):
    """The operator ``name`` names, where it exists and the allowlist admits it (once per name: a
    stored graph calls a few dozen operators a thousand times)."""
    qualified, _, overload = name.partition(".")
    op = _overload(qualified, overload)
    if op is None:
        raise ExportFormatError(f"operator {_short(name)} does not exist in this torch {torch.__version__} or is not "
                                "one the format allows; export the step again with this torch; nothing was run")
    why = sandbox.refusal(op)
    if why is not None:
        raise ExportFormatError(f"the artifact's graphs call {name}, which a loaded step may not run: {why} "
                                "(docs/export-format.md, the operator allowlist); nothing was run")
    return op


def spec_text(spec, what: str = "output") -> str:
    """A pytree structure as text (``treespec_dumps``: a reader builds only registered types)."""
    from .._torch import pytree
    try:
        return pytree.treespec_dumps(spec)
    except NotImplementedError as e:     # a namedtuple or pytree class registered without a serialized name
        raise Unserializable(f"an {what} structure pytree cannot write as text ({e})") from None


def op_schemas(graphs) -> dict:
    """``{operator name: schema text}`` of every operator the graphs call (checked on load)."""
    return {f"{n.target._schema.name}.{n.target._overloadname}": str(n.target._schema)
            for gm in graphs for n in gm.graph.nodes
            if isinstance(n.target, OpOverload) and n.target._schema.name not in _PROFILER_RANGES}


def _keep_values(gm: fx.GraphModule, env: dict, stored, values, symbols) -> None:
    """Node values as data, rebuilt as fake tensors when something reads them (``values.with_values``);
    ``symbols`` (each symbol's example value) where the graph may be symbolic, else False."""
    from ..ir.values import STORED, FakeValues, keep
    if not isinstance(stored, dict) or not set(stored) <= set(env):
        raise ExportFormatError("a graph's node values name nodes it does not have")
    if symbols is not False and not (isinstance(symbols, dict) and all(
            exprs.text_ok(k) and type(v) is int for k, v in symbols.items())):
        raise ExportFormatError("a graph's symbols are not names with example sizes")
    for name, data in stored.items():
        value = _static_meta(data)
        if value is None:
            value = decode(data)
        if not _stored_value(value, symbols is not False):
            raise ExportFormatError(f"the value of graph node {name} is not a static tensor description")
        env[name].meta[STORED] = value
    keep(gm, values if values is not None else FakeValues(symbols or {}))


_META_FIELDS = frozenset({"@", "shape", "stride", "offset", "dtype", "device", "requires_grad"})


def _static_meta(data):
    """A static ``TensorMeta`` (most node values) read directly, with the checks ``decode`` and the schema
    make; None for anything else, which ``decode`` reads."""
    from ..ir.values import TensorMeta
    if not (type(data) is dict and data.get("@") == "TensorMeta" and data.keys() == _META_FIELDS):
        return None
    shape, stride, dtype, device = data["shape"], data["stride"], data["dtype"], data["device"]
    ints = (shape.get("tuple") if type(shape) is dict and len(shape) == 1 else None,
            stride.get("tuple") if type(stride) is dict and len(stride) == 1 else None)
    if not all(type(v) is list and all(type(i) is int for i in v) for v in ints) or type(data["offset"]) is not int \
            or type(data["requires_grad"]) is not bool or not (type(dtype) is dict and dtype.keys() == {"dtype"}
                                                              and dtype["dtype"] in DTYPES) \
            or not (type(device) is str and _DEVICE.match(device)):
        return None
    return TensorMeta(tuple(ints[0]), tuple(ints[1]), data["offset"], DTYPES[dtype["dtype"]], device,
                      data["requires_grad"])
