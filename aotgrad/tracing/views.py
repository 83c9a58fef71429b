"""A module's parameters and buffers, held per thread while a capture traces it.

A capture runs the user's forward with traced values in place of a module's parameters and
buffers. Swapping the module's ``_parameters``/``_buffers`` entries would show them to every thread
(another thread's eager forward would get fake tensors), so :func:`holding` stands a :class:`View`
in for each dict: the real entries, as every thread reads and writes them, with each capturing
thread's own values on top for that thread alone. When no thread holds anything in it any more, the
module gets its own dict back (synchronised with what was written meanwhile): after a capture a
module is as it was, and ``torch.compile`` of it traces plain dicts.

Whatever outlives a capture (a guard checking a dict's length) holds the real dict
(:func:`real`), never a view: a view is written through to its real dict, so the real one is
current while the view stands in for it, and again after.
"""
from __future__ import annotations

import contextlib
import threading

_INSTALLING = threading.Lock()      # a view stands in, gets a layer, loses one, is put back: one at a time


class View(dict):
    """A module's ``_parameters`` or ``_buffers`` while a capture holds traced values in it (see the
    module docstring). Its own entries are the real ones; writes of them go to the real dict too."""

    def __init__(self, real: dict):
        super().__init__(real)
        self.real = real
        self.layers: dict = {}      # thread id -> [{attr: value}], innermost last

    def _mine(self):
        layers = self.layers.get(threading.get_ident())
        return layers[-1] if layers else None

    def __getitem__(self, key):
        mine = self._mine()
        return mine[key] if mine is not None and key in mine else dict.__getitem__(self, key)

    def get(self, key, default=None):
        mine = self._mine()
        return mine[key] if mine is not None and key in mine else dict.get(self, key, default)

    def __setitem__(self, key, value):
        mine = self._mine()
        if mine is not None and key in mine:
            mine[key] = value
        else:
            dict.__setitem__(self, key, value)
            self.real[key] = value

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self.real.pop(key, None)

    def items(self):
        mine = self._mine()
        return dict.items(self) if mine is None else [(k, mine.get(k, v)) for k, v in dict.items(self)]

    def values(self):
        return [v for _, v in self.items()]

    def __iter__(self):     # a Python __iter__ makes dict(view) and {**view} read through __getitem__
        return iter(dict.keys(self))

    def copy(self):
        return dict(self.items())

    def __reduce__(self):   # copied and deep-copied as the plain dict it stands for
        return dict, (dict(self.items()),)


def real(d):
    """The module's own dict ``d`` stands for (``d`` itself where it is not a view)."""
    return d.real if type(d) is View else d


def _stand_in(md: dict, kind: str) -> View:
    view = md[kind]
    if type(view) is not View:
        view = md[kind] = View(view)
    return view


def _put_back(md: dict, kind: str, view: View) -> None:
    """The module's own dict again, with what was written into the view by means other than an
    item assignment or deletion (``update``, ``pop``: those went to the view alone)."""
    own, now = view.real, dict(dict.items(view))
    for k in [k for k in own if k not in now]:
        del own[k]
    for k, v in now.items():
        if own.get(k, view) is not v:
            own[k] = v
    if md.get(kind) is view:
        md[kind] = own


@contextlib.contextmanager
def holding(homes, state):
    """The modules of ``homes`` (``(module __dict__, "_parameters" or "_buffers", attr, index)``)
    hold ``state[index]`` in place of their parameters and buffers, for this thread alone (another
    thread calling them meanwhile reads the real ones), restored whatever happens."""
    grouped: dict = {}
    for md, kind, attr, i in homes:
        grouped.setdefault((id(md), kind), (md, kind, {}))[2][attr] = state[i]
    tid, held = threading.get_ident(), []
    try:
        with _INSTALLING:
            for md, kind, values in grouped.values():
                view = _stand_in(md, kind)
                layers = view.layers.setdefault(tid, [])
                layers.append({**(layers[-1] if layers else {}), **values})
                held.append((md, kind, view))
        yield
    finally:
        with _INSTALLING:
            for md, kind, view in held:
                layers = view.layers[tid]
                layers.pop()
                if not layers:
                    del view.layers[tid]
                    if not view.layers:
                        _put_back(md, kind, view)
