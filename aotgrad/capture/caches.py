"""A cache argument of a repeated block (HF's ``DynamicCache``, ``EncoderDecoderCache``), per call.

A cache a template can take is an object whose attributes are plain values, dicts of plain keys
and values (``is_updated``), other such caches (an encoder-decoder cache's self- and
cross-attention caches), and, where its class's ``update`` takes ``layer_idx``, a ``layers`` list
(:func:`cache_key`). While a template is traced, the block gets a :class:`CacheStandIn` of it,
which works on a :class:`_Tree` of copies (the caches, their layers and dicts), never on the
program's cache, and records each use, in order:

* :class:`Update`: ``update(k, v, layer_idx)`` ran the class's own ``update`` on the copy; the
  layer it changed must have held no tensor. Its tensors become extra outputs of the template;
  its plain values are set on every call's layer, so the index it ran with (an :class:`_Index`)
  escapes when kept or used other than to pick and bound its layer.
* :class:`Ask`: any other method of a cache or of its dict (``get_seq_length(layer_idx)``,
  ``is_updated.get(layer_idx)``) ran on the copies, without a tensor op and changing none of
  them, and answered a plain value.
* :class:`SetItem`: ``is_updated[layer_idx] = True``, a plain value into a dict.

Anything else (reading ``layers``, ``len``, iterating, an op on the cache's tensors) raises
:class:`per_call.Escaped`. Each call of the template first replays that record on copies of its
own cache, its tensors as fakes of the template's (:func:`bind`): each layer must be as the
template's was and each question must get the template's answer, else the call runs flat. Then
the updates and items are set on its own cache with its own tensors (:func:`replay`), as eager's
calls leave it. The record holds the varying ``layer_idx`` as ``("stand", i)``: each call uses
its own.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch

from .._torch import FakeTensorMode, TorchDispatchMode, detect_fake_mode, fresh_fakes
from ..guards import reads
from ..runtime.call import bits
from .per_call import Escaped, Stand

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_DEPTH = 3


def _plain(v) -> bool:
    return type(v) in _PLAIN or isinstance(v, type)


def _value_key(v):
    return (type, id(v)) if isinstance(v, type) else (type(v), bits(v))


def _fingerprint(obj) -> tuple | None:
    """An object's own attributes by name, type and value when all are plain (None, numbers,
    strings, dtypes, devices, classes: compared by identity), else None."""
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return None
    out = []
    for k, v in d.items():
        if not _plain(v):
            return None
        out.append((k, *_value_key(v)))
    return tuple(out)


def _updates_by_index(cls) -> bool:
    up = getattr(cls, "update", None)
    if not isinstance(up, types.FunctionType):
        return False
    try:
        return "layer_idx" in inspect.signature(up).parameters
    except (TypeError, ValueError):
        return False


def _layered(obj) -> bool:
    d = vars(obj)
    return type(d.get("layers")) is list and _updates_by_index(type(obj)) and all(
        isinstance(getattr(x, "__dict__", None), dict) for x in d["layers"])


def cache_key(x, depth: int = 0, seen: set | None = None):
    """A call argument's key when it is a cache a template can take, else None: its class and
    plain attributes, the keys of its sub-caches, the names of its dicts (their contents are
    asked per call, not keyed: each call's ``is_updated`` differs)."""
    d = getattr(x, "__dict__", None)
    seen = set() if seen is None else seen
    if not isinstance(d, dict) or depth > _DEPTH or id(x) in seen or isinstance(x, (torch.Tensor, torch.nn.Module, type)):
        return None     # (one object reached twice would be two copies)
    seen.add(id(x))
    layered, subs, parts = _layered(x), 0, []
    for k, v in d.items():
        if layered and k == "layers":
            continue
        if _plain(v):
            parts.append((k, *_value_key(v)))
        elif type(v) is dict and all(_plain(a) and _plain(b) for a, b in v.items()):
            parts.append((k, dict))
        else:
            sub = cache_key(v, depth + 1, seen)
            if sub is None:
                return None
            parts.append((k, sub))
            subs += 1
    return ("cache", id(type(x)), layered, tuple(parts)) if layered or subs else None


@dataclass(frozen=True)
class Update:
    """``update`` of the layer ``at`` of the cache at ``path`` (attribute names from argument
    ``leaf``): the layer's class and plain attributes before, and what it set: ``("out", k, meta)``
    the template's ``k``-th extra output (its shape, stride, dtype, device), or ``("value", v)``."""
    leaf: int
    path: tuple
    at: tuple           # ("stand", i): the block's varying int i; ("int", n)
    kind: type
    before: tuple
    sets: tuple


@dataclass(frozen=True)
class Ask:
    """A method ``name`` of the cache or dict at ``path``, its arguments (``("stand", i)`` or
    ``("value", v)``) and the plain answer it gave (by type and bits)."""
    leaf: int
    path: tuple
    name: str
    args: tuple
    answer: tuple


@dataclass(frozen=True)
class SetItem:
    leaf: int
    path: tuple
    at: tuple
    value: object


class _Tree:
    """Copies of a cache argument's objects: the caches by path, each ``layers`` list and its layers,
    each dict. Methods run on them change copies only."""

    def __init__(self, real):
        self.copies: dict = {}
        self._copy(real, ())

    def _copy(self, obj, path):
        c = object.__new__(type(obj))
        d = vars(c)
        d.update(vars(obj))
        self.copies[path] = c
        for k, v in vars(obj).items():
            if k == "layers" and type(v) is list:
                d[k] = [self._layer(x) for x in v]
            elif type(v) is dict:
                d[k] = self.copies[path + (k,)] = dict(v)
            elif not _plain(v):
                d[k] = self._copy(v, path + (k,))
        return c

    @staticmethod
    def _layer(x):
        c = object.__new__(type(x))
        vars(c).update(vars(x))
        return c

    def objects(self) -> list:
        """The copies: caches, dicts, ``layers`` lists and layers."""
        out = list(self.copies.values())
        for c in self.copies.values():
            layers = vars(c).get("layers") if type(c) is not dict else None
            if type(layers) is list:
                out += [layers, *layers]
        return out

    def snapshot(self) -> list:
        return [(o, _contents(o)) for o in self.objects()]


def _contents(o):
    return dict(o) if type(o) is dict else list(o) if type(o) is list else dict(vars(o))


def _changed(snap) -> bool:
    for o, was in snap:
        now = _contents(o)
        if type(was) is list:
            if len(now) != len(was) or any(a is not b for a, b in zip(now, was)):
                return True
        elif now.keys() != was.keys() or any(now[k] is not v for k, v in was.items()):
            return True
    return False


_METADATA = {getattr(torch.ops.aten, n) for n in ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                                                     "size", "stride", "numel", "dim", "is_contiguous")}


