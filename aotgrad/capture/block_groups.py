"""Which submodules are twins: the structural keys :mod:`.blocks` groups repeated blocks by.

:func:`find_groups` sorts a module's submodules by structure: same class, same non-tensor
attributes (by value, or by identity for objects; plain scalars such as ``layer_idx`` by type,
their values kept per :class:`Member`), same parameters and buffers (shape, stride, dtype,
device, requires_grad, tying), no hooks, recursively.
"""
from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch

from .. import errors, tracing
from ..inputs.fsdp_graph import Lowered
from ..guards import reads
from ..guards.state import _GLOBAL_HOOKS
from ..guards.writes import HOOK_EXTRAS, HOOKS
from ..runtime.call import bits
from ..tracing.tree import places

_HOOKS = HOOKS + HOOK_EXTRAS
_OWN = {"_parameters", "_buffers", "_modules", *_HOOKS}


_MARKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # module or module class -> reuse


def block(obj=None, *, reuse: bool = True):
    """Mark a module, or a module class (every instance, subclasses included), for block reuse.

    ``reuse=True`` makes it a block candidate though it has no submodules (a layer written with
    raw parameters); twins are still found by structure, and a call a template cannot stand for
    still runs flat. ``reuse=False`` keeps it out: it is always traced flat (blocks inside it are
    still candidates). An instance's mark wins over its class's. Works as a decorator, with or
    without arguments: ``@aotgrad.block``, ``@aotgrad.block(reuse=False)``. Marks change how a
    capture is traced, never its numbers: a model already compiled keeps its graph."""
    if obj is None:
        return lambda o: block(o, reuse=reuse)
    if not isinstance(reuse, bool):
        raise errors.OptionError(f"aotgrad.block: reuse must be True or False, not {reuse!r}")
    if not (isinstance(obj, torch.nn.Module) or isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        raise errors.OptionError(f"aotgrad.block marks an nn.Module or an nn.Module class, not {type(obj).__name__}: "
                                 "block reuse finds repeated submodules (wrap a repeated function in a module)")
    _MARKS[obj] = reuse
    return obj


def marked(m: torch.nn.Module) -> bool | None:
    """The mark :func:`block` gave ``m`` or its nearest marked class, or None."""
    if not _MARKS:
        return None
    mark = _MARKS.get(m)
    if mark is None:
        mark = next((_MARKS[c] for c in type(m).__mro__ if c in _MARKS), None)
    return mark


class _Unlike(Exception):
    """A value no structural key can stand for (a tensor attribute): the module is not reused."""


_EMPTY = {t: (t, ()) for t in (tuple, list, set, frozenset, dict, collections.OrderedDict)}   # (a module's own dicts)


def _value_key(v, depth=0):
    if depth > 8:
        raise _Unlike
    empty = _EMPTY.get(type(v))     # (exact builtin types: their truth is their length, no user code)
    if empty is not None and not v:
        return empty
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return (type(v), bits(v))      # floats by their bits: blocks with 0.0 and -0.0 are not twins
    if isinstance(v, torch.Tensor):
        raise _Unlike
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(x, depth + 1) for x in v))
    if isinstance(v, (set, frozenset)):
        return (type(v), tuple(sorted(repr(_value_key(x, depth + 1)) for x in v)))
    if isinstance(v, dict):
        return (type(v), tuple((repr(k), _value_key(x, depth + 1)) for k, x in v.items()))
    if isinstance(v, torch.nn.Module):
        raise _Unlike
    return ("id", id(v))    # functions, configs, anything else: the very same object


def _tensor_key(t):
    if t is None:
        return None
    if type(t) not in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", torch.nn.Parameter)):
        raise _Unlike       # a tensor subclass: the template's plain fakes would not stand for it
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.is_leaf)


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _module_key(m: torch.nn.Module, keys: dict):
    """Structural key of ``m`` (cached in ``keys`` by id); raises :class:`_Unlike`. A plain scalar
    attribute (``layer_idx``, ``p``, ``training``) counts by its type here; its value is one of
    the block's :func:`_scalars`, which templates compare when their trace read it."""
    hit = keys.get(id(m))
    if hit is not None:
        return hit
    d = m.__dict__
    if any(d.get(h) for h in _HOOKS):
        raise _Unlike
    attrs = tuple((k, ("scalar", type(v)) if type(v) in _SCALARS else _value_key(v))
                  for k, v in d.items() if k not in _OWN)
    params = tuple((k, _tensor_key(p), bool(p is not None and p._backward_hooks)) for k, p in m._parameters.items())
    bufs = tuple((k, _tensor_key(b)) for k, b in m._buffers.items())
    kids = tuple((k, _module_key(c, keys) if c is not None else None) for k, c in m._modules.items())
    key = keys[id(m)] = (type(m), attrs, params, bufs, kids)
    return key


def _scalars(where: list, own: dict) -> tuple:
    """``((path, attr), value key)`` of every plain scalar attribute of a module and its submodules
    (``where``: its :func:`_walk`), in the order the structural key lists them (the same for every twin);
    each module's own found once (``own``, by id: a block's walk and its inner blocks' share them)."""
    out = []
    for path, sub in where:
        mine = own.get(id(sub))
        if mine is None:
            mine = own[id(sub)] = tuple((k, (type(v), bits(v))) for k, v in sub.__dict__.items()
                                        if k not in _OWN and type(v) in _SCALARS)
        out += [((path, k), v) for k, v in mine]
    return tuple(out)


