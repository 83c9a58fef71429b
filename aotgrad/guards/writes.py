"""Python state the traced code writes: found, undone and refused.

The compiled graph repeats tensor work only; an assignment or a container change the trace made to
state that outlives the call (a global, a class attribute, an attribute of ``self`` or of an object
reached from a global, a global list it appends to, a dict item it sets, a closure cell of a function
defined outside the call) would happen once, at capture, and never again. So when a user code object
first runs under :func:`aotgrad.guards.reads.record`, every place such a write could reach is copied
(:meth:`Writes.enter`): its globals, ``self`` and object arguments, the free variables it sees, the
objects and containers its load chains reach (``self.cache``, ``HISTORY``, ``cfg.log``) and their
classes, and the cells it assigns with ``nonlocal``. After the trace, :meth:`Writes.undo` puts back
whatever changed and names it. Nothing runs user code while copying: chains are followed through
instance, class and module dicts only.

State made inside the call is left out: objects the trace constructed (their ``__init__`` ran while
recording), containers only the call's own frames hold (local lists passed to a helper), closure cells
of a function whose defining frame is running in the trace.
"""
from __future__ import annotations

import collections.abc
import functools
import gc
import random
import sys
import types
import warnings
import weakref
from dataclasses import dataclass

import torch

from .._torch import pytree
from ..runtime.call import VALUE_TYPES, same_value
from ..tracing.views import real

_CONTAINERS = (list, dict, set, bytearray)
_GONE = object()
# Entries Python itself writes while code runs: the warnings module's once-per-location registry.
_BOOKKEEPING = frozenset({"__warningregistry__"})
# A module's hook dicts (the extras are read only where a forward hook exists).
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
HOOK_EXTRAS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


@dataclass(slots=True)      # (a recording makes hundreds)
class Snap:
    obj: object         # the dict, class, list, set or cell that may be written
    before: object      # its shallow copy when the trace first reached it
    owner: object       # what a message names: the object whose __dict__ it is, a module name, a chain's text
    kind: str           # "attrs" (an instance's or module's dict), "class", "items" (a container), "argument"
                        # (a container the traced function was called with), "cell", "hooks" (a module's hook
                        # dict), "state" (a module's parameter, buffer or child dict), "iterator" (one the
                        # code advances: ``next(ITER)``, ``for v in self.it``), "leaks" (a library object's
                        # dict, or one it holds: only entries that took a tensor of the trace are put back)


class Built:
    """The objects constructed while recording, by identity. An id alone outlives its object, and a
    later object may take it (a ``Snap`` the recording made was then counted as a built holder): so
    each is held by a weak reference, or, not weakly referable, by itself."""
    __slots__ = ("_by_id",)

    def __init__(self):
        self._by_id: dict = {}      # id -> (weakly, reference or object)

    def add(self, obj) -> None:
        if obj is None:
            return
        try:
            self._by_id[id(obj)] = (True, weakref.ref(obj))
        except TypeError:
            self._by_id[id(obj)] = (False, obj)

    def __contains__(self, obj) -> bool:
        held = self._by_id.get(id(obj))
        return held is not None and (held[1]() if held[0] else held[1]) is obj


