"""What each call of a repeated block has of its own: the varying int attributes (``layer_idx``);
the cache arguments it updates at that index are :mod:`.caches`.

A template is first traced with each varying int attribute of the block replaced, for the tracing
thread alone, by a :class:`Stand`: an object that any use but passing it along (arithmetic,
comparison, hashing, ``int()``, indexing or slicing a list, formatting, a torch op taking it)
makes raise :class:`Escaped`. A trace none escaped from did not let those values shape its graph,
so the template stands for every twin whatever they hold; a trace one escaped from is done again
with the real values (the template then stands for the twins with the same ones).
"""
from __future__ import annotations


class Escaped(BaseException):
    """A per-call value was used (a BaseException: the program's own ``except Exception`` must not
    hide it from the trace)."""


class Stand:
    """Stands for a block's varying int attribute ``index`` (its position in ``Member.varying``)
    while a template is traced; ``value`` is the traced block's own. ``isinstance(s, int)`` holds
    (noted in ``asked``: library code that goes on to treat it as an int, ``json.dumps``, fails
    where an int would not); everything else raises :class:`Escaped` and is noted in ``log``.
    What no method of an object can see, ``type(s)``, ``s is t`` and ``id(s)``, the caller checks
    (``blocks.Reuse._trace_with``)."""
    __slots__ = ("index", "value", "log", "asked")

    def __init__(self, index: int, value: int, log: list, asked: list):
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "log", log)
        object.__setattr__(self, "asked", asked)

    @property
    def __class__(self):
        object.__getattribute__(self, "asked").append(object.__getattribute__(self, "index"))
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


def stands(m, log: list, asked: list) -> dict:
    """``{index into m.varying: Stand}`` for the block's varying attributes holding an int."""
    return {i: Stand(i, v[1], log, asked) for i, v in enumerate(m.values) if v[0] is int}


def in_graph(gm) -> bool:
    """Whether a node of ``gm`` holds a :class:`Stand` among its arguments (an op given one)."""
    def has(a):
        if type(a) is Stand:
            return True
        if isinstance(a, (list, tuple)):
            return any(has(x) for x in a)
        return isinstance(a, dict) and any(has(x) for x in a.values())
    return any(has(n.args) or has(n.kwargs) for n in gm.graph.nodes)
