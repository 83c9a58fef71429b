"""The disk cache's keys: what a compiled entry assumed, as data that holds in another process.

A ``jit`` compile is found in two steps (the files: :mod:`aotgrad.store.disk`). ``jit_key``, computed
before capture, names an *index* from what is known then: the function's own code, a module's
classes, structure and parameter metadata, the structure and metadata of the inputs, the modes, the
options, the versions of torch and of aotgrad's source. The index lists stored entries, each with the
reads its trace made (:mod:`aotgrad.guards.state`: globals, closure cells, module attributes, hooks,
the code of every function reached) as paths and fingerprints of their values (``read_fp``). A lookup
resolves those paths again in this process and loads an entry only when every fingerprint matches
and the objects reached are the same ones among themselves (``identities``: fingerprints describe
structure, which two objects share, and a trace may compare identities): the same record the
in-memory guards check, so the disk cache and the guards cannot disagree about what a graph assumed.
Anything the fingerprint cannot describe as data makes the call uncacheable rather than risking a
stale graph; and a loaded entry's guards still check every call.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import sys
import tokenize
import types
from pathlib import Path

import torch

from .._torch import OpOverload, OpOverloadPacket, pytree
from ..runtime.call import float_bits
from .reads import LIBRARY, kind_of

log = logging.getLogger("aotgrad.cache")


class Uncacheable(Exception):
    """The fingerprint met a value it cannot describe as data."""


# Code whose contents the key's versions fix: named, not fingerprinted. Python's standard library,
# aotgrad's source, torch (torchgen ships with it) and the packages torch itself runs while it traces
# (``_DEPENDENCIES``: their versions are in every key). Every other library's code is fingerprinted
# by its contents, like the user's.
_DEPENDENCIES = {"numpy": "numpy", "sympy": "sympy", "mpmath": "mpmath", "networkx": "networkx",
                 "jinja2": "jinja2", "markupsafe": "MarkupSafe", "fsspec": "fsspec", "filelock": "filelock",
                 "typing_extensions": "typing_extensions", "triton": "triton"}
_PINNED = frozenset(("torch", "torchgen", "aotgrad", *_DEPENDENCIES, *sys.stdlib_module_names,
                     "_distutils_hack", "setuptools", "pkg_resources"))      # import hooks an import in a trace runs
_HEAPTYPE = 1 << 9                  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement
_DICT_STATE = (types.SimpleNamespace, functools.partial)    # C types whose state the reads read
_DATA_LIMIT = 1 << 16               # bytes of an array or buffer fingerprinted by value
_source_hash: str | None = None


# The parts of aotgrad whose code decides what a compiled entry contains or does.
_KEYED_SOURCES = ("backends", "capture", "export", "frontend", "guards", "inputs", "ir", "partition",
                  "passes", "runtime", "store", "tracing", "_torch.py", "compile.py", "stages.py", "options.py")


def aotgrad_source_hash() -> str:
    """Hash of the aotgrad source that produces and runs entries: a changed compiler
    never loads an old entry (observability and CLI code are left out)."""
    global _source_hash
    if _source_hash is None:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parent.parent
        for part in _KEYED_SOURCES:
            paths = [root / part] if part.endswith(".py") else sorted((root / part).rglob("*.py"))
            for p in paths:
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
        _source_hash = h.hexdigest()
    return _source_hash


@functools.cache
def _dependency_versions() -> tuple:
    out = []
    for dist in _DEPENDENCIES.values():
        try:
            out.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(out)


def _versions() -> tuple:
    return (sys.version, torch.__version__, _dependency_versions(), aotgrad_source_hash())


def digest(*parts) -> str:
    return hashlib.sha256(repr(("aotgrad-cache", 2, *_versions()) + parts).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class JitKey:
    """The index a ``jit`` compile is stored under, and its parts' digests: ``explain`` names the
    parts that differ from the newest entry stored for the same program (``name``)."""
    digest: str
    name: str
    parts: tuple        # ((label, fingerprint), ...)


_KEY_LABELS = ("the code of the function or the module's classes, structure and parameter metadata",
               "the structure and metadata of the inputs", "the grad and autocast modes",
               "the default dtype, autocast dtypes or deterministic algorithms", "dynamic=", "the dynamic dimensions",
               "the compile options", "the versions of Python, torch, its dependencies or aotgrad's source")


def jit_key(fn, args, kwargs, *, modes, dynamic, dynamic_dims, options) -> JitKey | None:
    """The key of one ``jit`` compile, or None when something in it cannot be fingerprinted."""
    try:
        program = _module_fp(fn, {}) if isinstance(fn, torch.nn.Module) else _program_fp(fn)
        parts = (program, _inputs(args, kwargs, _state(fn)), modes, _global_state(), dynamic,
                 sorted((i, sorted(d)) for i, d in dynamic_dims.items()), _options(options))
    except Uncacheable as e:
        log.info("not caching %s on disk: %s", getattr(fn, "__name__", type(fn).__name__), e)
        return None
    kind = type(fn) if isinstance(fn, torch.nn.Module) else fn
    name = f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', type(kind).__qualname__)}"
    labelled = tuple(zip(_KEY_LABELS, (*parts, _versions())))
    return JitKey(digest("jit", parts), name, labelled)


def code_fp(code: types.CodeType) -> str:
    """A digest of what ``code`` does, equal in every process: its bytecode, names, flags and
    constants (nested code by its own digest, sets in the order they iterate), not its line numbers;
    and where the code builds a set, the process's string hash seed (:func:`_in_order`).
    (``marshal.dumps`` is not: it flags objects by their reference counts, which differ between
    processes, so a second process missed every entry whose code built a generator or a set.)"""
    return hashlib.sha256(repr(_code_parts(code)).encode()).hexdigest()


def _code_parts(code):
    builds_sets = not _SET_OPS.isdisjoint(code.co_code[::2]) or not _SET_NAMES.isdisjoint(code.co_names)
    return (code.co_code, tuple(_const(c) for c in code.co_consts), code.co_names, code.co_varnames,
            code.co_freevars, code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
            code.co_kwonlyargcount, code.co_flags, getattr(code, "co_qualname", code.co_name),
            *([_HASH_SEED] if builds_sets else []))


# A set of strings or bytes iterates in an order its items' hashes decide, which the process's hash seed
# (random in each process unless PYTHONHASHSEED is set) changes: code that builds a set, and a set a read
# holds, are the same in another process only under the same seed (a loop over one, traced, is unrolled
# in this process's order).
_SET_OPS = frozenset(dis.opmap[n] for n in ("BUILD_SET", "SET_ADD", "SET_UPDATE"))
_SET_NAMES = frozenset(("set", "frozenset"))
_HASH_SEED = ("string hash seed", hash("aotgrad: the string hash seed"))


def _in_order(items, fp) -> tuple:
    """A set's items (fingerprinted by ``fp``) in the order it iterates, with the hash seed where that
    order is the seed's."""
    out = tuple(fp(x) for x in items)
    return (*out, _HASH_SEED) if any(map(_seeded, items)) else out