def _ties(where: list) -> tuple:
    """Which state entries hold the same tensor, and which submodules are the same object."""
    first: dict = {}
    state = [first.setdefault(id(t), len(first)) for _, t in _state(where)]
    mods: dict = {}
    kids = [mods.setdefault(id(c), len(mods)) for _, c in where]
    return tuple(state), tuple(kids)


def _walk(m: torch.nn.Module, walks: dict) -> list:
    """``list(m.named_modules(remove_duplicate=False))``, walked once per module (``walks``, by id)."""
    got = walks.get(id(m))
    if got is None:
        got = walks[id(m)] = places(m) or list(m.named_modules(remove_duplicate=False))
    return got


def _state(where: list):
    """``((module __dict__, kind, attr), tensor)`` of every parameter and buffer of a module (``where``:
    its :func:`_walk`), duplicates included, in a fixed order (the dict by name: see
    :func:`..inputs.flatten.state_homes`)."""
    for _, sub in where:
        for kind in ("_parameters", "_buffers"):
            for attr, t in sub.__dict__[kind].items():
                if t is not None:
                    yield (sub.__dict__, kind, attr), t


@dataclass
class Member:
    """One block: its group, where its distinct state tensors live, its submodules by path, the
    values of its scalar attributes that differ among its twins (``layer_idx``)."""
    group: int
    firsts: tuple       # (module __dict__, kind, attr) of each distinct state tensor, in template order
    homes: tuple        # (module __dict__, kind, attr, index into firsts) of every state entry
    paths: dict         # path -> submodule
    varying: tuple = ()     # (path, attr) of each scalar attribute whose value differs among the twins
    values: tuple = ()      # this block's value key of each
    inner: bool = False     # inside another group's block: called only when that block runs flat


def _member(gid: int, where: list, varying=(), values=(), inner=False) -> Member:
    index: dict = {}
    firsts, homes = [], []
    for home, t in _state(where):
        if id(t) not in index:
            index[id(t)] = len(firsts)
            firsts.append(home)
        homes.append((*home, index[id(t)]))
    return Member(gid, tuple(firsts), tuple(homes), dict(where), varying, values, inner)


def hooked(m: Member) -> bool:
    """Whether a hook was registered on the block (a submodule, or globally) since the twins were
    found: the program registered it while running (HF installs its output-capturing hooks on the
    first forward that asks for hidden states), and a template's calls would not run it."""
    return _global_hooks() or any(getattr(sub, h, None) for sub in m.paths.values() for h in _HOOKS)


def _global_hooks() -> bool:
    """Whether a module hook is registered for every module (``register_module_forward_hook``...)."""
    g = torch.nn.modules.module
    return any(getattr(g, name, None) for name in _GLOBAL_HOOKS)


def _varying(grp, walks: dict, own: dict) -> tuple:
    """Positions among the twins' scalars (:func:`_scalars`) where their values differ."""
    scalars = [_scalars(_walk(m, walks), own) for _, m in grp]
    return tuple(i for i in range(len(scalars[0])) if len({s[i][1] for s in scalars}) > 1), scalars


def repeated(setup, enabled: bool = True) -> dict:
    """The repeated blocks of the module ``setup`` traces (:func:`find_groups`); none where reuse is off,
    the function is not a module, no read recording watches the trace, sizes are symbolic or module
    calls already go elsewhere (FSDP2 units, lowered)."""
    if not (enabled and isinstance(setup.fn, torch.nn.Module) and reads.watching() is not None
            and setup.session.dynamic is False) or isinstance(tracing.current().blocks, Lowered):
        return {}
    with reads.paused():        # our own walk over the modules: no user code runs in it
        return find_groups(setup.fn)


def find_groups(root: torch.nn.Module) -> dict:
    """``id(module) -> Member`` for the submodules (with children, or marked by :func:`block`) that have a twin: twins when
    they differ only in the values of scalar attributes (``layer_idx``), which a template compares
    where its trace read them. A block inside another group's block is ``inner``: its calls come
    only when the outer block runs flat (its template refused, or read a value that block has alone)."""
    if _global_hooks():
        return {}
    keys: dict = {}
    walks: dict = {}        # id(module) -> its walk, taken once for every question asked of it
    by_key: dict = {}
    for name, m in root.named_modules():
        mark = marked(m) if name else False
        if mark is False or not m._modules and mark is not True:
            continue
        try:
            k = (_module_key(m, keys), _ties(_walk(m, walks)))
        except _Unlike:
            continue
        by_key.setdefault(k, []).append((name, m))
    chosen = sorted((grp for grp in by_key.values() if len(grp) > 1), key=lambda grp: grp[0][0].count("."))
    members: dict = {}
    taken: list = []
    held: dict = {}         # id(module) -> its own scalars (_scalars)
    for gid, grp in enumerate(chosen):
        where, scalars = _varying(grp, walks, held)
        varying = tuple(scalars[0][i][0] for i in where)
        for (name, m), own in zip(grp, scalars):
            inner = any(name.startswith(t + ".") for t in taken)
            taken.append(name)
            members[id(m)] = _member(gid, _walk(m, walks), varying, tuple(own[i][1] for i in where), inner)
    return members
