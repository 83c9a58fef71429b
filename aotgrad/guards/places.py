"""Where a read is: the place a value is read from (``locate``: a dict and its key, an object and its
attribute, a cell), the holders a guard reads through where the place is no container (a switch's
getter, a ``ContextVar``'s value in the checking context, a dict's names), and a read's path: how a
fresh process finds the same place again from its roots (``reresolve``, the disk cache's).
"""
from __future__ import annotations

import functools
import sys
import threading
import types

import torch

from .._torch import CUSTOM_OPS, SWITCH_GETTERS, SWITCH_VALUES
from ..tracing.patches import module_call
from ..tracing.views import real
from . import c_calls
from .reads import is_library
from .state import _EQ_TYPES, Read, by_item, freeze


def locate(obj, kind, key):
    """``(where, key)`` that ``obj.key`` / ``obj[key]`` reads from, or None where the value is a
    library constant or not found in a place a guard can watch."""
    if kind == "item":
        if isinstance(obj, tuple):      # immutable: read where the tuple was (``type(self).__mro__[1]``)
            return (obj, key) if type(key) is int and -len(obj) <= key < len(obj) else None
        return (obj, key) if isinstance(obj, (dict, types.MappingProxyType)) and key in obj else None
    if isinstance(obj, type) and key in ("__dict__", "__mro__", "__bases__", "__base__"):
        return None if is_library(obj) else (obj, key)      # a user class's own dict, its bases
    if kind == "cell":      # (3.12's ``super()`` loads the cell ``__class__`` by name)
        code = getattr(obj, "__code__", None)
        if code is None or key not in code.co_freevars:
            return None
        return obj.__closure__[code.co_freevars.index(key)], None
    if key in ("__class__", "__dict__"):    # ``type(self).x``, ``vars(self)["x"]``: the object's class, its dict
        return None if isinstance(obj, type) or key == "__dict__" and not isinstance(
            getattr(obj, "__dict__", None), dict) else (obj, key)
    if isinstance(obj, types.FunctionType):
        return (obj, key) if key in ("__defaults__", "__kwdefaults__", "__code__") else None
    if isinstance(obj, (types.MethodType, types.BuiltinMethodType)):     # (``Fn.apply``, a builtin on torch 2.14)
        return (obj, key) if key in ("__self__", "__func__") and hasattr(obj, key) else None
    if isinstance(obj, functools.partial):
        return (obj, key) if key in ("func", "args", "keywords") else None
    if isinstance(obj, types.ModuleType):
        return None if is_library(obj) or key not in vars(obj) else (vars(obj), key)
    d = getattr(obj, "__dict__", None)
    if isinstance(obj, threading.local):    # its ``__dict__`` is the reading thread's: read through it
        return (obj, key) if key in d else None
    if isinstance(d, dict) and key in d and not isinstance(obj, type):
        return d, key
    cls = obj if isinstance(obj, type) else type(obj)
    for c in cls.__mro__:
        if key in vars(c):
            if is_library(c):
                return None
            # a ``__slots__`` member holds the object's own value, read through the object
            slot = isinstance(vars(c)[key], types.MemberDescriptorType) and cls is not obj
            return (obj, key) if slot else (vars(c), key)
    if isinstance(obj, torch.nn.Module):
        for store in ("_parameters", "_buffers", "_modules"):
            if key in d[store]:
                return real(d[store]), key
    return None


_CALLABLES = (types.FunctionType, functools.partial)     # followed though library-made: their code, cells, arguments
def _state_of_library(obj) -> bool:
    """An instance of a library class holding its own attributes (a config, ``types.SimpleNamespace``,
    ``argparse.Namespace``): its values are the user's, so loads the code makes from it are followed."""
    return not isinstance(obj, (type, types.ModuleType, torch.Tensor)) and type(obj) not in _EQ_TYPES \
        and isinstance(getattr(obj, "__dict__", None), dict)


def _stops(obj) -> bool:
    """Whether loads from ``obj`` are not followed: tensors and plain values are traced or
    compared whole; library objects are constant (library modules are an exception)."""
    if type(obj) in _EQ_TYPES or isinstance(obj, (torch.Tensor, types.FunctionType, types.BuiltinFunctionType)):
        return True
    if isinstance(obj, torch.nn.Module):
        return False
    if isinstance(obj, types.ModuleType):
        return is_library(obj)
    return is_library(obj if isinstance(obj, type) else type(obj))


_UNSET = object()
def _module_state(value) -> bool:
    """Whether a value loaded from a library's module is followed: a plain value (a flag its
    ``set_...`` function assigns), a module, a container (``sys.argv``, ``warnings.filters``) or an
    object holding its own attributes (``logging.root``, ``torch._tensor_str.PRINT_OPTS``), as the
    same object is where a user global names it (``from torch._tensor_str import PRINT_OPTS``).
    Functions, classes and other callables are the library's code: read by identity, not followed."""
    return type(value) in _EQ_TYPES or isinstance(value, (types.ModuleType, list, dict, set)) or (
        _state_of_library(value) and not callable(value))


class _Names:
    """A dict's names, where a guard reads them (``.names``: its keys, in order)."""
    __slots__ = ("d",)

    def __init__(self, d):
        self.d = d

    @property
    def names(self):
        return tuple(self.d)