def _seeded(x) -> bool:
    """Whether ``x``'s hash is the string hash seed's: a string, bytes, or a tuple or frozenset holding one."""
    return isinstance(x, (str, bytes)) or isinstance(x, (tuple, frozenset)) and any(map(_seeded, x))


def _const(c):
    if isinstance(c, types.CodeType):
        return ("code", _code_parts(c))
    if isinstance(c, frozenset):
        return ("frozenset", _in_order(c, _const))
    if isinstance(c, tuple):
        return ("tuple", tuple(_const(x) for x in c))
    return (type(c).__name__, float_bits(c) if isinstance(c, float) else repr(c))


def _program_fp(fn):
    """The jitted function itself; what it reads (globals, cells, defaults) is in the entry's record."""
    if isinstance(fn, types.FunctionType):
        return ("function", fn.__module__, fn.__qualname__, code_fp(fn.__code__))
    return _value_fp(fn)


def _value_fp(v):
    """A value a trace read, as data: plain values, containers, buffers and arrays by value, code by
    its contents, an object of Python classes by its class (what the trace read of it are reads of
    their own). Anything else cannot be checked in another process: ``Uncacheable``."""
    if isinstance(v, torch.nn.Module):
        return ("nn.Module", _class_fp(type(v), {}))
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    if isinstance(v, types.FunctionType) and not _is_lib(v):
        return _function_value_fp(v)
    if isinstance(v, (staticmethod, classmethod)):
        return (type(v).__name__, _value_fp(v.__func__))
    if isinstance(v, property):
        return ("property", _value_fp(v.fget), _value_fp(v.fset), _value_fp(v.fdel))
    if isinstance(v, types.MethodType):
        return ("method", _value_fp(v.__func__), type(v.__self__).__qualname__)
    if isinstance(v, types.CodeType):
        return ("code", code_fp(v))
    if isinstance(v, functools.partial):     # called by C code no read sees: what it calls, and with what
        return ("partial", _value_fp(v.func), _value_fp(v.args), _value_fp(v.keywords), _value_fp(vars(v)))
    if isinstance(v, (set, frozenset)):
        return (_type_name(type(v)), _in_order(v, _value_fp))
    if isinstance(v, (tuple, list, dict, collections.deque)) and not isinstance(v, enum.Enum):
        items = v.items() if isinstance(v, dict) else v
        maxlen = (v.maxlen,) if isinstance(v, collections.deque) else ()
        return (_type_name(type(v)), *maxlen, tuple(_value_fp(x) for x in items))
    try:
        return _fp(v, {})
    except Uncacheable:
        if _plain_object(v):
            return ("object", type(v).__module__, type(v).__qualname__)
        wrapped = getattr(v, "__wrapped__", None)
        if callable(v) and wrapped is not None and _is_lib(type(v)):     # ``functools.lru_cache(f)``
            return ("wrapper", _type_name(type(v)), _value_fp(wrapped))
        raise


