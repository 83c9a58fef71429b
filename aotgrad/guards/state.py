"""Guards on the Python state a trace read (see :mod:`aotgrad.guards.reads`).

A *read* is one place a value came from — ``vars(helpers)['SCALE']``, the
closure cell ``k`` of ``f``, ``model.fc`` in its parent's ``_modules``, the
``_forward_hooks`` of a module that was called — with the value it held and
how to compare it (Dynamo's guard kinds are the reference):

* ``id``: the same object (functions, modules, classes, baked tensors, other objects);
* ``type``: an object (a called module) is still of the same class;
* ``eq``: equal *and* of the same type (``2``, ``2.0`` and ``True`` differ);
* ``frozen``: a container compared element by element the same way;
* ``len``/``empty``: a dict of the module tree (hooks, parameters) still has as many entries;
* ``dict``: a dict whose entries must stay the same objects (children, non-empty hooks);
* ``absent``: a name the code looked up that must stay absent (a global that is a builtin, an
  attribute ``hasattr`` found missing, a dict entry ``get`` found missing).

Each read has a ``path`` from a root (``fn``, ``G:<module>``, ``arg:<i>``) that a
fresh process can resolve again: the disk cache compares those, so the cache
and the guards check the same record. The checks run as one generated
straight-line function for the identity, value and absent reads (expected values in
closure cells), C-level passes over the held dicts of the module tree, and one C pass of
dict version tags for plain ``dict`` reads (``_by_version``); when one fails, one loop names the
first read that failed.
"""
from __future__ import annotations

import array
import collections
import keyword
import operator
import sys
import types
from dataclasses import dataclass

import torch

from ..runtime.codegen import compile_source
from ..runtime.call import VALUE_TYPES, bits, float_from_bits, same_value
from ..tracing.views import real
from .tags import EMPTY_IN_C, dict_version, state_check

_EQ_TYPES = VALUE_TYPES
_MISSING = object()
_FROZEN_LIMIT = 256
_FROZEN_DEPTH = 8
_CONTAINER_TYPES = (list, tuple, set, frozenset, dict, collections.deque)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called")


@dataclass(frozen=True)
class Read:
    source: str          # the expression, for messages: "model.fc.training", "helpers.SCALE"
    path: tuple | None   # (root, *steps) a fresh process resolves; None when it cannot
    where: object        # dict, mappingproxy, cell or object holding the value
    key: object          # dict key, or attribute name for an object; None for a cell
    value: object        # what it held when captured (a copy for "dict")
    kind: str            # id | type | eq | frozen | len | dict | absent


def _get(where, key):
    if isinstance(where, types.CellType):
        return where.cell_contents
    return where[key] if by_item(where, key) else getattr(where, key)


def by_item(where, key) -> bool:
    """Whether a read of ``key`` at ``where`` is ``where[key]``: a dict's or mappingproxy's entry; not the
    own ``__dict__`` of an object that is also a dict (``class Cfg(dict)`` holding attributes: its
    attribute, ``where.__dict__``)."""
    return isinstance(where, (dict, types.MappingProxyType)) and (
        key != "__dict__" or type(where) in (dict, types.MappingProxyType))


def _held(reads) -> tuple:
    """What each read's place holds now, a capture's per-thread view taken as the dict it stands for."""
    return tuple(real(_get(r.where, r.key)) for r in reads)


def freeze(v, depth=0):
    """A type-exact, comparable description of a guarded container value: plain values by their
    bits, containers element by element (``deque`` with its ``maxlen``), the buffers of ``bytearray``,
    ``array.array`` and NumPy values by their bytes; anything else by identity (``_Same``)."""
    if type(v) in _EQ_TYPES:
        return (type(v), bits(v))
    raw = _raw(v)
    if raw is not None:
        return (type(v), raw)
    if isinstance(v, _CONTAINER_TYPES) and depth < _FROZEN_DEPTH and len(v) <= _FROZEN_LIMIT:
        if isinstance(v, dict):
            return (type(v), tuple((freeze(k, depth + 1), freeze(x, depth + 1)) for k, x in v.items()))
        body = tuple(freeze(x, depth + 1) for x in v)     # (a set in the order it iterates: a loop sees that)
        return (type(v), (_MAXLEN, v.maxlen, body) if isinstance(v, collections.deque) else body)
    return _Same(v, v._version) if _versioned(v) else _Same(v)