class _Called:
    """What a call with no arguments answers, where a guard reads it (``.value``): one of torch's
    switches (its getter), the object a weak reference points to."""
    __slots__ = ("getter",)

    def __init__(self, getter):
        self.getter = getter

    @property
    def value(self):
        return self.getter()


class _Fixed:
    """An object a guard reads whole (``.value``): an argument the call's match holds by identity."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _ContextValue:
    """A ``contextvars.ContextVar`` read where a guard reads: ``.value`` is its value in the context
    the check runs in (a value guard fails where it has none)."""
    __slots__ = ("var",)

    def __init__(self, var):
        self.var = var

    @property
    def value(self):
        return self.var.get(_UNSET)


MODULE_CALLER = _Called(module_call)
"""Where ``Module.__call__`` is read (path ``("module call", None)``): as the program has it."""


def custom_op(name: str) -> _Called:
    """Where the ``torch.library.custom_op`` named ``name`` is read (path ``("custom op", name)``): as
    torch's registry of them holds it now (None once it is gone)."""
    return _Called(functools.partial(CUSTOM_OPS.get, name))


def _global_path(g: dict, name: str):
    """The path of global ``name`` of the module whose globals are ``g`` (None where it has no name)."""
    module = g.get("__name__")
    return ("G", module, ("attr", name)) if isinstance(module, str) else None


def _own_item(path, key):
    """The path of entry ``key`` of the object's own dict at ``path`` (None where it has none)."""
    return path + (("attr", "__dict__"), ("item", key)) if path else None


def _class_item(path, i, key):
    """The path of entry ``key`` of the own dict of class ``type(obj).__mro__[i]`` of the object at ``path``."""
    return path + (("class", i), ("own", key)) if path else None


def _mro_item(path, i, key):
    """The path of entry ``key`` of the own dict of class ``cls.__mro__[i]`` of the class at ``path``."""
    return path + (("attr", "__mro__"), ("item", i), ("own", key)) if path else None


def _class_path(cls):
    """The path of a class its module holds under its name (None where it holds another, or none)."""
    module = sys.modules.get(getattr(cls, "__module__", None))
    return ("G", cls.__module__, ("attr", cls.__name__)) if module is not None and \
        vars(module).get(cls.__name__) is cls else None


def read_at(where, key):
    if isinstance(where, types.CellType):
        return where.cell_contents
    return where[key] if isinstance(where, tuple) or by_item(where, key) else getattr(where, key)


def _resolve_path(fn, leaves, path):
    """``(where, key)`` that ``path`` names in this process, or None where it leads nowhere."""
    root, arg, *steps = path
    if root == "switch":
        getter = c_calls.GETTERS.get(arg) or SWITCH_VALUES.get(arg) or next(
            (f for f, n in SWITCH_GETTERS.items() if n == arg), None)
        return (_Called(getter), "value") if getter is not None else None
    if root == "module call":
        loc = MODULE_CALLER, "value"
    elif root == "custom op":
        loc = custom_op(arg), "value"
    elif not steps:
        return None
    else:
        (kind, key), steps = steps[0], steps[1:]
        if root == "G":
            module = sys.modules.get(arg)
            loc = None if module is None else (vars(module), key)
        else:
            loc = _step(fn if root == "fn" else leaves[arg] if arg < len(leaves) else None, kind, key)
    for kind, key in steps:
        if loc is None:
            return None
        try:
            obj = read_at(*loc)
        except (KeyError, AttributeError, ValueError):
            return None
        loc = _step(obj, kind, key)
    return loc


def _step(obj, kind, key):
    if kind == "class":
        return type(obj).__mro__, key
    if kind == "own":
        return vars(obj), key
    if isinstance(obj, (types.MethodType, types.BuiltinMethodType)):    # (``Fn.apply`` held: its ``__self__``)
        return locate(obj, kind, key)
    if isinstance(obj, types.ModuleType) and _stops(obj):     # a library's module (see Resolver._follow)
        value = vars(obj).get(key, _UNSET)
        return (vars(obj), key) if kind == "attr" and (_module_state(value) or callable(value)) else None
    if _stops(obj) and kind == "attr" and not isinstance(obj, _CALLABLES) and not _state_of_library(obj):
        return None
    if kind == "item" and isinstance(obj, dict) and key not in obj:
        return obj, key         # an absent entry (``hasattr`` False): the read says "absent"
    if kind == "attr" and isinstance(obj, types.ModuleType) and key not in vars(obj):
        return vars(obj), key   # a user module's name not defined (a library's stopped above)
    return locate(obj, kind, key)


def reresolve(fn, leaves, root_name, stored) -> list | None:
    """The reads a stored entry assumed, found again from this call's roots: one ``Read`` per
    ``(path, kind, source)`` holding today's value, or None when some path leads nowhere."""
    out = []
    for path, kind, source in stored:
        loc = _resolve_path(fn, leaves, path)
        if loc is None:
            return None
        where, key = loc
        try:
            now = read_at(where, key)
        except (KeyError, AttributeError, ValueError):
            if kind != "absent":
                return None
            now = None
        value = {"frozen": lambda: freeze(now), "len": lambda: len(now), "dict": lambda: dict(now),
                 "absent": lambda: None, "empty": lambda: None}.get(kind, lambda: now)()
        out.append(Read(source, path, where, key, value, kind))
    return out