class Writes:
    def __init__(self, is_library):
        self.snaps: dict = {}       # id(obj) -> Snap
        self.built = Built()        # objects constructed while recording
        self.hooked: set = set()    # ids of the module dicts whose hook dicts are copied
        self.is_library = is_library
        self.generators = _generator_states()       # Python's and numpy's global random streams
        self.torch_streams: dict = {}   # id -> (torch.Generator, its state) whose own methods the code called
        self.numpy_streams: set = set()     # ids of the NumPy bit generators (or RandomStates) snapshotted
        self.memoized: dict = {}    # code of a function an lru_cache wraps -> the wrapper
        self.poisoned: dict = {}    # id(wrapper) -> (wrapper, its name): it cached a traced tensor
        self.foreign: list = []     # (globals dict, name) another thread changed meanwhile
        self.lines: dict = {}       # what a message names -> the user's line that wrote it, where seen as it ran

    def own_stream(self, stream, watch, line: str) -> None:
        """The program drew from ``stream``, a ``random.Random`` of its own, at ``line``: its state before
        the first draw is put back, and the draw refused, as a global stream's is (``_undo_generators``)."""
        name = repr(stream)
        if name not in self.generators:
            self.generators[name] = (stream.getstate(), stream.getstate, stream.setstate)
            self.lines[name] = line
        if watch is not None:
            watch.drew.add(name)

    def torch_stream(self, gen) -> None:
        """The program called a method of ``gen``, a ``torch.Generator`` (refused: ``reads.Recording.
        _generator_call``), about to run: its state before the first such call is put back."""
        if id(gen) not in self.torch_streams:
            self.torch_streams[id(gen)] = (gen, gen.get_state())

    def made_here(self, *objs) -> None:
        """Objects aotgrad made for the trace to write (a cache layer's copy): not state from before."""
        for o in objs:
            self.built.add(o)

    # ------------------------------------------------------------ before

    def attrs(self, obj):
        """Copy ``obj.__dict__`` (and its user classes' dicts): an object from before the call."""
        if obj in self.built:
            return
        d = _own_dict(obj)
        if d is not None and id(d) not in self.snaps:
            self.snaps[id(d)] = Snap(d, dict(d), obj, "attrs")
        for cls in type(obj).__mro__[:-1]:
            self.klass(cls)

    def module_hooks(self, module):
        """Copy the hook dicts of ``module`` and every module under it, before any of them runs: a
        module's forward may register hooks on its children (HF's output capturing does, once, and
        marks the model so). A subtree already copied is not walked again."""
        todo = [module]
        while todo:
            m = todo.pop()
            d = _own_dict(m)
            if d is None or id(d) in self.hooked:
                continue
            self.hooked.add(id(d))
            for key in HOOKS + HOOK_EXTRAS:
                hooks = d.get(key)
                if isinstance(hooks, dict) and id(hooks) not in self.snaps:
                    self.snaps[id(hooks)] = Snap(hooks, dict(hooks), m, "hooks")
            for key in _STATE:      # registering a buffer, a parameter or a submodule (lazy initialisation)
                state = d.get(key)
                if isinstance(state, dict) and id(state) not in self.snaps:
                    self.snaps[id(state)] = Snap(state, _entries(state), (m, key), "state")
            children = d.get("_modules")
            todo.extend(children.values() if isinstance(children, dict) else ())

    def klass(self, cls):
        if isinstance(cls, type) and not self.is_library(cls) and id(cls) not in self.snaps:
            self.snaps[id(cls)] = Snap(cls, dict(vars(cls)), cls, "class")

    def module_dict(self, g):
        if id(g) not in self.snaps:
            self.snaps[id(g)] = Snap(g, dict(g), g.get("__name__"), "attrs")

    def value(self, v, source, made_before: bool = True):
        """Copy what a write could change in ``v``; True where loads from it are followed further.
        ``made_before=False``: ``v`` is a frame's argument, which the call may have made (an autograd
        Function's ``ctx``): a library object there is not copied."""
        if isinstance(v, functools._lru_cache_wrapper):
            fn = getattr(v, "__wrapped__", None)
            if isinstance(fn, types.FunctionType):      # its misses are watched (see memoizes)
                self.memoized[fn.__code__] = (v, source)
            return False
        if type(v) in VALUE_TYPES or isinstance(v, (torch.Tensor, types.FunctionType, types.BuiltinFunctionType,
                                                    types.MethodType, types.CodeType)):
            return False
        if isinstance(v, _CONTAINERS):
            if id(v) not in self.snaps and len(v) <= 4096:
                self.snaps[id(v)] = Snap(v, _entries(v) if isinstance(v, dict) else v.copy(), source, "items")
                self._held(v, source, 1)
            return True
        if isinstance(v, type):
            self.klass(v)
            return not self.is_library(v)
        if isinstance(v, types.ModuleType):
            if self.is_library(v):
                return False
            self.module_dict(vars(v))
            return True
        if isinstance(v, torch.nn.Module) or not self.is_library(type(v)):
            self.attrs(v)
            return True
        if made_before:
            if not self._numpy_stream(v, source):
                self._library_object(v)
        return False

    def _numpy_stream(self, v, source) -> bool:
        """A NumPy ``Generator``, ``RandomState`` or bit generator the code reaches: its draws run in Cython,
        where no profile event shows them, so its state is taken now and, changed after the trace, put
        back and the draw refused, as a global stream's is (``_undo_generators``)."""
        get_put = _numpy_state(v)
        if get_put is None:
            return False
        stream = id(getattr(v, "bit_generator", v))     # (one stream, however many chains reach it: named by the first)
        if stream not in self.numpy_streams:
            self.numpy_streams.add(stream)
            self.generators[f"{_UNSEEN}{type(v).__name__} {source}>"] = (get_put[0](), *get_put)
        return True

    def _library_object(self, v):
        """A library object's own entries and the dicts it holds (GradScaler's lazily made ``_scale``, its
        per-optimizer ``found_inf``): not followed further, and only a tensor the trace left there is
        taken out (its other state is its own: an Event another thread waits on, a logger's counters)."""
        d = _own_dict(v)
        if d is None or id(d) in self.snaps or v in self.built:
            return
        self.snaps[id(d)] = Snap(d, dict(d), v, "leaks")
        for x in list(d.values()):
            if type(x) in (dict, collections.defaultdict) and id(x) not in self.snaps and len(x) <= 4096:
                self.snaps[id(x)] = Snap(x, _entries(x), v, "leaks")

    def _held(self, container, source, depth):
        """Copy what a container a chain reached holds: a loop over it (``for k, v in d.items()``, a
        comprehension) writes its items through a variable no chain names. User objects' attributes
        and nested containers, two levels down."""
        for x in list(container.values() if isinstance(container, dict) else container):
            if isinstance(x, _CONTAINERS) and not isinstance(x, bytearray):
                if depth < 2 and id(x) not in self.snaps and len(x) <= 4096:
                    self.snaps[id(x)] = Snap(x, _entries(x) if isinstance(x, dict) else x.copy(), f"{source}[...]",
                                             "items")
                    self._held(x, source, depth + 1)
            elif not isinstance(x, (torch.Tensor, torch.nn.Module, type, types.ModuleType)) \
                    and type(x) not in VALUE_TYPES and not self.is_library(type(x)):
                self.attrs(x)

    def argument(self, v, name):
        """A container the traced function was called with: pytree rebuilt it for the trace, so a
        change to it is a change to the caller's container, whoever holds the rebuilt one."""
        if isinstance(v, _CONTAINERS) and id(v) not in self.snaps:
            self.snaps[id(v)] = Snap(v, v.copy(), name, "argument")

    def given(self, v, source, depth: int = 0) -> None:
        """Copy an object the traced function was given (a non-tensor argument leaf: HF's
        ``DynamicCache``) and what it holds, library objects included: their code is not
        watched (``value`` stops at them), but a write to them is a write to the caller's."""
        if depth > 3 or len(self.snaps) > 4096 or not _may_hold_state(v) or self._numpy_stream(v, source):
            return
        if isinstance(v, (list, dict)):
            if id(v) in self.snaps:
                return
            self.argument(v, source)
            held, attr = (v.items() if isinstance(v, dict) else enumerate(v)), False
        else:
            d = _own_dict(v)
            if d is None or id(d) in self.snaps or v in self.built:
                return
            self.attrs(v)
            held, attr = d.items(), True
        for k, x in list(held):
            if _may_hold_state(x):      # named only where followed (a key's repr is run only if plain)
                name = f"{source}.{k}" if attr else f"{source}[{k!r}]" if type(k) in (str, int) else f"{source}[...]"
                self.given(x, name, depth + 1)

    def known(self, obj) -> bool:
        return id(obj) in self.snaps or id(_own_dict(obj)) in self.snaps

    def chain(self, root, steps, source, argument: bool = False):
        """Copy every object a load chain reaches from ``root`` (a global, a free variable or, with
        ``argument``, an argument of the running frame)."""
        obj = root
        if steps and steps[-1][0] in ("next", "iter"):      # consumed: where an iterator is, its position
            steps, consumed = steps[:-1], True
        else:
            consumed = False
        if not self.value(obj, source, made_before=not argument) and not (consumed and not steps):
            self._streams_beyond(obj, steps, source)
            return
        for i, (kind, key) in enumerate(steps):
            obj = peek(obj, kind, key, self.is_library)
            if obj is _GONE:
                return
            source = f"{source}.{key}" if kind == "attr" else f"{source}[{key!r}]"
            if not self.value(obj, source) and not (consumed and (kind, key) == steps[-1]):
                self._streams_beyond(obj, steps[i + 1:], source)
                return
        if consumed:
            self.iterator(obj, source)

    def _streams_beyond(self, obj, steps, source):
        """A NumPy stream the rest of a chain reaches through objects whose state is not copied (a library's
        ``SimpleNamespace`` holding the program's generator)."""
        for kind, key in steps:
            obj = peek(obj, kind, key, self.is_library)
            if obj is _GONE:
                return
            source = f"{source}.{key}" if kind == "attr" else f"{source}[{key!r}]"
            if self._numpy_stream(obj, source):
                return

    def iterator(self, it, source):
        """The position of an iterator that outlives the call (a library's: a list iterator,
        ``itertools.count``; or a generator), which the code advances."""
        if id(it) not in self.snaps and isinstance(it, collections.abc.Iterator) and (
                isinstance(it, types.GeneratorType) or self.is_library(type(it))):
            self.snaps[id(it)] = Snap(it, _position(it), source, "iterator")

    def cells(self, code, names):
        """The cells ``names`` of the functions running ``code`` (assigned by ``nonlocal``)."""
        for fn in gc.get_referrers(code):
            if isinstance(fn, types.FunctionType) and fn.__code__ is code and fn.__closure__:
                for name in names:
                    cell = fn.__closure__[code.co_freevars.index(name)]
                    if id(cell) not in self.snaps:
                        self.snaps[id(cell)] = Snap(cell, _cell(cell), name, "cell")

    # ------------------------------------------------------------ after

    def memoizes(self, code, value):
        """A function an lru_cache wraps returned ``value`` inside the trace (a miss: the cache keeps
        it): a traced tensor in it would stay in the user's cache, for every later eager call."""
        if _holds_traced(value):
            wrapper, source = self.memoized[code]
            self.poisoned[id(wrapper)] = (wrapper, source)

    def undo(self, watch=None) -> list:
        """Put back everything the traced code changed; ``(text, key)`` for each change it made. With
        ``watch`` (other threads ran meanwhile: :mod:`.attribution`), changes the capturing thread did
        not make are left, and listed in ``self.foreign``."""
        if watch is not None:
            self.foreign = watch.adopt(self.snaps.values())
        done = []
        for wrapper, source in self.poisoned.values():
            wrapper.cache_clear()       # no single entry can be taken out; the others are computed again
            done.append((f"calls `{source}`, an lru_cache'd function, which cached a tensor computed while "
                         "tracing (eager's first call caches a real one); call it once eagerly with these "
                         "arguments before compiling, so the trace reads the cached tensor", source))
        for s in self.snaps.values():
            done += _UNDO[s.kind](s, (self.snaps, self.built) if s.kind in ("items", "argument") else self.is_library)
        for gen, state in self.torch_streams.values() if watch is None else ():     # (else: as the threads left it)
            gen.set_state(state)
        return done + _undo_generators(self.generators, watch)


