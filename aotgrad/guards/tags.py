"""Dict version tags, and the per-call state check built over them.

CPython gives every dict a version tag (``ma_version_tag``): every insert, delete or new value changes it,
and no two dicts share one, so an unchanged tag proves a dict unwritten and the same dict. ``dict_version``
reads it: from aotgrad's C module (``_tags.c``, built by ``pip install``), else torch's copy, else None
(no such tag, or tags that miss writes: every check then reads the dicts' entries). It raises on a
non-dict, and a subclass reordered in place (``OrderedDict.move_to_end``) keeps its tag: callers use it
on plain dicts.

``state_check`` is the whole check a call makes of a compiled entry's module tree once its tags have
held (:class:`aotgrad.guards.state._Check`): each module's ``__dict__`` and each held dict by tag, each
module's type and each held hook dict's emptiness, one C loop (about 1 ns a value, where a Python pass
of ``any`` costs 8 and a guard-manager leaf 11).
"""
from __future__ import annotations

import collections

import torch

from .. import _torch

try:
    from ._tags import StateCheck, dict_version
except ImportError:         # not built (no compiler, or a Python without ``ma_version_tag``)
    StateCheck, dict_version = None, _torch.dict_version


def _tags_follow_writes() -> bool:
    """Whether every way Python code writes an object's attribute or a dict's item changes the dict's
    version tag. Python 3.13 keeps an instance's attributes in the object's inline values, and
    ``obj.k = v`` there leaves its ``__dict__``'s tag as it was: a guard by tag would miss the write."""
    class Probe:
        pass
    p, m = Probe(), torch.nn.Module()
    p.k = m.k = 0
    tags = [dict_version(p.__dict__), dict_version(m.__dict__)]
    p.k, m.k = 1, 1
    setattr(p, "j", 0)
    p.__dict__["k"] = 2
    tags += [dict_version(p.__dict__), dict_version(m.__dict__)]
    return tags[0] != tags[2] and tags[1] != tags[3] and len(set(tags)) == 4


if dict_version is not None and not _tags_follow_writes():
    dict_version = StateCheck = None     # every check reads the dicts' entries instead

# The dicts whose length the C check reads as CPython's entry count: another subclass may define its own.
EMPTY_IN_C = (dict, collections.OrderedDict)


def state_check(owners, dicts, tags, objects, types, empties):
    """``check() -> bool``: the i-th of ``dicts`` (read as ``owners[i].__dict__`` for the first
    ``len(owners)``) still has tag ``tags[i]``, each of ``objects`` is of the type at its place in ``types``,
    and each of ``empties`` (``EMPTY_IN_C`` only) is empty. None where the C module is not built."""
    if StateCheck is None:
        return None
    return StateCheck(tuple(owners), tuple(dicts), tuple(tags), tuple(objects), tuple(types), tuple(empties))