def _function_value_fp(fn):
    """A function a read saw: its code, defaults and what a decorator wraps; an installed library's
    (whose cells no read follows) also what its cells hold."""
    parts = _program_fp(fn) + (_value_fp(fn.__defaults__), _value_fp(fn.__kwdefaults__))
    wrapped = vars(fn).get("__wrapped__")
    if wrapped is not None:
        parts += (("wraps", _value_fp(wrapped)),)
    if fn.__closure__ and kind_of(fn.__code__, fn.__module__) == LIBRARY:
        parts += (("cells", tuple(map(_cell_fp, fn.__closure__))),)
    return parts


def _cell_fp(c):
    try:
        v = c.cell_contents
    except ValueError:          # empty
        return None
    if isinstance(v, type):     # ``__class__`` of a method calling ``super()``: its own code is read where it runs
        return ("class", _type_name(v))
    if isinstance(v, types.FunctionType):       # what a decorator wraps (itself, when recursive: not its cells)
        return _program_fp(v) + (_value_fp(v.__defaults__),)
    return _value_fp(v)


def _plain_object(v) -> bool:
    """An object whose state is its ``__dict__`` alone (its classes are Python classes, or a
    namespace): the reads of its attributes check it. A ``deque`` subclass's items, an exception's
    arguments, a C type's fields are not there."""
    if not isinstance(getattr(v, "__dict__", None), dict) or isinstance(v, type):
        return False
    return isinstance(v, _DICT_STATE) or all(c is object or c.__flags__ & _HEAPTYPE for c in type(v).__mro__)