def _generator_states() -> dict:
    """The global random streams Python code draws from besides torch's: ``random``'s, and numpy's
    (where numpy is imported)."""
    states = {"random": (random.getstate, random.setstate)}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy.random"] = (np.random.get_state, np.random.set_state)
    return {name: (get(), get, put) for name, (get, put) in states.items()}


_UNSEEN = "<NumPy "     # the name of a stream whose draws no event shows


def _numpy_state(v):
    """``(get, put)`` of a NumPy random stream's state, or None for anything else."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(v, np.random.RandomState):
        return v.get_state, v.set_state
    if isinstance(v, np.random.Generator):
        v = v.bit_generator
    if isinstance(v, np.random.BitGenerator):
        return (lambda: v.state), (lambda state: setattr(v, "state", state))
    return None


def _same_state(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):     # a bit generator's state
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    eq = a == b
    return bool(eq.all()) if hasattr(eq, "all") else bool(eq)      # numpy's key is an array


def _undo_generators(states: dict, watch) -> list:
    """A trace that drew from such a stream: the graph holds the numbers it drew, the same on every
    call, where eager draws new ones; the stream is put back where it was. (Where other threads ran
    meanwhile, only if the capturing thread drew: :mod:`.attribution`. A NumPy stream of the program's
    own, whose draws no watch sees, is refused either way, and put back only where no thread ran.)"""
    done = []
    for name, (before, get, put) in states.items():
        if not _same_state(get(), before):
            if watch is not None and not watch.drew_from(name):
                if not name.startswith(_UNSEEN):
                    continue
                # (a NumPy stream's draws no watch sees: refused, and left as the threads left it)
            else:
                put(before)
            done.append((f"draws from `{name}` (Python's or numpy's random stream, not torch's): the compiled "
                         "graph would hold the numbers this trace drew and use them on every call, where eager "
                         "draws new ones; draw with torch (torch.rand, torch.randperm: traced on eager's stream)",
                         name if name.startswith("<") else name.split(".")[0]))     # (an own stream: its repr)
    return done


def traced(v) -> bool:
    """Whether ``v`` is a tensor of the trace (fake, functional), not a real one."""
    return isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, torch.nn.Parameter)


def held_dict(where):
    """The dict a class's ``vars()`` shows (a new mappingproxy each time); anything else as it is."""
    return gc.get_referents(where)[0] if type(where) is types.MappingProxyType else where