class _NoOps(TorchDispatchMode):
    """A question asked of a cache may read its tensors' metadata, never compute with them."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.overloadpacket in _METADATA:
            return func(*args, **(kwargs or {}))
        raise Escaped(f"asking the cache ran {func}")


def _index(at, values):
    return values[at[1]][1] if at[0] == "stand" else at[1]


def _arg(a, values):
    return _index(a, values) if a[0] == "stand" else a[1]


def _asked(obj, name, args, tree: "_Tree"):
    """``(key, answer)`` of ``obj.name(*args)`` run on the copies of ``tree``; None when it computed
    with a tensor, changed a copy, raised, or answered other than a plain value."""
    fn = getattr(obj, name, None)
    if fn is None:
        return None
    snap = tree.snapshot()
    try:
        with _NoOps():
            answer = fn(*args)
    except (Exception, Escaped):
        return None
    if not _plain(answer) or _changed(snap):
        return None
    return _value_key(answer), answer


class CacheStandIn:
    """A cache argument (or a sub-cache at ``path``) while a template is traced."""

    def __init__(self, trace: "_Traced", path: tuple):
        object.__setattr__(self, "_state", (trace, path))

    def __getattribute__(self, name):
        trace, path = object.__getattribute__(self, "_state")
        if name == "__class__":         # isinstance(x, DynamicCache) asks for it here
            return type(trace.tree.copies[path])
        obj = trace.tree.copies[path]
        d = vars(obj)
        if name in d:
            v = d[name]
            if _plain(v):
                return v        # keyed: every call with this template's key holds the same
            if path + (name,) in trace.tree.copies:
                sub = trace.tree.copies[path + (name,)]
                return _DictStandIn(trace, path + (name,)) if type(sub) is dict else CacheStandIn(trace, path + (name,))
            trace.escape(f"cache.{name}")
        if isinstance(getattr(type(obj), name, None), types.FunctionType):
            if name == "update" and _layered(obj):
                return lambda *args, **kwargs: trace.update(path, obj, args, kwargs)
            return lambda *args, **kwargs: trace.ask(path, obj, name, args, kwargs)
        trace.escape(f"cache.{name}")


class _DictStandIn:
    """A plain dict of a cache (``is_updated``): ``get``, ``[k]``, ``in`` asked, ``[k] = v`` set."""

    def __init__(self, trace, path):
        object.__setattr__(self, "_state", (trace, path))

    def get(self, *args):
        trace, path = object.__getattribute__(self, "_state")
        return trace.ask(path, trace.tree.copies[path], "get", args, {})

    def __getitem__(self, k):
        trace, path = object.__getattribute__(self, "_state")
        return trace.ask(path, trace.tree.copies[path], "__getitem__", (k,), {})

    def __contains__(self, k):
        trace, path = object.__getattribute__(self, "_state")
        return trace.ask(path, trace.tree.copies[path], "__contains__", (k,), {})

    def __setitem__(self, k, v):
        trace, path = object.__getattribute__(self, "_state")
        trace.set_item(path, k, v)


def _dict_escape(self, *args, **kwargs):
    object.__getattribute__(self, "_state")[0].escape("cache dict")


def _cache_escape(self, *args, **kwargs):
    object.__getattribute__(self, "_state")[0].escape("cache operator")


# Operators the interpreter finds on the type, not through __getattribute__: the real cache's
# answers (its len, truthiness, items) could differ from a stand-in's, so each escapes.
for _name in ("__bool__", "__len__", "__iter__", "__getitem__", "__setitem__", "__contains__", "__eq__",
              "__ne__", "__call__", "__enter__", "__exit__"):
    setattr(CacheStandIn, _name, _cache_escape)
CacheStandIn.__hash__ = object.__hash__
for _name in ("__bool__", "__len__", "__iter__", "__eq__", "__ne__", "__call__", "__delitem__", "__getattr__"):
    setattr(_DictStandIn, _name, _dict_escape)
_DictStandIn.__hash__ = object.__hash__


class _Index(int):
    """The layer index a cache class's own ``update`` runs with while a template is traced: an int
    to list indexing and to order comparisons (HF's bounds check ``len(self.layers) <= layer_idx``).
    Each call's layer gets the plain values the template's update set, so storing the index (it
    is no plain value then) or any other use (``i + 1``, ``f"layer{i}"``, ``i == 0``, hashing)
    escapes: what the update set might differ at another index. An order comparison whose result
    the update stores is not seen."""

    def __new__(cls, n: int, trace: "_Traced"):
        i = super().__new__(cls, n)
        i.trace = trace
        return i


def _index_escape(self, *args, **kwargs):
    vars(self)["trace"].escape("an update that uses its layer index other than to pick its layer")


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__",
              "__truediv__", "__rtruediv__", "__mod__", "__rmod__", "__divmod__", "__rdivmod__", "__pow__",
              "__rpow__", "__neg__", "__pos__", "__abs__", "__invert__", "__and__", "__rand__", "__or__", "__ror__",
              "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__eq__", "__ne__",
              "__hash__", "__str__", "__repr__", "__format__", "__int__", "__float__", "__round__", "__trunc__",
              "__floor__", "__ceil__", "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__", "__getnewargs__"):
    setattr(_Index, _name, _index_escape)


class _Traced:
    """One cache argument while a template is traced: its copies and the record of its uses."""

    def __init__(self, real, leaf: int, log: list, record: list, outs: list):
        self.tree, self.leaf, self.log, self.record, self.outs = _Tree(real), leaf, log, record, outs
        rec = reads.watching()
        if rec is not None:     # the copies' writes are the template's own, not the program's
            rec.writes.made_here(*self.tree.objects())

    def escape(self, what: str):
        self.log.append(what)
        raise Escaped(f"the cache was used other than by update or a question ({what})")

    def _at(self, idx) -> tuple:
        if type(idx) is Stand:
            return ("stand", object.__getattribute__(idx, "index")), object.__getattribute__(idx, "value")
        if type(idx) is int:
            return ("int", idx), idx
        self.escape("a layer index that is not an int")

    def _args(self, args) -> tuple:
        out, real = [], []
        for a in args:
            if type(a) is Stand:
                at, n = self._at(a)
                out.append(at)
                real.append(n)
            elif _plain(a):
                out.append(("value", a))
                real.append(a)
            else:
                self.escape("a question with an argument that is not plain")
        return tuple(out), real

    def ask(self, path, obj, name, args, kwargs):
        if kwargs:
            self.escape(f"{name} with keyword arguments")
        pattern, real = self._args(args)
        got = _asked(obj, name, real, self.tree)
        if got is None:
            self.escape(f"{name}(...)")
        self.record.append(Ask(self.leaf, path, name, pattern, got[0]))
        return got[1]

    def set_item(self, path, k, v):
        at, n = self._at(k)
        if not _plain(v):
            self.escape("a dict entry that is not plain")
        self.tree.copies[path][n] = v
        self.record.append(SetItem(self.leaf, path, at, v))

    def update(self, path, obj, args, kwargs):
        cls = type(obj)
        try:
            bound = inspect.signature(cls.update).bind(obj, *args, **kwargs)
        except TypeError:
            self.escape("update arguments")
        at, n = self._at(bound.arguments.get("layer_idx"))
        layers = vars(obj)["layers"]
        layer = layers[n] if 0 <= n < len(layers) else None
        before = _fingerprint(layer) if layer is not None else None
        if before is None:      # a layer holding tensors (updated before): no template stands for it
            self.escape("cache layer")
        was = dict(vars(layer))
        snap = [(o, s) for o, s in self.tree.snapshot() if o is not layer]
        bound.arguments["layer_idx"] = _Index(n, self)
        result = cls.update(*bound.args, **bound.kwargs)
        if _changed(snap) or not was.keys() <= vars(layer).keys():
            self.escape("an update that changed more than its layer")
        sets = []
        for k, v in vars(layer).items():
            if k in was and was[k] is v:
                continue
            if isinstance(v, torch.Tensor):
                sets.append((k, ("out", len(self.outs), (tuple(v.shape), tuple(v.stride()), v.dtype, v.device))))
                self.outs.append(v)
            elif _plain(v):
                sets.append((k, ("value", v)))
            else:
                self.escape("an update that set a value a template cannot stand for")
        self.record.append(Update(self.leaf, path, at, type(layer), before, tuple(sets)))
        return result


def stand_ins(leaves: tuple, positions, log: list, record: list, outs: list) -> dict:
    """``{leaf position: CacheStandIn}`` for a template's trace; ``record`` gets its uses in order
    and ``outs`` the tensors its updates set."""
    if len({id(leaves[i]) for i in positions}) < len(positions):
        log.append("one cache passed twice")
        raise Escaped("one cache was passed twice")
    return {i: CacheStandIn(_Traced(leaves[i], i, log, record, outs), ()) for i in positions}


def bind(record: tuple, leaves: tuple, values: tuple) -> list | None:
    """Replay ``record`` on copies of this call's caches (``leaves``; the block's own varying
    ``values``), the template's extra outputs as fakes of theirs: the steps to :func:`replay`,
    or None when a layer is not as the template's was or a question gets another answer."""
    trees: dict = {}
    mode = None
    steps = []
    if len({id(leaves[r.leaf]) for r in record}) < len({r.leaf for r in record}):
        return None     # one cache passed twice: its copies would be two
    for r in record:
        tree = trees.get(r.leaf)
        if tree is None:
            if cache_key(leaves[r.leaf]) is None:
                return None
            tree = trees[r.leaf] = _Tree(leaves[r.leaf])
        obj = tree.copies.get(r.path)
        if obj is None:
            return None
        if type(r) is Ask:
            got = _asked(obj, r.name, [_arg(a, values) for a in r.args], tree)
            if got is None or got[0] != r.answer:
                return None
            continue
        n = _index(r.at, values)
        if type(r) is SetItem:
            if type(obj) is not dict:
                return None
            obj[n] = r.value
            steps.append((r, n))
            continue
        layers = vars(obj).get("layers")
        if type(layers) is not list or not 0 <= n < len(layers):
            return None
        layer = layers[n]
        if type(layer) is not r.kind or _fingerprint(layer) != r.before:
            return None
        mode = mode or detect_fake_mode() or FakeTensorMode()
        for k, (kind, v, *meta) in r.sets:
            setattr(layer, k, fresh_fakes(mode, meta)[0] if kind == "out" else v)
        steps.append((r, n))
    return steps


def _real(leaves, r):
    obj = leaves[r.leaf]
    for name in r.path:
        obj = vars(obj)[name]
    return obj


def replay(steps: list, leaves: tuple, extra: list) -> None:
    """Set on each call's own cache what the template's record set, with this call's tensors."""
    for r, n in steps:
        obj = _real(leaves, r)
        if type(r) is SetItem:
            obj[n] = r.value
            continue
        layer = vars(obj)["layers"][n]
        for k, (kind, v, *_) in r.sets:
            setattr(layer, k, extra[v] if kind == "out" else v)