def _type_name(t) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _data_fp(v):
    """Values whose contents are not attributes: an enum member by its value, byte buffers and
    arrays (``bytearray``, ``array.array``, NumPy arrays and scalars) by their bytes; None for others."""
    if isinstance(v, enum.Enum):
        return ("enum", _type_name(type(v)), v.name, _fp(v.value, {}))
    if isinstance(v, (bytearray, array.array, memoryview)):
        data = bytes(v) if isinstance(v, bytearray) else v.tobytes()
        if len(data) > _DATA_LIMIT:
            raise Uncacheable(f"a {type(v).__qualname__} of {len(data)} bytes is too large to fingerprint")
        return (_type_name(type(v)), getattr(v, "typecode", None) or getattr(v, "format", None), getattr(v, "shape", None),
                "sha256 " + hashlib.sha256(data).hexdigest())
    np = sys.modules.get("numpy")
    if np is not None and isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        if a.dtype.hasobject or a.nbytes > _DATA_LIMIT or not isinstance(v, np.generic) and type(v) is not np.ndarray:
            raise Uncacheable(f"a NumPy {type(v).__qualname__} of {a.dtype} ({a.nbytes} bytes) cannot be fingerprinted")
        return ("numpy", _type_name(type(v)), str(a.dtype), a.shape,
                "sha256 " + hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
    return None


def read_fp(read):
    """The fingerprint of one read of a trace (``state.Read``) for the disk cache."""
    from .state import _thaw
    if read.kind in ("absent", "len", "empty"):
        return (read.kind, read.value)
    if read.kind == "dict":
        return ("dict", tuple((repr(k), _value_fp(v)) for k, v in read.value.items()))
    return (read.kind, _value_fp(_thaw(read.value) if read.kind == "frozen" else read.value))


def identities(reads) -> tuple:
    """Which of the objects the reads reached are one object: for each object a read's value is or
    holds (in a list, tuple or dict), the number of the place it was first seen. Fingerprints describe
    objects by structure, which two objects share, while a trace may compare identities
    (``REGISTRY[0] is self``): an entry is used only where the same reads are the same objects."""
    from .state import _thaw
    first, seen = {}, []

    def walk(v):
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)) or _data_fp_safe(v):
            return      # values (a frozen read's buffer or array is a copy: its id means nothing)
        if isinstance(v, (tuple, list, dict, collections.deque)):
            for x in (v.values() if isinstance(v, dict) else v):
                walk(x)
            return
        seen.append(first.setdefault(id(v), len(first)))
    for r in reads:
        if r.kind not in ("absent", "len", "empty"):
            walk(_thaw(r.value) if r.kind == "frozen" else r.value)
    return tuple(seen)


def _data_fp_safe(v) -> bool:
    try:
        return not isinstance(v, enum.Enum) and _data_fp(v) is not None
    except Uncacheable:
        return True


def library_code(rec) -> list:
    """Reads of the installed libraries' code the trace ran (its ``LIBRARY`` frames): each the function,
    method or property holding the code, read where its module or class defines it. In this process
    they hold that object by identity (a library function patched in place); in another, by its
    contents (a library upgraded or edited between the processes). Code a fresh process cannot find
    (a class made at run time, a name rebound) gets no path: the entry is not stored on disk."""
    from .state import Read
    from .writes import held_dict
    out: dict = {}
    for f in rec.frames.values():
        if f.kind == LIBRARY and f.globals is not None and not _is_lib_module(f.globals.get("__name__")):
            r = _code_read(f.code, f.globals, Read)
            out.setdefault((id(held_dict(r.where)), r.key), r)
    return list(out.values())


def process_answers(rec) -> list:
    """Each ``id()`` or ``hash()`` call of the user's code: its answer (an address, a string's hash under
    this process's seed) holds in this process alone, so the entry gets a read without a path, which
    keeps it off the disk."""
    from .state import Read
    return [Read(f"`{fn.__name__}()` at {code.co_filename}:{line} (this process's answer)", None, _Ran(fn), "code",
                 fn, "id") for fn, code, line in dict.fromkeys(rec.process_local)]


class _Ran:
    """Where code that a fresh process cannot find is held (its guard always holds in this process)."""
    __slots__ = ("code",)

    def __init__(self, code):
        self.code = code


def _code_read(code, g, Read):
    module = g.get("__name__")
    qualname = getattr(code, "co_qualname", code.co_name)
    first, *rest = qualname.split(".<locals>")[0].split(".")
    where, key, value = g, first, g.get(first, _Ran)
    path = ("G", module, ("attr", first)) if isinstance(module, str) and sys.modules.get(module) is not None \
        and vars(sys.modules[module]) is g else None
    for part in rest:
        d = getattr(value, "__dict__", None)
        if not isinstance(value, type) or part not in d:
            value = _Ran
            break
        where, key, value = d, part, d[part]
        path = path + (("own", part),) if path else None
    if value is _Ran or code not in _codes_in(value, 0):
        return Read(f"the library code {module}.{qualname}", None, _Ran(code), "code", code, "id")
    return Read(f"{module}.{qualname.split('.<locals>')[0]}", path, where, key, value, "id")