def _entries(d: dict) -> dict:
    """A dict's own entries, copied: a module's parameter or buffer dict read by a capturing thread
    answers with that thread's layer of traced values (``tracing.views.View``), which is not
    the user's state."""
    return dict(dict.items(d))


def _may_hold_state(v) -> bool:
    """Whether a given object can hold state a write changes (not a plain value, tensor, module,
    class, module object, function or code: those are watched otherwise or not at all)."""
    return v is not None and type(v) not in VALUE_TYPES and not isinstance(
        v, (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.MethodType, types.CodeType))


def _own_dict(obj):
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if isinstance(d, dict) else None


def peek(obj, kind, key, is_library):
    """``obj.key`` or ``obj[key]`` read through dicts only (no property, ``__getattr__`` or other user
    code runs), or ``_GONE``."""
    if kind == "item":
        if isinstance(obj, dict):
            return dict.get(obj, key, _GONE)
        if isinstance(obj, (list, tuple)) and type(key) is int and -len(obj) <= key < len(obj):
            return obj[key]
        return _GONE
    d = vars(obj) if isinstance(obj, (types.ModuleType, type)) else _own_dict(obj)
    if d is not None and key in d:
        return d[key]
    if isinstance(obj, torch.nn.Module) and d is not None:
        for store in ("_parameters", "_buffers", "_modules"):
            if key in d.get(store, ()):
                return d[store][key]
    for cls in (obj if isinstance(obj, type) else type(obj)).__mro__:
        if key in vars(cls):
            v = vars(cls)[key]
            return _GONE if is_library(cls) or hasattr(type(v), "__get__") and not isinstance(obj, type) else v
    return _GONE


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _GONE


