"""What each call of a repeated block has of its own: the varying int attributes (``layer_idx``)
and the layer of a KV cache the block updates at that index.

A template is first traced with each varying int attribute of the block replaced, for the tracing
thread alone, by a :class:`Stand`: an object that any use but passing it along (arithmetic,
comparison, hashing, ``int()``, indexing or slicing a list, formatting, a torch op taking it)
makes raise :class:`Escaped`. A trace none escaped from did not let those values shape its graph,
so the template stands for every twin whatever they hold; a trace one escaped from is done again
with the real values (the template then stands for the twins with the same ones).

A cache argument (an object whose ``layers`` is a list and whose class has an ``update`` taking
``layer_idx``: HF's ``DynamicCache``) reaches the template's trace as a :class:`CacheStandIn`.
Its ``update(k, v, layer_idx, ...)`` runs the cache class's own ``update`` on a copy of the cache
whose layer at that index is a copy of the real one; any other use of it escapes. What the update
set on the layer copy is the call's :class:`Effect`: its tensors are extra outputs of the
template, and each call (the first included) sets them on its own cache's layer at its own
index, just as eager's ``update`` leaves it. A call whose layer is not as the template's was
(another class, other attributes, a tensor already held) runs flat.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch

from ..guards import reads
from ..runtime.call import bits

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class Escaped(BaseException):
    """A per-call value was used (a BaseException: the program's own ``except Exception`` must not
    hide it from the trace)."""


class Stand:
    """Stands for a block's varying int attribute ``index`` (its position in ``Member.varying``)
    while a template is traced; ``value`` is the traced block's own. ``isinstance(s, int)`` holds;
    everything else raises :class:`Escaped` and is noted in ``log``."""
    __slots__ = ("index", "value", "log")

    def __init__(self, index: int, value: int, log: list):
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "log", log)

    @property
    def __class__(self):
        return int


def _escape(self, *args, **kwargs):
    what = f"{object.__getattribute__(self, 'index')}"
    object.__getattribute__(self, "log").append(what)
    raise Escaped(f"a per-call value ({what}) was used")


_KEEP = {"__class__", "__new__", "__init__", "__getattribute__", "__init_subclass__", "__subclasshook__",
         "__doc__", "__dir__", "__sizeof__", "__slots__"}
for _name in dir(int):
    if _name in _KEEP:
        continue
    if _name.startswith("__"):
        setattr(Stand, _name, _escape)
    else:       # bit_length, real, numerator...: reading the attribute escapes
        setattr(Stand, _name, property(_escape))
for _name in ("__setattr__", "__delattr__", "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__",
              "__iter__", "__len__", "__getitem__", "__contains__", "__call__", "__fspath__", "__array__"):
    setattr(Stand, _name, _escape)


def stands(m, log: list) -> dict:
    """``{index into m.varying: Stand}`` for the block's varying attributes holding an int."""
    return {i: Stand(i, v[1], log) for i, v in enumerate(m.values) if v[0] is int}


def in_graph(gm) -> bool:
    """Whether a node of ``gm`` holds a :class:`Stand` among its arguments (an op given one)."""
    def has(a):
        if type(a) is Stand:
            return True
        if isinstance(a, (list, tuple)):
            return any(has(x) for x in a)
        return isinstance(a, dict) and any(has(x) for x in a.values())
    return any(has(n.args) or has(n.kwargs) for n in gm.graph.nodes)


# ---------------------------------------------------------------- caches

def _fingerprint(obj, skip=()) -> tuple | None:
    """An object's own attributes by name, type and value when all are plain (None, numbers,
    strings, dtypes, devices, classes: compared by identity), else None."""
    out = []
    for k, v in vars(obj).items():
        if k in skip:
            continue
        if type(v) in _PLAIN:
            out.append((k, type(v), bits(v)))
        elif isinstance(v, type):
            out.append((k, type, id(v)))
        else:
            return None
    return tuple(out)


def _updates_by_index(cls) -> bool:
    up = getattr(cls, "update", None)
    if not isinstance(up, types.FunctionType):
        return False
    try:
        return "layer_idx" in inspect.signature(up).parameters
    except (TypeError, ValueError):
        return False


def cache_key(x):
    """A call argument's key when it is a cache a template can take (its ``layers`` a list, its
    class's ``update`` by ``layer_idx``, its other attributes plain), else None."""
    d = getattr(x, "__dict__", None)
    if not isinstance(d, dict) or type(d.get("layers")) is not list or not _updates_by_index(type(x)):
        return None
    fp = _fingerprint(x, skip=("layers",))
    return None if fp is None else ("cache", id(type(x)), fp)


@dataclass(frozen=True)
class Effect:
    """What one ``update`` of a cache argument did to its layer: ``leaf`` is the argument's place
    among the call's leaves, ``at`` the layer (``("stand", i)``: the block's varying int ``i``;
    ``("int", n)``), ``kind``/``before`` the layer's class and plain attributes it had, ``sets`` each
    attribute update set: ``("out", k)`` the template's ``k``-th extra output, or ``("value", v)``."""
    leaf: int
    at: tuple
    kind: type
    before: tuple
    sets: tuple