def _buffer(v) -> bool:
    """Whether ``v`` holds its value in a buffer (``bytearray``, ``array.array``, a NumPy array or
    scalar not of objects), compared by its bytes."""
    if isinstance(v, (bytearray, array.array)) or isinstance(v, memoryview) and _readable(v):
        return True     # (a memoryview: its bytes now, whichever object holds them)
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, (np.ndarray, np.generic)) and not np.asarray(v).dtype.hasobject


def _readable(view) -> bool:
    try:
        return view.nbytes >= 0
    except ValueError:      # released
        return False


def _raw(v):
    """``(tag, bytes...)`` of a value held in a buffer (:func:`_buffer`), or None."""
    if not _buffer(v):
        return None
    if isinstance(v, bytearray):
        return (_BYTES, bytes(v))
    if isinstance(v, array.array):
        return (_ARRAY, v.typecode, v.tobytes())
    if isinstance(v, memoryview):
        return (_VIEW, v.format, v.shape, v.tobytes())
    a = sys.modules["numpy"].asarray(v)
    return (_NUMPY, a.dtype.str, a.shape, a.tobytes())


_BYTES, _ARRAY, _VIEW, _NUMPY, _MAXLEN = "bytes", "array", "memoryview", "numpy", "maxlen"


def _unbits(t, body):
    if t is float:
        return float_from_bits(body)
    return complex(float_from_bits(body[0]), float_from_bits(body[1])) if t is complex else body