def _codes_in(v, depth) -> set:
    """The code objects a function (a method, a property, a decorated function) runs, nested code included."""
    if depth > 4:
        return set()
    if isinstance(v, (staticmethod, classmethod)):
        return _codes_in(v.__func__, depth + 1)
    if isinstance(v, property):
        return set().union(*(_codes_in(f, depth + 1) for f in (v.fget, v.fset, v.fdel)))
    found = set()
    code = getattr(v, "__code__", None)
    if isinstance(code, types.CodeType):
        todo = [code]
        while todo:
            c = todo.pop()
            found.add(c)
            todo += [x for x in c.co_consts if isinstance(x, types.CodeType)]
    wrapped = getattr(v, "__wrapped__", None) if callable(v) else None
    return found | (_codes_in(wrapped, depth + 1) if wrapped is not None else set())


def _failed_read(reads, record) -> str | None:
    """The first read whose fingerprint differs from the stored one, with both values."""
    for r, (*_, fp) in zip(reads, record):
        try:
            now = read_fp(r)
        except Uncacheable as e:
            return f"`{r.source}` cannot be fingerprinted now ({e})"
        if now != fp:
            where, was, new = _difference(fp, now)
            at = f" (at {where})" if where else ""
            return f"`{r.source}` was {_text(was)} when stored, now {_text(new)}{at}"
    return None


def _difference(a, b, where=""):
    """``(name, a_part, b_part)``: the innermost parts of two fingerprints that differ, named by the
    nearest enclosing function or class (``examples.models.Block.forward``)."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        if len(a) > 2 and a[:1] == b[:1] and a[0] in ("function", "class") and a[1:3] == b[1:3]:
            where = f"{a[1]}.{a[2]}"
        for x, y in zip(a, b):
            if x != y:
                return _difference(x, y, where)
    return where, a, b


def _text(fp) -> str:
    text = fp[1] if isinstance(fp, tuple) and len(fp) == 2 and isinstance(fp[1], str) else repr(fp)
    if isinstance(fp, str) and len(fp) == 64:
        text = f"code {fp[:12]}"
    return text if len(text) <= 80 else text[:77] + "..."


def dynamo_key(gm, descs, example_inputs, modes, options) -> str | None:
    """The key of a graph Dynamo hands the backend: its nodes, targets and example values as data
    (``graph_fp``), what the placeholders are, the modes and options; None when some part is not
    data or a size is symbolic (a trace's shape guards go to Dynamo's shape environment, which a
    loaded entry would not add)."""
    if any(isinstance(s, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
           for s in (*t.shape, *t.stride(), t.storage_offset())) or any(isinstance(t, torch.SymInt) for t in example_inputs):
        log.info("not caching a Dynamo graph on disk: it has symbolic sizes")
        return None
    try:
        parts = (graph_fp(gm), tuple(map(str, descs)), _inputs(example_inputs, {}), modes, _global_state(),
                 _options(options))
    except Uncacheable as e:
        log.info("not caching a Dynamo graph on disk: %s", e)
        return None
    return digest("dynamo", parts)


def graph_fp(gm) -> tuple:
    """An FX graph as data, one entry per node: op, name, target, arguments, example value."""
    from ..ir.values import value_out
    nodes = []
    for n in gm.graph.nodes:
        target = n.target
        if n.op == "call_function":
            target = _target_fp(target)
        elif n.op == "get_attr":
            target = (target, _attr_fp(gm, target))
        elif n.op == "call_module":
            raise Uncacheable(f"the graph calls the module {target!r}")
        meta = n.meta.get("example_value", n.meta.get("val"))
        value = value_out(meta, {})
        if value is None and isinstance(meta, torch.Tensor):
            raise Uncacheable(f"graph node {n.name}'s value cannot be described as data")
        nodes.append((n.op, n.name, target, _arg_fp(n.args), _arg_fp(n.kwargs), repr(value),
                      n.meta.get("stack_trace")))      # the user's lines that messages and reports name
    return tuple(nodes)


def _target_fp(t):
    if not isinstance(t, (types.FunctionType, OpOverload, OpOverloadPacket, types.BuiltinFunctionType)) \
            and _is_lib(type(t)) and callable(getattr(t, "name", None)):
        return ("higher-order op", type(t).__qualname__, t.name())
    return _fp(t, {})


def _attr_fp(gm, target):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.fx.GraphModule):     # a higher-order op's body: its graph and options
        return ("graph", graph_fp(value), _fp(value.meta.get("_checkpoint_context_fn"), {}))
    return _fp(value, {})


def _arg_fp(a):
    if isinstance(a, torch.fx.Node):
        return ("node", a.name)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(map(_arg_fp, a)))
    if isinstance(a, dict):
        return ("dict", tuple((repr(k), _arg_fp(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _arg_fp(a.start), _arg_fp(a.stop), _arg_fp(a.step))
    return _fp(a, {})


def _global_state() -> tuple:
    """Process-wide settings a trace reads without the guards checking them."""
    return (str(torch.get_default_dtype()), str(torch.get_autocast_dtype("cpu")), str(torch.get_autocast_dtype("cuda")),
            torch.are_deterministic_algorithms_enabled())


def _options(options):
    """The cache-key fields of a ``CompileOptions`` (a plain dict is taken as they are)."""
    options = options.cache_key() if hasattr(options, "cache_key") else options
    for k, v in options.items():
        if not isinstance(v, (str, int, float, bool, type(None))):
            raise Uncacheable(f"compile option {k}={v!r} is not a plain value")
    return sorted(options.items())


def _state(fn) -> list:
    """A module's parameters and buffers (an argument may be one of them: :func:`_inputs`)."""
    return [*fn.parameters(), *fn.buffers()] if isinstance(fn, torch.nn.Module) else []