class CacheStandIn:
    """A cache argument while a template is traced: only ``update`` by ``layer_idx``, recorded."""

    def __init__(self, real, leaf: int, log: list, effects: list, outs: list):
        object.__setattr__(self, "_state", (real, leaf, log, effects, outs, set()))

    @property
    def __class__(self):
        return type(object.__getattribute__(self, "_state")[0])

    def __getattribute__(self, name):
        if name in ("update", "__class__"):
            return object.__getattribute__(self, name)
        object.__getattribute__(self, "_state")[2].append(f"cache.{name}")
        raise Escaped(f"the cache's {name} was used")

    def update(self, *args, **kwargs):
        real, leaf, log, effects, outs, done = object.__getattribute__(self, "_state")
        cls = type(real)
        try:
            bound = inspect.signature(cls.update).bind(real, *args, **kwargs)
        except TypeError:
            log.append("cache.update arguments")
            raise Escaped("the cache's update was called with other arguments") from None
        idx = bound.arguments.get("layer_idx")
        if type(idx) is Stand:
            at, n = ("stand", object.__getattribute__(idx, "index")), object.__getattribute__(idx, "value")
        elif type(idx) is int:
            at, n = ("int", idx), idx
        else:
            at, n = None, None
        layers = vars(real)["layers"]
        layer = layers[n] if at is not None and 0 <= n < len(layers) and n not in done else None
        before = _fingerprint(layer) if layer is not None else None
        if before is None:
            log.append("cache layer")
            raise Escaped("the cache's layer at that index holds state a template cannot stand for")
        done.add(n)
        copy, clone = object.__new__(cls), object.__new__(type(layer))
        vars(copy).update(vars(real))
        vars(clone).update(vars(layer))
        vars(copy)["layers"] = held = [*layers[:n], clone, *layers[n + 1:]]
        rec = reads.watching()
        if rec is not None:     # the copies' writes are the template's own, not the program's
            rec.writes.made_here(copy, clone)
        bound.arguments["self"], bound.arguments["layer_idx"] = copy, n
        result = cls.update(*bound.args, **bound.kwargs)
        own = dict(vars(real), layers=held)
        if vars(copy).keys() != own.keys() or any(vars(copy)[k] is not v for k, v in own.items()) or \
                len(held) != len(layers) or any(a is not b for a, b in zip(held, [*layers[:n], clone, *layers[n + 1:]])):
            log.append("cache update")
            raise Escaped("the cache's update changed more than the layer at its index")
        if not set(vars(layer)) <= set(vars(clone)):
            log.append("cache update")
            raise Escaped("the cache's update removed a layer attribute")
        sets = []
        for k, v in vars(clone).items():
            if k in vars(layer) and vars(layer)[k] is v:
                continue
            if isinstance(v, torch.Tensor):
                sets.append((k, ("out", len(outs))))
                outs.append(v)
            elif type(v) in _PLAIN or isinstance(v, type):
                sets.append((k, ("value", v)))
            else:
                log.append("cache update")
                raise Escaped("the cache's update set a value a template cannot stand for")
        effects.append(Effect(leaf, at, type(layer), before, tuple(sets)))
        return result


def _cache_escape(self, *args, **kwargs):
    object.__getattribute__(self, "_state")[2].append("cache operator")
    raise Escaped("the cache was used other than by update")


# Operators the interpreter finds on the type, not through __getattribute__: the real cache's
# answers (its len, truthiness, items) could differ from a stand-in's, so each escapes.
for _name in ("__bool__", "__len__", "__iter__", "__getitem__", "__setitem__", "__contains__", "__eq__",
              "__ne__", "__call__", "__enter__", "__exit__"):
    setattr(CacheStandIn, _name, _cache_escape)
CacheStandIn.__hash__ = object.__hash__


def layers_for(effects: tuple, leaves: tuple, values: tuple) -> list | None:
    """The layer each effect sets in this call (its cache among the call's ``leaves``, the index
    from the block's own varying ``values``), or None when one is not as the template's was."""
    found, seen = [], set()
    for e in effects:
        layers = vars(leaves[e.leaf]).get("layers")
        n = values[e.at[1]][1] if e.at[0] == "stand" else e.at[1]
        if type(layers) is not list or not 0 <= n < len(layers) or (e.leaf, n) in seen:
            return None
        layer = layers[n]
        if type(layer) is not e.kind or _fingerprint(layer) != e.before:
            return None
        seen.add((e.leaf, n))
        found.append(layer)
    return found


def replay(effects: tuple, layers: list, extra: list) -> None:
    """Set on each layer what the template's update set, with this call's tensors."""
    for e, layer in zip(effects, layers):
        for k, (kind, v) in e.sets:
            setattr(layer, k, extra[v] if kind == "out" else v)