def _same(a, b) -> bool:
    """Unchanged: the same object (a module's parameter dict and the per-thread view a capture
    stands in for it count as one), or an equal plain value."""
    return a is b or type(a) is type(b) and type(a) in VALUE_TYPES and same_value(a, b) \
        or real(a) is real(b)


def changed_keys(now: dict, before: dict) -> list:
    """The keys of an object's or a class's dict whose values differ between ``before`` and ``now``;
    not Python's own bookkeeping, nor the ``__getattribute__`` a class reads its instances' attributes
    through while some thread watches them (``reads.attribute_reads``: put back when the watch ends)."""
    return [k for k in now.keys() | before.keys() if k not in _BOOKKEEPING
            and not _same(now.get(k, _GONE), before.get(k, _GONE))
            and not (k == "__getattribute__" and (_watcher(now.get(k)) or _watcher(before.get(k))))]


def _watcher(v) -> bool:
    return type(v) is types.FunctionType and v.__dict__.get("aotgrad_watch") is True


def _owner_text(owner) -> str:
    if isinstance(owner, str):
        return owner
    if isinstance(owner, type):
        return f"class {owner.__qualname__}"
    return type(owner).__name__


def _undo_attrs(s, is_library):
    d, before = s.obj, s.before
    # A library object's private attributes are its caches (nn.LSTM's _flat_weights): put back, not refused,
    # unless the trace made one that held no tensor (GradScaler's lazily made _scale), which eager makes real.
    caches = not isinstance(s.owner, str) and is_library(type(s.owner))
    done = []
    for key in changed_keys(d, before):
        if key not in before and _cached_once(s.owner, key, d[key]):
            continue        # eager's first call caches it too, and no later call writes it again
        made = key in d and _made_in_trace(d[key], before.get(key))
        _put_back(d, before, key)
        if not (caches and str(key).startswith("_")) or made:
            done.append((f"assigns `{key}` of {_owner_text(s.owner)}", key))
    return done