def _inputs(args, kwargs, state=()):
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    storages: dict = {}
    objects = {id(t): k for k, t in enumerate(state)}     # one object passed twice: one stand-in (runtime.call.same_objects)
    out = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            first = storages.setdefault(leaf.untyped_storage()._cdata, len(storages))
            out.append(("tensor", type(leaf).__qualname__, _tensor_meta(leaf), leaf.is_leaf, first,
                        objects.setdefault(id(leaf), len(objects)),
                        tuple(sorted(getattr(leaf, "_dynamo_dynamic_indices", ())))))
        else:
            out.append(_fp(leaf, {}))
    return tuple(out)


def _tensor_meta(t: torch.Tensor):
    return (str(t.dtype), str(t.device), tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad)


def _tensor_value(t: torch.Tensor):
    if t.numel() > 1 << 20 or t.device.type == "meta" or t.is_sparse:
        raise Uncacheable("a large or special tensor is baked into the function")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.detach().cpu()
    return ("value", _tensor_meta(t), hashlib.sha256(bytes(data.numpy().tobytes())).hexdigest())


def _fp(v, seen: dict):
    """A description of ``v`` as nested tuples of plain values."""
    data = _data_fp(v) if type(v) not in _PLAIN_TYPES else None
    if data is not None:
        return data
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return (type(v).__name__, repr(v))
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, _in_order(v, lambda x: _fp(x, seen)))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_fp(x, seen) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((repr(k), _fp(x, seen)) for k, x in v.items()))
    if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout, slice, type(Ellipsis))):
        return (type(v).__name__, repr(v))
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    if isinstance(v, torch.nn.Module):
        raise Uncacheable("a module reached through globals or a closure: its weights would be baked in")
    if isinstance(v, torch.Tensor):
        return _tensor_value(v)
    if isinstance(v, (types.FunctionType, types.MethodType, type)) and _is_lib(v):
        return ("lib", getattr(v, "__module__", ""), getattr(v, "__qualname__", repr(v)))
    if isinstance(v, (OpOverload, OpOverloadPacket)):
        return ("op", str(v))
    if isinstance(v, _DESCRIPTORS) and _is_lib(v.__objclass__):     # ``TensorBase.relu``, ``.shape``
        return ("descriptor", v.__objclass__.__module__, v.__qualname__)
    if isinstance(v, types.BuiltinFunctionType):
        owner = getattr(v, "__self__", None)
        return ("builtin", getattr(v, "__module__", None), getattr(owner, "__name__", None), v.__qualname__)
    if isinstance(v, types.MethodType):
        return ("method", _fp(v.__func__, seen), _fp(v.__self__, seen))
    if isinstance(v, types.FunctionType):
        return _function_fp(v, seen)
    if isinstance(v, type):
        return _class_fp(v, seen)
    if dataclasses.is_dataclass(v):
        return ("dataclass", _class_fp(type(v), seen),
                tuple((f.name, _fp(getattr(v, f.name), seen)) for f in dataclasses.fields(v)))
    raise Uncacheable(f"cannot fingerprint a {type(v).__qualname__}")


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)
_DESCRIPTORS = (types.MethodDescriptorType, types.GetSetDescriptorType, types.WrapperDescriptorType,
                types.MemberDescriptorType, types.ClassMethodDescriptorType)