def checkable(v, depth=0) -> bool:
    """Whether ``v`` can be checked whole by value; not where it is too large, nested too deep or a
    NumPy array of objects: a read of it is refused, not trusted."""
    if _buffer(v):
        return len(_raw(v)[-1]) <= 64 * _FROZEN_LIMIT
    if isinstance(v, _CONTAINER_TYPES):
        return depth < _FROZEN_DEPTH and len(v) <= _FROZEN_LIMIT and all(
            checkable(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    np = sys.modules.get("numpy")
    return np is None or not isinstance(v, np.ndarray)      # (one of objects)


class _Same:
    """Compares by identity (an object inside a frozen container; a tensor also by its version)."""
    __slots__ = ("obj", "version")

    def __init__(self, obj, version=None):
        self.obj, self.version = obj, version

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj and other.version == self.version

    def __hash__(self):
        return id(self.obj)


def guard_kind(v) -> str:
    if type(v) in _EQ_TYPES or type(v) in (tuple, frozenset) and all(type(x) in _EQ_TYPES for x in v):
        return "eq"
    if isinstance(v, _CONTAINER_TYPES) or _buffer(v) or _versioned(v):
        return "frozen"
    return "id"


def _versioned(v) -> bool:
    """A tensor a read holds that is not a parameter: the same one, unwritten since (a value the trace
    took from it, ``T.item()``, is baked in the graph)."""
    return isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and not v.is_inference()


def holds(read: Read, now) -> bool:
    """Whether ``now`` (or _MISSING) satisfies ``read``."""
    k, v = read.kind, read.value
    if k == "absent":
        return now is _MISSING
    if now is _MISSING:
        return False
    if k in ("id", "type"):
        return now is v
    if k == "eq":
        if type(v) in (tuple, frozenset):
            return type(now) is type(v) and freeze(now) == freeze(v)
        return same_value(now, v)
    if k == "frozen":
        return freeze(now) == v
    if k == "len":
        return isinstance(now, dict) and len(now) == v
    if k == "empty":
        return isinstance(now, dict) and not now
    return isinstance(now, dict) and list(now.items()) == list(v.items())     # in order: ``ModuleDict`` iterates it


def current(read: Read):
    if read.kind == "type":
        return type(read.where)
    try:
        return _get(read.where, read.key)
    except (KeyError, AttributeError, ValueError, TypeError):
        return _MISSING


def describe(read: Read) -> str:
    """Why ``read`` fails now, as ``explain`` shows it."""
    now = current(read)
    if read.kind == "absent":
        builtin = " (a builtin)" if isinstance(read.where, dict) and "__builtins__" in read.where else ""
        return f"`{read.source}` was not defined when captured{builtin}, now it is {_short(now)}"
    if now is _MISSING:
        return f"`{read.source}` was {_short(_shown(read))} when captured, now it is gone"
    if read.kind in ("len", "empty"):
        return f"`{read.source}` had {read.value or 0} entries when captured, now {len(now)}"
    if read.kind == "dict":
        return _describe_dict(read, now)
    was, shown = _short(_shown(read)), _short(now)
    if was == shown:       # the same description: say what differs instead of repeating it
        if read.kind == "id":
            return f"`{read.source}` is not the object it was when captured (now another {shown.removeprefix('a ')})"
        return f"`{read.source}` ({shown}) is not equal to what it was when captured (another object, or its contents changed)"
    return f"`{read.source}` was {was} when captured, now {shown}"


def _describe_dict(read, now) -> str:
    """The first entry of a guarded dict that changed: ``model.fc`` for a child module."""
    for k in [*read.value, *(k for k in now if k not in read.value)]:
        was, new = read.value.get(k, _MISSING), now.get(k, _MISSING)
        if was is not new:
            name = f"{read.source}.{k}" if read.key == "_modules" else f"{read.source}[{k!r}]"
            text = {id(_MISSING): "absent"}
            return (f"`{name}` was {text.get(id(was)) or _short(was)} when captured, "
                    f"now {text.get(id(new)) or _short(new)}")
    return f"`{read.source}` changed"


def _shown(read):
    v = read.value
    return _thaw(v) if read.kind == "frozen" else v


def _thaw(f):
    if isinstance(f, _Same):
        return f.obj
    t, body = f
    if issubclass(t, dict):     # (a subclass made and filled without its own methods: what it held, as it was)
        out = {_thaw(k): _thaw(x) for k, x in body}
        if t is dict:
            return out
        sub = dict.__new__(t)
        dict.update(sub, out)
        return sub
    if t in _EQ_TYPES:
        return _unbits(t, body)
    if isinstance(body, tuple) and body[:1] in ((_BYTES,), (_ARRAY,), (_VIEW,), (_NUMPY,)):
        return _unraw(t, body)
    if isinstance(body, tuple) and body[:1] == (_MAXLEN,):
        out = t.__new__(t)
        collections.deque.__init__(out, [_thaw(x) for x in body[2]], body[1])
        return out
    items = [_thaw(x) for x in body]
    return t._make(items) if issubclass(t, tuple) and hasattr(t, "_make") else t(items)     # a namedtuple


def _unraw(t, body):
    if body[0] == _BYTES:
        return t(body[1])
    if body[0] == _ARRAY:
        out = t(body[1])
        out.frombytes(body[2])
        return out
    if body[0] == _VIEW:
        return memoryview(bytearray(body[3])).cast("B").cast(body[1], body[2])
    import numpy as np
    a = np.frombuffer(body[3], dtype=np.dtype(body[1])).reshape(body[2]).copy()
    return a if t is np.ndarray else a.reshape(()).astype(t)[()] if issubclass(t, np.generic) else a


def _short(v) -> str:
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        owner = getattr(v, "__module__", None) or getattr(getattr(v, "__self__", None), "__name__", None)
        return f"{owner}.{v.__qualname__}" if owner else v.__qualname__
    text = f"a {type(v).__name__} tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
    if not isinstance(v, torch.Tensor) and type(v) not in _EQ_TYPES:
        text = f"{text} ({type(v).__name__})" if len(text) < 60 else f"a {type(v).__name__} object"
    return text if len(text) <= 80 else text[:77] + "..."


_CELL = operator.attrgetter("cell_contents")


def _gatherer(reads):
    """A function returning the current values of ``reads`` in order, in three C-level passes
    (dict items, attributes, cells); the reads are ordered to match by ``build``."""
    items = [(r.where, r.key) for r in reads if by_item(r.where, r.key)]
    attrs = [(r.where, r.key) for r in reads if not by_item(r.where, r.key) and not isinstance(r.where, types.CellType)]
    cells = tuple(r.where for r in reads if isinstance(r.where, types.CellType))
    wi, ki = tuple(w for w, _ in items), tuple(k for _, k in items)
    wa, ka = tuple(w for w, _ in attrs), tuple(k for _, k in attrs)
    getitem, map_, list_ = operator.getitem, map, list

    def gather():
        vals = list_(map_(getitem, wi, ki))
        if wa:
            vals += map_(getattr, wa, ka)
        if cells:
            vals += map_(_CELL, cells)
        return vals
    return gather


def _access_order(r):
    return 0 if by_item(r.where, r.key) else 2 if isinstance(r.where, types.CellType) else 1


def _fast_check(kind, reads):
    """A check that every read of one group holds; False may be a false alarm (a value equal to
    the captured one but another object, a NaN), which the per-read loop settles."""
    if kind == "empty":
        # The dicts themselves, held: one C pass of ``any`` (a module's hook and parameter dicts are
        # only ever changed in place; assigning a new dict to ``_forward_hooks`` is not seen here).
        # A parameter dict a capture's per-thread view stands in for is held as the module's own.
        held = _held(reads)
        return lambda: not any(held)
    if kind == "type":     # one C pass of ``type`` over the held objects
        held, expect = tuple(r.where for r in reads), [r.value for r in reads]
        return lambda: list(map(type, held)) == expect
    if kind == "len":
        # Lengths only: comparing the dicts would compare replaced parameters with ``Tensor.__eq__``.
        held, expect = _held(reads), [r.value for r in reads]
        return lambda: list(map(len, held)) == expect
    if kind == "dict" and dict_version is not None:
        return _by_version(reads)
    if kind in ("same", "dict", "through") or kind == "absent" and all(
            by_item(r.where, r.key) for r in reads):
        return _generated(reads, kind)
    gather = _gatherer(reads)
    return lambda: all(holds(r, v) for r, v in zip(reads, gather()))


def _by_version(reads):
    """The ``dict`` reads (children, non-empty hooks) by version tag: one C pass of ``dict_version`` over
    the dicts their holders hold now. A changed tag (any write, or another dict in the holder) runs the
    entry-by-entry comparison, and where that holds and every dict is a plain one, its tags are the
    expected ones from then on; an ``OrderedDict`` (hooks) reordered in place keeps its tag, so a group
    holding one is compared entry by entry every call."""
    plain = [r for r in reads if type(_get(r.where, r.key)) is dict]
    others = [r for r in reads if type(_get(r.where, r.key)) is not dict]
    exact, rest = _generated(plain, "dict") if plain else None, _generated(others, "dict") if others else None
    if exact is None:
        return rest
    gather, expect = _gatherer(plain), [dict_version(_get(r.where, r.key)) for r in plain]

    def check():
        if rest is not None and not rest():
            return False
        if list(map(dict_version, gather())) == expect:
            return True
        if not exact():
            return False
        now = gather()
        if all(type(d) is dict for d in now):
            expect[:] = map(dict_version, now)
        return True
    return check


def _access(i, r, holders) -> str:
    """Source text loading ``r``'s value from holder cell ``h<n>`` (holders shared by reads)."""
    h = "h%d" % holders.setdefault(id(r.where), (len(holders), r.where))[0]
    if isinstance(r.where, types.CellType):
        return f"{h}.cell_contents"
    if by_item(r.where, r.key):
        return f"{h}[{_key(i, r)}]"
    return f"{h}.{r.key}" if r.key.isidentifier() and not keyword.iskeyword(r.key) else f"getattr({h}, k{i})"


def _key(i, r) -> str:
    return repr(r.key) if type(r.key) in (str, int) else f"k{i}"


def _term(i, r, holders, kind) -> str:
    if kind == "absent":        # a name looked up in a dict (a module's, a class's, globals) stays absent
        return f"{_key(i, r)} not in h%d" % holders.setdefault(id(r.where), (len(holders), r.where))[0]
    if kind == "dict":      # entries in order (a reordered ``ModuleDict`` runs its children in another order)
        return f"list({_access(i, r, holders)}.items()) == e{i}"
    if kind == "through":   # a hook or parameter dict read through its holder: of its class, empty or as long
        body = "not x" if r.kind == "empty" else f"len(x) == {int(r.value)}"
        return f"(x := {_access(i, r, holders)}).__class__ is e{i} and {body}"
    return f"{_access(i, r, holders)} {'is' if kind == 'same' else '=='} e{i}"


def _generated(reads, kind):
    """One straight-line function ``holder[key] is expected and ...`` (``==`` for dicts of children
    and hooks, one C comparison per dict; ``key not in holder`` for absent names): a specialized
    dict subscript and a compare per read, about half the cost of C-level ``map`` passes that call
    a function per read. Holders, odd keys and expected values are closure cells, so ``refresh``
    rebinds cells instead of generating again."""
    holders: dict = {}
    terms = [_term(i, r, holders, kind) for i, r in enumerate(reads)]
    cells = {f"h{n}": w for n, w in holders.values()}
    cells.update({f"k{i}": r.key for i, (r, t) in enumerate(zip(reads, terms))
                  if f"k{i}]" in t or f"k{i})" in t or t.startswith(f"k{i} ")})
    if kind == "through":
        cells.update({f"e{i}": type(current(r)) for i, r in enumerate(reads)})
    elif kind != "absent":
        cells.update({f"e{i}": list(r.value.items()) if kind == "dict" else r.value for i, r in enumerate(reads)})
    names = list(cells)
    src = (f"def make({', '.join(names)}):\n    def check():\n        return " + " and ".join(terms)
           + "\n    return check\n")
    env: dict = {"getattr": getattr}
    exec(compile_source(src, "state guards"), env)
    check = env["make"](*cells.values())
    if kind in ("dict", "absent", "through"):
        return check            # the rule itself, or stricter (``through``: the same class)
    expected = [check.__closure__[check.__code__.co_freevars.index(f"e{i}")] for i in range(len(reads))]

    def refresh():
        """After the per-read loop found equal values in new objects: compare with those next time."""
        for cell, r in zip(expected, reads):
            cell.cell_contents = current(r)
    check.refresh = refresh
    return check


def _group(r: Read) -> str:
    """Reads checked together: ``same`` (the captured object itself: ids, and plain values, which are
    immutable), mutable containers one by one, the rest by kind."""
    return "same" if r.kind in ("id", "eq") else r.kind


@dataclass(frozen=True)
class StateGuards:
    """The reads of one compiled entry and their check: ``check()`` is None or a failing read's index."""
    reads: tuple
    check: object

    def explain(self, failed) -> str:
        return describe(self.reads[failed])

    def lines(self) -> list:
        return [f"{r.source}: {_rule(r)}" for r in self.reads]

    def vouched(self, slots):
        """Right after ``check()`` passed: a token (the C check) whose passes prove each of ``slots``
        (``runtime.call.held_slots``) the object it was when the token was built, or None."""
        c = getattr(self.check, "__self__", None)
        return None if c is None else c.vouched(slots)

    def per_call(self) -> dict:
        """What a call that finds nothing changed looks at: module ``__dict__`` tags, module types, the
        held dicts' lengths and the held empty hook and parameter dicts (one C loop once built: ``in C``),
        and the other reads; ``checks``: how many in all."""
        c = getattr(self.check, "__self__", None)
        if c is None:
            return {"reads": len(self.reads)}
        kinds = {k: len(rs) for k, rs in c.by_kind.items()}
        out = {"reads": len(self.reads), "tags": len(c.dicts), "types": kinds.pop("type", 0),
               "empty": kinds.pop("empty", 0), "lengths": kinds.pop("len", 0), "others": sum(kinds.values()),
               "in C": c.cpp is not None}
        out["held dicts"] = out["empty"] + out["lengths"]
        out["checks"] = out["tags"] + out["types"] + out["held dicts"] + out["others"]
        return out


def _rule(r: Read) -> str:
    if r.kind == "eq":
        return f"== {r.value!r} ({type(r.value).__name__})"
    if r.kind == "frozen":
        return f"== {_short(_thaw(r.value))} (element types too)"
    if r.kind in ("len", "empty"):
        return f"has {r.value or 0} entries"
    if r.kind == "dict":
        return f"same entries ({len(r.value)}: {_short(list(r.value))})"
    if r.kind == "type":
        return f"is {_short(r.value)}"
    return "not defined" if r.kind == "absent" else f"is the same {type(r.value).__name__} object"


def build(reads, since=None) -> StateGuards:
    """The guards of ``reads``. ``since``: a ``watermark`` taken before their values were taken from the
    objects as they were then: a module dict written since (its version above it) is verified on the
    first call, every other's version is the expected one at once."""
    reads = tuple(sorted((*reads, *_dict_reads(reads)), key=lambda r: (_group(r), _access_order(r))))
    return StateGuards(reads, _Check(reads, since).check if reads else (lambda: None))


def watermark():
    """A version that every dict written before now has at most, and every dict written after exceeds
    (CPython counts every dict write process-wide, 3.11 to 3.13), or None where this Python keeps none."""
    if dict_version is None:
        return None
    d = {}
    d[0] = 0
    return dict_version(d)


_COVERED = ("id", "eq", "absent")     # kinds a holder's unchanged version tag proves by itself


def _dict_reads(reads) -> list:
    """For each module the reads watch (its ``type`` read's object): that its ``__dict__`` is the dict it
    was, which the reads of its attributes hold (``model.fc.__dict__ = {...}``, or ``object.__setattr__``
    of it, rebinds every attribute at once and writes no dict)."""
    return [Read(f"{r.source.removeprefix('type(').removesuffix(')')}.__dict__",
                 (*r.path[:-1], ("attr", "__dict__")) if r.path else None, r.where, "__dict__", vars(r.where), "id")
            for r in reads if r.kind == "type" and isinstance(r.where, torch.nn.Module)]


def _is_dict_read(r: Read, mods) -> bool:
    """A ``_dict_reads`` read of a module whose tag the check takes through it (which covers it)."""
    return r.key == "__dict__" and r.kind == "id" and id(r.value) in mods and mods[id(r.value)][0] is r.where


def _is_slot(r: Read) -> bool:
    """An empty parameter or buffer slot's read (``Resolver._tree``): ``None`` in a module's dict of them."""
    return r.kind == "id" and r.value is None and type(r.where) is dict and r.path is not None and len(r.path) > 1 \
        and r.path[-2] in (("attr", "_parameters"), ("attr", "_buffers"))


def _module_dicts(reads) -> dict:
    """``{id: (module, dict)}``: each module the reads watch and the ``__dict__`` it had (``_dict_reads``)."""
    if dict_version is None:
        return {}
    return {id(r.value): (r.where, r.value) for r in reads
            if r.kind == "id" and r.key == "__dict__" and isinstance(r.where, torch.nn.Module) and type(r.value) is dict}


class _Check:
    """The per-call check of ``reads`` (in ``build``'s order): ``check()`` is None or the index of the
    first read that fails.

    Each module's ``__dict__`` is checked by its version tag: an unchanged tag means no entry of it was
    written, so its ``id``, ``eq`` and ``absent`` reads hold without being looked at, and the hook and
    parameter dicts it holds are the ones held here (a dict assigned in place of ``_forward_hooks``
    changes the tag). Their contents, the modules' types and every other read are checked each call, by
    kind (``_fast_check``); a hook or parameter dict of another holder (the global hooks) is read
    through it. All of it is one generated expression (``_fuse``); once the tags have held for a few
    calls, the tags, the held parameter and buffer dicts' tags, the types and the held empty dicts are
    one C loop (``tags.state_check``, built over the tags just verified; its passes are what ``vouched``
    offers the prologue). When it fails, the parts are checked one by one: a changed tag (a write to the
    module, ``model.step = i``) checks that module's reads, and where they hold its new tag is the
    expected one (dicts it now holds are held in place of the old ones, and the C check, which holds
    the old tags, is dropped); a part that fails with every read holding (an equal value in a new
    object) is refreshed; else the per-read loop names the read."""

    CALM, BUILDS = 3, 4     # calls the tags must hold before the C check is built; builds at most

    def __init__(self, reads, since=None):
        self.reads = reads
        self._reset()
        if since is not None and self.dicts:    # (in place: the fused check holds the list)
            now = self._dicts_now()
            self.tags[:] = [v if d is t and v <= since else None for d, t, v in zip(now, self.dicts, map(dict_version, now))]

    def _reset(self):
        """Everything derived from the reads' holders as they are now: which dicts are held, no tag
        trusted yet, no C check."""
        reads = self.reads
        self.mods = mods = _module_dicts(reads)
        # A module's plain children dict (``_modules``) is held by its tag too: which dict the module
        # holds is covered by the module's tag, its entries (in order) by its own.
        kids = {i: _get(r.where, r.key) for i, r in enumerate(reads) if r.kind == "dict" and id(r.where) in mods}
        kids = {i: d for i, d in kids.items() if type(d) is dict}
        # A module's parameter or buffer dict holding an empty slot (``bias=False``) is held by its tag too:
        # that the slot is still empty (its ``None`` read) then costs nothing while the dict is unchanged.
        slots = {id(r.where): r.where for r in reads if _is_slot(r)} if mods else {}
        self.owners = tuple(m for m, _ in mods.values())     # the first dicts are theirs: read through them
        self.dicts = (*(d for _, d in mods.values()), *{id(d): d for d in (*kids.values(), *slots.values())}.values())
        # No tag is expected at first: the first call checks every read of each dict (reads resolved
        # again from the disk cache are not known to hold), but where ``build`` was given ``since``.
        self.tags = [None] * len(self.dicts)
        self.held = {i: _get(r.where, r.key) for i, r in enumerate(reads)
                     if r.kind in ("empty", "len") and id(r.where) in mods}
        self.held.update(kids)
        self.of = [[] for _ in self.dicts]     # one pass over the reads: a deep model has thousands, and hundreds of dicts
        at = {id(d): k for k, d in enumerate(self.dicts)}
        for i, r in enumerate(reads):
            for k in (at.get(id(r.where)), at.get(id(kids[i])) if i in kids else None):
                if k is not None:
                    self.of[k].append(i)
        self.rest = tuple(r for i, r in enumerate(reads) if not (id(r.where) in mods and r.kind in _COVERED or i in kids
                                                                 or _is_dict_read(r, mods) or id(r.where) in slots))
        self.cpp, self.calm, self.builds, self.covers = None, 0, 0, {}
        self._parts()

    def _parts(self):
        by_kind: dict = {}
        for r in self.rest:
            k = _group(r)
            by_kind.setdefault("through" if k in ("empty", "len") and id(r.where) not in self.mods else k,
                               []).append(r)
        self.by_kind = by_kind
        self.parts = tuple(_fast_check(k, rs) for k, rs in by_kind.items())
        self.fused = _fuse(self.owners, self.dicts, self.tags, by_kind, self.parts, self.cpp)

    def _dicts_now(self):
        """The modules' ``__dict__`` as they hold them now, then the held children dicts."""
        return (*map(vars, self.owners), *self.dicts[len(self.owners):])

    def _slow(self):
        for i, r in enumerate(self.reads):
            if not holds(r, current(r)):
                return i
        return None

    def _retag(self, now) -> bool:
        """After a module's tag changed: whether its reads all hold (then its tag is the new one)."""
        reads, held = self.reads, False
        for j, (was, tag) in enumerate(zip(self.tags, now)):
            if was == tag:
                continue
            if j < len(self.owners) and vars(self.owners[j]) is not self.dicts[j]:
                return False        # another ``__dict__``: its ``_dict_reads`` read fails
            for i in self.of[j]:
                r, value = reads[i], current(reads[i])
                if not holds(r, value):
                    return False
                if i in self.held and self.held[i] is not value:
                    if reads[i].kind == "dict":     # a children dict replaced by an equal one: start again
                        self._reset()
                        return self._slow() is None
                    self.held[i], held = value, True
            self.tags[j] = tag
        self.cpp, self.calm = None, 0      # it holds the old tags
        if held:        # a hook or parameter dict replaced by an equal one: hold the new one
            self._parts()
        else:
            self.fused = _fuse(self.owners, self.dicts, self.tags, self.by_kind, self.parts, None)
        return True

    def _calm(self):
        """The tags held again: after ``CALM`` calls in a row, the C check of them, the types and the
        held empty dicts (``tags.state_check``)."""
        self.calm += 1
        if self.calm < self.CALM or self.builds >= self.BUILDS:
            return
        self.builds += 1
        typed, sized = self.by_kind.get("type", ()), self.by_kind.get("len", ())
        held = _held(sized)
        empty = [d for d in _held(self.by_kind.get("empty", ())) if type(d) in EMPTY_IN_C]
        # The held parameter and buffer dicts by their tags too: an unchanged tag proves the length, and
        # that each entry is the object it was at the build (what ``vouched`` offers the prologue). Their
        # tags are taken now, then their lengths checked (tags taken after this call's check of them);
        # the modules' tags are the ones this call verified (a write from another thread since gives a
        # new tag, which fails the check, never an old one back).
        tags = (*self.tags, *map(dict_version, held))
        check = state_check(self.owners, (*self.dicts, *held), tags, [r.where for r in typed],
                            [r.value for r in typed], empty)
        if check is None:
            self.builds = self.BUILDS
        elif list(map(len, held)) == [r.value for r in sized]:
            self.cpp = check
            self.fused = _fuse(self.owners, self.dicts, self.tags, self.by_kind, self.parts, check)

    def _drop(self):
        """The C check failed with every read holding (a held parameter dict written: a parameter
        replaced by another): checked in Python until it is built again over the new tags."""
        self.cpp, self.calm = None, 0
        self.fused = _fuse(self.owners, self.dicts, self.tags, self.by_kind, self.parts, None)

    def vouched(self, slots):
        """The C check, where it is built and its last pass proves ``slots`` unchanged since the build:
        each ``(module __dict__, "_parameters" or "_buffers", name)`` of a module whose tag it holds, the
        dict there now one of the held dicts it holds by tag (not a capture's per-thread view). Else None."""
        cpp = self.cpp
        if cpp is None:
            return None
        known = self.covers.get(id(slots))
        if known is None or known[0] is not cpp:
            tagged = {id(d) for d in self.dicts}
            held = set(map(id, _held(self.by_kind.get("len", ()))))
            ok = all(id(m) in tagged and id(m.get(k)) in held for m, k, _ in slots)
            self.covers[id(slots)] = known = (cpp, ok, slots)
        return cpp if known[1] else None

    def check(self):
        try:
            if self.fused():
                if self.cpp is None and self.dicts:
                    self._calm()
                return None
            self.calm = 0
            if self.dicts:
                now = list(map(dict_version, self._dicts_now()))
                if now != self.tags and not self._retag(now):
                    return self._slow()
            for ok in self.parts:
                if not ok():
                    failed = self._slow()
                    if failed is None and hasattr(ok, "refresh"):
                        ok.refresh()
                    return failed
            if self.cpp is not None:
                self._drop()
        # RuntimeError: dict_version of a non-dict; SystemError: the same on torch 2.11 (NULL, no exception set)
        except (KeyError, AttributeError, ValueError, TypeError, RuntimeError, SystemError):
            return self._slow()
        return None


def _fuse(owners, dicts, tags, by_kind, parts, cpp=None):
    """The whole check as one generated expression: the tags (or ``cpp``, the C check of the tags, the
    held parameter and buffer dicts' tags, the types and the held empty dicts it was given), the held
    hook and parameter dicts' emptiness and lengths and the modules' types as C passes in line, each other
    part called."""
    env = {"dv": dict_version, "O": owners, "D": dicts[len(owners):], "T": tags, "any": any, "len": len,
           "list": list, "map": map, "type": type, "vars": vars, "C": cpp}
    terms = [] if not dicts else ["list(map(dv, (*map(vars, O), *D))) == T"] if cpp is None else ["C()"]
    for n, (kind, rs) in enumerate(by_kind.items()):
        if kind == "empty":
            env["E"] = tuple(d for d in _held(rs) if cpp is None or type(d) not in EMPTY_IN_C)
            if env["E"]:        # (with ``cpp``, usually none left: it checks them)
                terms.append("not any(E)")
        elif kind == "len":
            env["L"], env["LE"] = _held(rs), [r.value for r in rs]
            if cpp is None:
                terms.append("list(map(len, L)) == LE")
        elif kind == "type":
            env["Y"], env["YE"] = tuple(r.where for r in rs), [r.value for r in rs]
            if cpp is None:
                terms.append("list(map(type, Y)) == YE")
        else:
            env[f"p{n}"] = parts[n]
            terms.append(f"p{n}()")
    src = "def make():\n    def check():\n        return " + (" and ".join(terms) or "True") + "\n    return check\n"
    exec(compile_source(src, "state guards"), env)
    return env["make"]()