def _cached_once(owner, key, value) -> bool:
    """Whether ``owner.key = value`` is a ``functools.cached_property`` caching a plain value (no
    traced tensor can hide in it): a write eager makes once, which the read guards then check."""
    if isinstance(owner, str) or type(value) not in VALUE_TYPES:
        return False
    for cls in type(owner).__mro__:
        attr = vars(cls).get(key)
        if attr is not None:
            return isinstance(attr, functools.cached_property) and attr.attrname == key
    return False


def _position(it):
    """Where an iterator is: a generator's frame position, a library iterator's own account of its state (`__reduce__`)."""
    if isinstance(it, types.GeneratorType):
        return it.gi_frame.f_lasti if it.gi_frame is not None else None
    try:
        with warnings.catch_warnings():     # itertools: deprecated (3.12+)
            warnings.simplefilter("ignore")
            return it.__reduce__()
    except Exception:       # not picklable: its position cannot be told
        return None


def _undo_iterator(s, _):
    if _position(s.obj) == s.before:
        return []
    before, lost = s.before, ""
    if isinstance(before, tuple) and len(before) > 2 and before[2] is not None and hasattr(s.obj, "__setstate__"):
        s.obj.__setstate__(before[2])       # a list or range iterator goes back where it was
    else:       # Python 3.12's range iterator keeps its position in its range: it only moves forward
        lost = " (its position cannot be put back: the items the trace took are gone, as in an eager call)"
    return [(f"advances the iterator `{s.owner}` (a {type(s.obj).__name__}), which outlives the call: the "
             f"compiled graph would use the items this trace took on every call{lost}", s.owner)]


_STATE = {"_parameters": "parameter", "_buffers": "buffer", "_modules": "submodule"}


def _undo_state(s, _):
    """A module's parameters, buffers or children registered (or dropped) by the trace: what it
    registered holds traced values (or was built while tracing), and no graph would register it
    again. Only entries added, removed, or set where there was None (``bias``) count, and only they
    are put back: another thread's eager call rebinding a buffer meanwhile replaces a value (the
    trace's own rebinds go to its per-thread layer and are replayed)."""
    changed = state_changes(s)
    if not changed:
        return []
    module, key = s.owner
    d = vars(module)[key]       # the module's dict now (the one copied may have been a view since put back)
    for k in changed:
        _put_back(d, s.before, k)
    return [(f"registers or replaces the {_STATE[key]} `{changed[0]}` of {type(module).__name__} (lazy "
             "initialisation in forward); run the module once eagerly before compiling it", changed[0])]


def state_changes(s) -> list:
    """The entries of a module's parameter, buffer or child dict (snapshot ``s``) added, removed, or
    set where there was None or a child was."""
    module, key = s.owner
    now, before = _entries(vars(module)[key]), s.before
    return [k for k in now.keys() | before.keys() if k not in now or k not in before
            or (before[k] is None or key == "_modules") and now[k] is not before[k]]


def _undo_hooks(s, is_library):
    """Hooks the traced code registered on a module are removed; a library module's forward installing
    its own (its hooks are the library's functions; a flag among its private attributes is put back too)
    is not refused. A user's hook registered on a library module (``self.fc.register_forward_hook(...)``
    in ``forward``) is: eager adds one per call, the graph would hold the trace's."""
    if s.obj.keys() == s.before.keys() and all(s.obj[k] is s.before[k] for k in s.before):
        return []
    added = [h for k, h in s.obj.items() if s.before.get(k) is not h]
    s.obj.clear()
    s.obj.update(s.before)
    if is_library(type(s.owner)) and all(is_library(_code_owner(h)) for h in added):
        return []
    return [(f"registers a hook on {_owner_text(s.owner)}", "register")]