def _is_lib(v) -> bool:
    """Whether ``v`` belongs to code the key's versions fix (``_PINNED``)."""
    return _is_lib_module(getattr(v, "__module__", None))


def _is_lib_module(name) -> bool:
    return isinstance(name, str) and (name.split(".")[0] in _PINNED or name.startswith("__editable__"))


def _function_fp(fn, seen):
    if fn in seen:
        return ("recursive", fn.__qualname__)
    seen[fn] = True
    code = fn.__code__
    g = fn.__globals__
    refs = tuple((n, _fp(g[n], seen)) for n in sorted(code_names(code)) if n in g)
    cells = tuple(_fp(c.cell_contents, seen) for c in (fn.__closure__ or ()))
    return ("function", fn.__module__, fn.__qualname__, code_fp(code),
            refs, cells, _fp(fn.__defaults__, seen), _fp(fn.__kwdefaults__, seen))


def code_names(code) -> set:
    """The global and attribute names a code object and every code nested in it reads."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= code_names(c)
    return names


def _class_fp(cls, seen):
    if _is_lib(cls):
        return ("lib", cls.__module__, cls.__qualname__)
    if cls in seen:
        return ("recursive", cls.__qualname__)
    seen[cls] = True
    body = []
    for k, v in sorted(vars(cls).items()):
        if k.startswith("__") and k not in ("__init__", "__call__"):
            continue
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        if isinstance(v, property):
            v = v.fget
        try:
            body.append((k, _fp(v, seen)))
        except Uncacheable:
            body.append((k, "opaque", _source(v)))
    return ("class", cls.__module__, cls.__qualname__, tuple(body),
            tuple(_class_fp(b, seen) for b in cls.__bases__))


def _source(v) -> str:
    try:
        return hashlib.sha256(inspect.getsource(v).encode()).hexdigest()
    except (OSError, TypeError, SyntaxError, IndexError, tokenize.TokenError):    # (3.13: a class made by exec
        # of source compiled under another file's name is looked up at its line in that file)
        raise Uncacheable(f"cannot fingerprint {v!r}") from None


def _module_fp(module: torch.nn.Module, seen):
    subs = []
    for name, m in module.named_modules(remove_duplicate=False):
        # Attribute values are in the entry's record; functions stored on a module decide what runs.
        code = tuple((k, _program_fp(v)) for k, v in sorted(vars(m).items()) if isinstance(v, types.FunctionType))
        subs.append((name, _class_fp(type(m), seen), code))
    state = [("p", n, _tensor_meta(p)) for n, p in module.named_parameters(remove_duplicate=False)]
    state += [("b", n, _tensor_meta(b)) for n, b in module.named_buffers(remove_duplicate=False)]
    # Which names share a tensor (tied weights) decides the graph's inputs.
    ids: dict = {}
    ties = tuple(ids.setdefault(id(t), len(ids)) for _, t in (*module.named_parameters(remove_duplicate=False),
                                                              *module.named_buffers(remove_duplicate=False)))
    return ("nn.Module", tuple(subs), tuple(state), ties)