def _code_owner(fn):
    """What defines a hook: its function (a bound method's, a partial's), or the callable's class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return fn if isinstance(fn, types.FunctionType) else type(fn)


# Class attributes Python's own machinery caches, a function of the class alone (``copy.copy`` of an
# instance sets ``__slotnames__`` through ``copyreg._slotnames``): eager's first call sets the same.
_PYTHON_CACHES = frozenset(("__slotnames__",))


def _undo_class(s, is_library):
    cls, before, now = s.obj, s.before, dict(vars(s.obj))
    done = []
    for key in changed_keys(now, before):
        if key in _PYTHON_CACHES and key not in before:
            continue
        if key in before:
            setattr(cls, key, before[key])
        else:
            delattr(cls, key)
        done.append((f"assigns the class attribute `{key}` of {cls.__qualname__}", key))
    return done


def _undo_items(s, held):
    snaps, built = held
    if not _changed(s) or s.kind == "items" and not _outlives(s, snaps, built):
        return []
    obj, before = s.obj, s.before
    if isinstance(obj, (dict, set)):
        obj.clear()
        obj.update(before)
    else:
        obj[:] = before
    return [(f"changes the contents of `{s.owner}` (a {type(obj).__name__})", s.owner)]


def _changed(s) -> bool:
    obj, before = s.obj, s.before
    if isinstance(obj, dict):
        now = _entries(obj)
        return now.keys() != before.keys() or any(not _same(now[k], before[k]) for k in before)
    if isinstance(obj, set):
        return obj != before
    return len(obj) != len(before) or any(not _same(a, b) for a, b in zip(obj, before))


def _undo_cell(s, _):
    if _same(_cell(s.obj), s.before):
        return []
    if s.before is _GONE:
        del s.obj.cell_contents
    else:
        s.obj.cell_contents = s.before
    return [(f"assigns the closure variable `{s.owner}` (nonlocal, defined outside the call)", s.owner)]


def _refs(snap) -> int:
    return sys.getrefcount(snap.obj)


_BASE = _refs(Snap([], None, None, "items"))       # what the recording's own Snap and this call hold


def _outlives(snap, snaps, built=()) -> bool:
    """Whether something besides the recording holds a changed container: one only the call's own
    frames held (a local list given to a helper) went with them, and so did one only objects the
    call built hold (a cache made in the forward: its ``is_updated`` dict). Copies of other
    containers hold it too; those references are not the user's."""
    ours = sum(_count(o.before, snap.obj) for o in snaps.values() if o.kind in ("items", "attrs", "class"))
    extra = _refs(snap) - ours - _BASE
    if extra <= 0:
        return False
    built_held = 0      # references from the attributes of an object the call built
    for d in gc.get_referrers(snap.obj):
        own = _own_dict(d) if d in built else None
        if type(own) is dict:       # (3.13: the object refers to it from its inline values)
            built_held += sum(1 for v in own.values() if v is snap.obj)
        elif type(d) is dict and any(o in built and _own_dict(o) is d for o in gc.get_referrers(d)):
            built_held += sum(1 for v in d.values() if v is snap.obj)
    return extra > built_held


def _count(before, obj) -> int:
    values = before.values() if isinstance(before, dict) else before if isinstance(before, (list, set)) else ()
    return sum(1 for v in values if v is obj)


def _undo_leaks(s, _):
    """Entries of a dict a library object holds that now hold a tensor of the trace (a dict the library's
    code fills on its first call, with its own values below it): taken out, and named."""
    done = []
    for key in changed_keys(s.obj, s.before):
        if key in s.obj and _made_in_trace(s.obj[key], s.before.get(key)):
            _put_back(s.obj, s.before, key)
            done.append((f"assigns `{key}` of {_owner_text(s.owner)}" if s.obj is _own_dict(s.owner) else
                         f"stores a tensor computed while tracing in a dict {_owner_text(s.owner)} holds", key))
    return done


def _put_back(d: dict, before: dict, key) -> None:
    if key in before:
        d[key] = before[key]
    else:
        del d[key]


def _made_in_trace(now, before) -> bool:
    """State the trace made: a tensor of the trace where no tensor was (a lazily made tensor, which
    eager's first call makes real and every later call updates), not a cache the library refreshes from
    its parameters on every call (nn.LSTM's ``_flat_weights``: the trace's stand-ins, put back)."""
    return _holds_traced(now) and not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(before))


def _holds_traced(v) -> bool:
    """A tensor of the trace in ``v`` or in the containers below it."""
    return any(traced(t) for t in pytree.tree_leaves(v))


_UNDO = {"attrs": _undo_attrs, "class": _undo_class, "items": _undo_items, "argument": _undo_items,
         "leaks": _undo_leaks, "cell": _undo_cell, "hooks": _undo_hooks, "iterator": _undo_iterator, "state": _undo_state}

