"""From a recording of a trace (:mod:`aotgrad.guards.reads`) to the list of
:class:`~aotgrad.guards.state.Read` s a compiled entry assumed.

Roots: the jitted function or module (``fn``), the module's whole tree (its
structure decides which parameters are lifted), the globals of every user code
object that ran, its ``self`` and object arguments, the non-tensor arguments of
the call. From each root the code's load chains are followed one step at a
time; every step is a read. Functions reached whose code ran add their closure
cells and defaults; objects reached by value add the attributes that the traced
code loads by name.
"""
from __future__ import annotations

import builtins
import collections
import contextvars
import dataclasses
import functools
import operator
import os
import sys
import threading
import types
import weakref

import torch

from .. import errors
from .._torch import CUSTOM_OPS, SWITCH_GETTERS, TensorBase
from ..tracing.views import real
from . import c_calls
from .bytecode import attr_names, chains, operator_names, probed_names
from .places import (MODULE_CALLER, _CALLABLES, _UNSET, _Called, _ContextValue, _Fixed, _Names, _class_item, _class_path,
                     _global_path, _module_state, _mro_item, _own_item, _state_of_library, _stops, custom_op, locate,
                     read_at)
from .reads import HELD, LIBRARY, MODULE_CALL, NN_METHOD, USER, Frame, holds_state, imported_name, is_library, kind_of
from .state import _EQ_TYPES, _FROZEN_LIMIT, _GLOBAL_HOOKS, Read, checkable, current, freeze, guard_kind, holds
from .writes import HOOK_EXTRAS, HOOKS, held_dict


_SWITCH_NAMES = frozenset(SWITCH_GETTERS.values())     # (a getter of process state is named by its call)
_FIXED = frozenset(("torch", "numpy", "aotgrad", *sys.stdlib_module_names))    # modules whose state is constant
_KEYED = (dict, types.MappingProxyType, tuple)       # whose items are followed though they are library objects
_LRU = type(functools.lru_cache(lambda: None))
TWIN = "<block>"    # the root a twin block's proof is resolved from (``_twin`` puts the block's own in its place)
_TENSOR_CLASSES = (torch.Tensor, TensorBase)
_TENSOR_NAMES = frozenset(name for c in _TENSOR_CLASSES for name in vars(c))


class Resolver:
    def __init__(self, fn, leaves, root_name, rec, structure=True):
        self.structure = structure      # False: the module tree's own structure is not read (block twins')
        self.reads: dict = {}
        self.paths: dict = {}          # id(obj) -> (path, source) of objects reached from a root
        self.skip: set = set()         # ids of dicts whose entries are guarded elsewhere
        self.holders: dict = {}        # id(dict) -> its _Names, for dicts read whole
        self.done: set = set()
        self.rec = rec
        self.executed = {f.code for f in rec.frames.values() if f.kind == USER}
        self.names = attr_names(self.executed)
        self.probed = probed_names(self.executed)
        self.fn, self.root_name = fn, root_name
        self.line = None        # the user line of the chain being followed, for refusals
        self.called: set = set()   # (id, path) of each module whose call's reads were made (``_called``)
        self.cached: list = []  # frames standing for a cached function's body (an ``lru_cache`` hit runs none)
        self.switched: set = set()  # the switches and getters read
        self._roots(fn, leaves)

    def resolve(self) -> list:
        self._unfollowed()
        self._switches()
        self._custom_ops()
        frames, twins = list(self.rec.frames.values()), []
        # A twin block's reads found when it was called (its proof) are the reads now where each holds
        # now; else (a scope its parent set around the call: a ContextVar) its frames are resolved here.
        for block, found, rest in getattr(self.rec, "twins", ()):
            if all(holds(r, current(r)) for r in found):
                twins.append((block, found))
            else:
                frames += rest
        looked: dict = {}       # id(frame) -> the paths its self and arguments had when it was resolved
        for _ in range(3):      # a self or argument reached later gets its path on the next round
            known = len(self.paths)
            for f in frames + self.cached:
                now = self._looked(f)
                if now is not None and looked.get(id(f)) == now:
                    continue    # the same calls as its last round made: all no-ops
                looked[id(f)] = now
                self._frame(f)
            for v in getattr(self.rec, "returned", ()):
                self._returned(v)
            if len(self.paths) == known:
                break           # no path was added: another round would make the same calls, all no-ops
        for block, found in twins:
            self._twin(block, found)
        if self.structure:
            self._tensor_attributes()
        return list(self.reads.values())

    def _twin(self, block, found):
        """The reads a repeated block's proof found (``capture.blocks.Reuse._proven``: what the frames of its
        template's trace read when the block is this one, rooted at the block) at the block's place here."""
        path, source = self.paths.get(id(block), (None, _anon(block)))
        for r in found:
            at = r.path
            if at is not None and at[:2] == ("fn", None):
                at = path + at[2:] if path is not None else None
            self._add(Read(r.source.replace(TWIN, source, 1), at, r.where, r.key, r.value, r.kind))

    def _tensor_attributes(self):
        """A tensor's attribute the code loads (``h.relu()``, ``x.view``, ``x.shape``) or operator it uses
        (``x * 2``: ``__mul__``, ``__rmul__``; ``x[i]``), where torch's classes
        answer it: its entry in ``torch.Tensor``'s dict or ``TensorBase``'s, by identity, and its absence
        from ``torch.Tensor``'s where ``TensorBase`` answers. A traced tensor is no root any chain starts
        from, so a method patched onto ``torch.Tensor`` after the capture would go unseen."""
        for name in sorted((self.names | operator_names(self.executed)) & _TENSOR_NAMES):
            for cls in _TENSOR_CLASSES:
                d, source = vars(cls), f"{cls.__module__}.{cls.__name__}.{name}"
                path = ("G", cls.__module__, ("attr", cls.__name__), ("own", name))
                if name in d:
                    kind = "eq" if guard_kind(d[name]) == "eq" else "id"
                    self._add(Read(source, path, d, name, d[name], kind))
                    break
                self._add(Read(source, path, d, name, None, "absent"))

    def _returned(self, v):
        """A module or a stateful object a library call handed user code (``importlib.import_module(name)``,
        ``logging.getLogger(name)``): what the code loads from it is read, as from one it named. (The call's
        answer itself is trusted: the same object on every call.)"""
        if isinstance(v, types.ModuleType):
            self._value(v, None, v.__name__)
        elif id(v) not in self.done:
            self.done.add(id(v))
            self._loaded_from(v, *self.paths.get(id(v), (None, _anon(v))))

    def _looked(self, f):
        """What ``_frame`` looks up in ``paths`` for ``f``: the paths of its ``self`` and of its arguments
        (every other lookup it makes is of state only a first call changes); None for code that reads
        reflectively, whose objects' paths are looked up wherever it reaches."""
        if f.kind == USER and _reflects(f, chains(f.code)[0]):
            return None
        get = self.paths.get
        return get(id(f.self_obj)) if f.self_obj is not None else None, tuple(get(id(v)) for v in f.args.values())

    def _unfollowed(self):
        """Reads no guard can follow are refused (:mod:`.reads` observes them as the trace runs)."""
        for seen in self.rec.reflected:
            raise reflected_call(*seen)

    def _switches(self):
        """torch's switches the trace read (``_torch.SWITCH_GETTERS``), and the getters of process state
        user code called (``c_calls.GETTERS``): each guarded on the value seen."""
        for name, (getter, seen) in self.rec.switches.items():
            now = getter()
            if type(now) is not type(seen) or now != seen:
                raise errors.UnsupportedError(
                    f"the traced code read `{name}` as {seen!r}, and it is {now!r} now: it changed "
                    "while the function was captured (another thread, or the function itself); set it before "
                    "the first call")
            self._switch(name, getter, seen)

    def _custom_ops(self):
        """The autograd formula of a custom op the trace ran is in the joint graph: read where a
        ``torch.library.custom_op`` holds it, by identity (``register_autograd`` again after the capture:
        the backward would be stale). ``torch.library.register_autograd`` of the user's formula on a
        ``Library`` op leaves it with the dispatcher alone, where no guard can look: refused."""
        for op, info, line in getattr(self.rec, "custom_ops", ()):
            name = op._schema.name
            if CUSTOM_OPS.get(name) is info:
                path = ("custom op", name)
                self._add(Read(f"the custom op {name}", path, custom_op(name), "value", info, "id"))
                for key in ("_backward_fn", "_setup_context_fn"):
                    self._add_value(vars(info), key, f"{name}'s {key[1:-3]}", _own_item(path, key))
                continue
            users = [f for f in (info._backward_fn, info._setup_context_fn) if isinstance(f, types.FunctionType)
                     and kind_of(f.__code__, f.__module__) == USER]
            if users:
                raise errors.UnsupportedError(
                    f"the traced code calls the custom op `{name}`, whose autograd formula "
                    f"`{users[0].__qualname__}` was registered with torch.library.register_autograd on a "
                    "torch.library.Library op: only PyTorch's dispatcher holds it, so a formula registered "
                    "again after the capture could not be seen and the compiled backward would be stale. "
                    "Define the op with torch.library.custom_op, whose register_autograd aotgrad reads",
                    user_line=line)

    def _switch(self, name, getter, seen):
        if name in self.switched:
            return
        self.switched.add(name)
        kind = guard_kind(seen)
        self._add(Read(f"torch switch {switch_name(name)}" if name in _SWITCH_NAMES else f"{name}()",
                       ("switch", name), _Called(getter), "value", freeze(seen) if kind == "frozen" else seen, kind))

    def _c_function(self, fn):
        """A C function or C type the code loads: called where the recording cannot see the call (handed to
        ``functools.partial``, ``map``, a ``key=``; a type's call, its objects' operators), it answers as a
        direct call does (:mod:`.c_calls`)."""
        why = c_calls.verdict(fn)
        if why == c_calls.GETTER:
            self._switch(c_calls.getter_name(fn), fn, fn())
        elif why is not None:
            raise _unchecked_call(fn, why, self.line)

    def _roots(self, fn, leaves):
        if isinstance(fn, torch.nn.Module):
            self._tree(fn)
            step_fn = vars(fn).get("step_fn")       # a whole training step's function (inputs.step.Root)
            if step_fn is not None:
                self._value(step_fn, ("fn", None, ("own", "step_fn")), self.root_name)
        else:
            self._value(fn, ("fn", None), self.root_name)
        for i, v in enumerate(leaves):
            if v is not None and guard_kind(v) == "frozen":
                # a container or buffer argument is the same object (the argument match): and holds the same
                self._add_value(_Fixed(v), "value", f"input {i}", None)
            elif v is not None and not _stops(v):
                self._value(v, ("arg", i), f"input {i}")
        mod = torch.nn.modules.module
        for name in _GLOBAL_HOOKS:
            if hasattr(mod, name):
                self._hook(vars(mod), name, ("G", mod.__name__, ("attr", name)), f"torch.nn.modules.module.{name}")

    def _tree(self, root):
        for name, m in root.named_modules(remove_duplicate=False):
            path = ("fn", None, *(("attr", p) for p in name.split("."))) if name else ("fn", None)
            source = f"{self.root_name}.{name}" if name else self.root_name
            self.paths.setdefault(id(m), (path, source))
            d = vars(m)
            self.skip.update(id(x) for s in ("_parameters", "_buffers", "_modules") for x in (d[s], real(d[s])))
            if not self.structure:
                continue
            self._hook(d, "_modules", path + (("attr", "_modules"),), source)
            for store in ("_parameters", "_buffers"):
                n = len(d[store])
                self._add(Read(f"{source}.{store}", path + (("attr", store),), d, store, n or None,
                               "len" if n else "empty"))
                # An empty slot (``bias=False``, ``register_buffer(name, None)``) filled later keeps the
                # length, and is no input: that it is still empty is read (``state._is_slot``).
                for k in [k for k, v in d[store].items() if v is None]:
                    self._add(Read(f"{source}.{store}[{k!r}]", path + (("attr", store), ("item", k)),
                                   real(d[store]), k, None, "id"))

    def _hook(self, d, key, path, source):
        hooks = d.get(key)
        if isinstance(hooks, dict):
            self._add(Read(source, path, d, key, dict(hooks), "dict") if hooks
                      else Read(source, path, d, key, None, "empty"))

    def _add(self, read):
        where = read.where      # a class's ``vars`` is a new proxy each time: the dict it shows is the place
        self.reads.setdefault((id(held_dict(where)), read.key), read)

    def _frame(self, f):
        path, source = self.paths.get(id(f.self_obj), (None, None)) if f.self_obj is not None else (None, None)
        if f.kind == MODULE_CALL:
            # (one call records two frames, ``_wrapped_call_impl``'s and ``_call_impl``'s: the same reads)
            if self.structure and (id(f.self_obj), path) not in self.called:
                self.called.add((id(f.self_obj), path))
                self._called(f.self_obj, path, source or _anon(f.self_obj))
            return
        found, _ = chains(f.code)
        if f.kind == USER and _reflects(f, found):
            self._reflective(f, found)
        if f.kind == USER and f.self_obj is not None and _is_special(f.code.co_name):
            self._special(f, path)
        for c in found:
            self.line = f"{f.code.co_filename}:{c.line} in {f.code.co_name}"
            if c.root == "fast" and c.name == "self" and f.self_obj is not None:
                self._follow(f.self_obj, path, source or _anon(f.self_obj), c.steps)
            elif c.root in ("fast", "deref") and c.name in f.args:     # an argument, or a free variable
                # of nested code (a comprehension, a lambda, an inner function): followed from its value
                obj = f.args[c.name]
                p, s = self.paths.get(id(obj), (None, _anon(obj)))
                if type(obj) is list and p is None:     # a closed-over list no path reaches: held whole, once
                    if id(obj) not in self.done:
                        self.done.add(id(obj))
                        self._add_value(_Fixed(obj), "value", c.name, None)
                else:
                    self._follow(obj, p, s, c.steps)
            elif c.root == "global" and f.kind == USER:
                self._global(f.globals, c)
            elif c.root == "import" and f.kind == USER:
                self._imported(f.globals, c)
            elif c.root == "globals" and f.kind == USER and f.globals is not None:
                self._globals(f.globals)
            elif c.root == "global" and f.kind in (LIBRARY, NN_METHOD):
                self._setting(f.globals, c)     # (``F.linear`` in ``nn.Linear.forward``: by identity)
        if f.kind == HELD:
            self._held_reach(f.self_obj, path, source or _anon(f.self_obj), f.code)

    def _held_reach(self, obj, path, source, code):
        """What a library method reads of its ``self`` through a local alias, and of the objects it reaches
        from it (``logger = self; while logger: logger.level ...; logger = logger.parent``): the attributes
        its code loads, of ``self`` and of each stateful object those hold, a few levels down."""
        names = attr_names((code,))
        todo, seen = [(obj, path, source, 0)], set()
        while todo:
            o, p, s, depth = todo.pop()
            if id(o) in seen or depth > 4:
                continue
            seen.add(id(o))
            d = vars(o)
            for name in sorted(names & set(d)):
                self._follow(o, p, s, (("attr", name),))
                if holds_state(d.get(name)):
                    todo.append((d[name], p + (("attr", name),) if p else None, f"{s}.{name}", depth + 1))

    def _reflective(self, f, found):
        """Code that reads attributes in a way the bytecode does not name (``operator.attrgetter(n)(x)``,
        ``object.__getattribute__(rows[0], n)``, ``vars(vars(x)["o"])``, a getter held in a variable):
        every plain value of every object it was handed, or reached by a load it makes (each object
        on the way, and the items of a container it ends at), is read."""
        objs = [(f.self_obj, self.paths.get(id(f.self_obj), (None, _anon(f.self_obj))))] if f.self_obj is not None \
            else []
        objs += [(v, self.paths.get(id(v), (None, _anon(v)))) for v in f.args.values()]
        for c in found:
            start = f.globals.get(c.name, _UNSET) if c.root == "global" and f.globals is not None else \
                f.self_obj if c.root == "fast" and c.name == "self" else f.args.get(c.name, _UNSET)
            if start is _UNSET or _stops(start) and not isinstance(start, _KEYED + (list,)):
                continue
            base = (_global_path(f.globals, c.name), c.name) if c.root == "global" else (None, c.name)
            objs += [(v, self.paths.get(id(v), base if v is start else (None, _anon(v)))) for v in _reach(start, c.steps)]
        for obj, (path, source) in objs:
            self._any(obj, path, source)

    def _called(self, module, path, source):
        d = vars(module)
        for key in HOOKS + (HOOK_EXTRAS if d.get("_forward_hooks") or d.get("_forward_pre_hooks") else ()):
            self._hook(d, key, path + (("attr", key),) if path else None, f"{source}.{key}")
        if d.get("_forward_hooks") or d.get("_forward_pre_hooks"):
            # a library's hook (spectral norm's power iteration) reads the module's mode, unrecorded
            self._add_value(d, "training", f"{source}.training", _own_item(path, "training"))
        # Which ``forward`` the call ran, and which call machinery ran it (``Module.__call__`` or
        # ``_call_impl`` patched by a profiler): one set on the instance (``m.forward = ...``: patched,
        # wrapped by a library's hooks) or its absence, the module's class (``m.__class__ = ...``), and
        # the class's by identity, with its absence from every class before it in the MRO (a subclass
        # given a ``forward`` of its own after capture). ``__call__`` is looked up on the type alone.
        cls = type(module)
        self._add(Read(f"type({source})", path + (("attr", "__class__"),) if path else None, module, "__class__",
                       cls, "type"))
        for name in ("forward", "_call_impl"):
            if name in d:
                self._add_value(d, name, f"{source}.{name}", _own_item(path, name))
            else:
                self._add(Read(f"{source}.{name}", _own_item(path, name), d, name, None, "absent"))
            self._class_lookup(cls, name, path)
        self._class_lookup(cls, "__call__", path)

    def _special(self, f, path):
        """A special method of a user class that ran (``self.block(x)`` calls ``type(block).__call__``,
        ``Helper(x)`` its ``__init__``, ``a + b`` its ``__add__``): looked up on the type, where no
        load names it. Read where the type answers it, if that is the code that ran."""
        cls, name = type(f.self_obj), f.code.co_name
        for c in cls.__mro__:
            if name in vars(c):
                if getattr(vars(c)[name], "__code__", None) is f.code:     # (an object built in the trace:
                    if path is None:                                        # its class where its module has it)
                        self._class_lookup(cls, name, _class_path(cls), _mro_item)
                    else:
                        self._class_lookup(cls, name, path)
                return

    def _function_methods(self, cls, path):
        """What ``Function.apply`` looks up on a custom ``autograd.Function`` (its ``forward``, ``backward``,
        ...), where no load names it: each where the user's classes in its MRO answer it, by identity,
        absent from each class before that one (torch's own base is constant)."""
        for name in ("forward", "setup_context", "backward", "jvp", "vmap"):
            self._class_lookup(cls, name, path, _mro_item, users=True)

    def _class_lookup(self, cls, name, path, item=_class_item, users=False):
        """``name`` as ``cls`` answers it: absent from each class in its MRO before the one whose dict holds
        it, that one by identity, and the function's own state (its defaults, its code). ``path``: of an
        instance of ``cls`` (``item``: ``_class_item``), or of ``cls`` itself (``_mro_item``). ``users``:
        the user's classes of the MRO alone (a library's base is constant)."""
        for i, c in enumerate(cls.__mro__):
            if users and is_library(c):
                break
            if c is torch.nn.Module and name == "__call__":     # (read through what stands in for it a while)
                self._add(Read("torch.nn.Module.__call__", ("module call", None), MODULE_CALLER, "value",
                               MODULE_CALLER.value, "id"))
                self._value(MODULE_CALLER.value, ("module call", None), "torch.nn.Module.__call__")
                break
            found = name in vars(c)
            self._add(Read(f"{c.__qualname__}.{name}", item(path, i, name), vars(c), name,
                           vars(c)[name] if found else None, "id" if found else "absent"))
            if found:
                self._value(vars(c)[name], item(path, i, name), f"{c.__qualname__}.{name}")
                break

    def _global(self, g, c):
        modname = g.get("__name__")
        own = getattr(self.fn, "__globals__", None) is g
        source = c.name if own or modname in (None, "__main__") else f"{modname}.{c.name}"
        path = _global_path(g, c.name)
        if c.name not in g:
            self._add(Read(source, path, g, c.name, None, "absent"))
            # found among the builtins (``builtins.SCALE = 2.0``; ``len``): read there, where it may change
            b = g.get("__builtins__", builtins)
            b = vars(b) if isinstance(b, types.ModuleType) else b
            if isinstance(b, dict) and c.name in b:
                path = ("G", "builtins", ("attr", c.name)) if b is vars(builtins) else None
                self._add_value(b, c.name, f"builtins.{c.name}", path)
                self._follow(b[c.name], path, f"builtins.{c.name}", c.steps)
            return
        self._add_value(g, c.name, source, path)
        self._follow(g[c.name], path, source, c.steps)

    def _imported(self, g, c):
        """A module the code imports inside itself (``import helpers``, ``from .utils import act``): the
        module ``sys.modules`` holds under its name, by identity (what the import statement finds), and
        the chain from it, as from a global naming it."""
        name = imported_name(c.name, g)
        module = sys.modules.get(name) if name is not None else None
        if module is None:
            return
        self._add(Read(f"sys.modules[{name!r}]", ("G", "sys", ("attr", "modules"), ("item", name)), sys.modules,
                       name, module, "id"))
        self._follow(module, ("G", name), name, c.steps)

    def _globals(self, g):
        """``globals()`` read whole (a name computed at run time, iterated): every plain value among
        the module's globals, and its names (one defined later may be the one read)."""
        for key, value in list(g.items()):
            if isinstance(key, str) and not key.startswith("__") and guard_kind(value) == "eq":
                self._add(Read(key, _global_path(g, key), g, key, value, "eq"))
        self._names(g, f"the globals of {g.get('__name__') or 'a module'}", None)

    def _setting(self, g, c):
        """A plain value an installed library's code loads from its module (or a module it imports):
        a setting such as timm's ``_USE_FUSED_ATTN`` that its ``set_...`` function assigns (torch's,
        numpy's and the standard library's modules' are constant); and a function it loads from a
        module, by identity (``F.scaled_dot_product_attention`` rebound after the capture: the library
        calls the new one)."""
        where, key = g, c.name
        for kind, name in c.steps:
            value = where.get(key)
            if not isinstance(value, types.ModuleType) or kind != "attr" or name not in vars(value):
                break
            where, key = vars(value), name
        module = where.get("__name__")
        if not isinstance(module, str) or key not in where or key.startswith("__"):
            return
        value = where[key]
        if module.split(".")[0] not in _FIXED and type(value) in _EQ_TYPES:
            self._add(Read(f"{module}.{key}", _global_path(where, key), where, key, value, "eq"))
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
            self._add(Read(f"{module}.{key}", _global_path(where, key), where, key, value, "id"))

    def _follow(self, obj, path, source, steps):
        whole = None        # (object, its path, its source) whose ``__dict__`` (``vars(x)``) was just reached
        for at, (kind, key) in enumerate(steps):
            if whole is not None and kind not in ("item", "get"):
                self._whole(*whole)       # ``vars(x).items()``, iterated: all of it
                return
            whole = None
            if obj is os and key == "environ":
                obj = os.environ
                continue
            if obj is sys and key == "modules":     # ``sys.modules[name]``: a module, read by its name
                if steps[at + 1:at + 2] and steps[at + 1][0] in ("item", "get"):
                    obj, path = sys.modules, None
                    continue
                raise errors.UnsupportedError(
                    f"the traced code reads `{source}.modules` by a key computed at run time, or whole "
                    "(`sys.modules[__name__]`, `name in sys.modules`): which module it finds there, and what "
                    "it then reads of it, cannot be checked on later calls; import the module (`import m`, "
                    "`importlib.import_module(name)`), index `sys.modules` with a string constant, or pass "
                    "the value as an argument", user_line=self.line)
            if obj is os and key in ("getenv", "environb", "getenvb"):
                self._environment(None)     # ``os.getenv(k)``
                return
            if obj is os.environ:
                self._environment((kind, key))
                return
            if kind == "get":       # ``d.get("k")``: an entry of a dict, else the object's ``get``
                kind, key = ("item", key) if isinstance(obj, dict) else ("attr", "get")
            if isinstance(obj, contextvars.ContextVar) and (kind, key) == ("attr", "get"):
                # its value in the calling context (each thread, each asyncio task has its own)
                value = obj.get(_UNSET)
                kind = "id" if value is _UNSET else guard_kind(value)
                self._add(Read(f"{source}.get()", None, _ContextValue(obj), "value",
                               freeze(value) if kind == "frozen" else value, kind))
                return
            if kind in ("attr", "item"):
                self._in_c(obj, kind, key, source)
            library_module = isinstance(obj, types.ModuleType) and _stops(obj)
            if library_module:
                # a library's module: a plain value or module the code loads from it (``mylib.FLAG``,
                # ``torch.nn.functional``) is read like a user module's; its functions and classes by
                # identity (``F.gelu = mine`` rebinds it), not followed
                value = vars(obj).get(key, _UNSET)
                if kind != "attr" or not _module_state(value):
                    if (isinstance(value, types.BuiltinFunctionType) or c_calls.c_type(value)) and self.structure:
                        self._c_function(value)
                    if kind == "attr" and callable(value):
                        self._add(Read(f"{source}.{key}", path + ((kind, key),) if path is not None else None,
                                       vars(obj), key, value, "id"))
                    return
            elif _stops(obj) and not _state_of_library(obj) and not (kind == "item" and isinstance(obj, _KEYED)):
                self._past_items(obj, steps[at:], source)
                return
            if kind in ("next", "iter"):        # consumed, not read: the write undo tells whether it moved
                return
            if (kind, key) == ("attr", "apply") and isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
                self._function_methods(obj, path)
            if kind == "any":
                self._any(obj, path, source)
                return
            if kind == "anyclass":
                self._in_classes(obj, key, path, source)
                return
            loc = (vars(obj), key) if library_module else locate(obj, kind, key)
            if loc is None:
                self._absent(obj, kind, key, path, source)
                return
            where, k = loc
            if k == "__dict__" and kind == "attr":
                whole = (obj, path, source)
            self._own_dict(obj, where, path, source)
            if kind == "attr" and isinstance(where, types.MappingProxyType) and not isinstance(obj, type):
                self._from_class(obj, key, path, source)
            path = path + ((kind, key),) if path is not None else None
            source = f"{source}.{key}" if kind == "attr" else f"{source}[{key!r}]"
            if id(where) in self.skip or k == "__dict__" or isinstance(where, tuple):
                # guarded elsewhere; a dict is read by its items; a tuple's item where the tuple was read
                obj = read_at(where, k)
                continue
            self._add_value(where, k, source, path)
            obj = read_at(where, k)
        if whole is not None:       # ``vars(x)`` handed on whole
            self._whole(*whole)
        if obj is os.environ or obj is os.getenv:      # ``"K" in environ``, iterated, ``getenv`` held
            self._environment(None)

    def _past_items(self, obj, steps, source):
        """A chain going on past an item of a list, tuple, dict or deque whose value is guarded whole (the
        objects in it by identity), ``steps`` from that item on: a read C answers from such an object's own
        state (``L[0].value`` of a ``ctypes.c_double``) is refused as where a global names the object
        (:meth:`_in_c`; the first step's own read is the caller's)."""
        for (kind, key), (next_kind, next_key) in zip(steps, steps[1:]):
            if kind != "item" or type(obj) not in (list, tuple, dict, collections.deque) \
                    or next_kind not in ("attr", "item"):
                return
            try:
                obj = obj[key]
            except (IndexError, KeyError, TypeError):
                return
            source = f"{source}[{key!r}]"
            self._in_c(obj, next_kind, next_key, source)

    def _in_c(self, obj, kind, key, source):
        """``obj.key`` / ``obj[key]`` that C answers from the state of an object held by identity alone
        (``ctypes.c_double(...).value``, a ctypes array's item): refused (:func:`.c_calls.state_read`)."""
        why = c_calls.state_read(obj, kind, key) if guard_kind(obj) == "id" else None
        if why is not None:
            read = f"{source}.{key}" if kind == "attr" else f"{source}[{key!r}]"
            raise errors.UnsupportedError(f"the traced code reads `{read}`: {why}; compute the value outside the "
                                          "compiled function and pass it in", user_line=self.line)

    def _own_dict(self, obj, d, path, source):
        """A plain object's attribute read from its own ``__dict__`` ``d``: that ``obj.__dict__`` is still
        ``d``, which the read holds (``cfg.__dict__ = {...}`` rebinds every attribute and writes no entry).
        It holds the object too: CPython 3.13 may collect an object referenced only through its own
        ``__dict__`` and clear the dict. (A module's: ``state._dict_reads``, through its tag.)"""
        if type(d) is dict and not isinstance(obj, (torch.nn.Module, type, types.ModuleType)) \
                and getattr(obj, "__dict__", None) is d:
            self._add(Read(f"{source}.__dict__", path + (("attr", "__dict__"),) if path else None, obj, "__dict__",
                           d, "id"))

    def _from_class(self, obj, key, path, source):
        """``obj.key`` found in ``obj``'s class: that the object still has that class (``cfg.__class__ =
        Other``) and no ``key`` of its own (an instance attribute set later shadows a class attribute or
        method: ``cfg.get = ...``). A module's ``forward``: ``_called``."""
        d = getattr(obj, "__dict__", None)
        if type(d) is dict and key not in d:
            self._add(Read(f"{source}.{key}", _own_item(path, key), d, key, None, "absent"))
            self._own_dict(obj, d, path, source)
        self._add(Read(f"type({source})", path + (("attr", "__class__"),) if path else None, obj, "__class__",
                       type(obj), "type"))

    def _whole(self, obj, path, source):
        """An object's ``__dict__`` read whole (``vars(x).items()``, iterated, handed on): its plain
        values, and its names (an attribute set later may be one the code finds)."""
        self._any(obj, path, source)
        if isinstance(getattr(obj, "__dict__", None), dict):
            self._names(vars(obj), source, path)

    def _names(self, d: dict, source: str, path):
        """The names ``d`` holds, in order: a dict the code read whole (iterated, searched by a name
        computed at run time) has a name added or removed."""
        holder = self.holders.setdefault(id(d), _Names(d))
        self._add(Read(f"the names in {source}", None, holder, "names", freeze(holder.names), "frozen"))

    def _environment(self, step):
        """The process environment, read by the traced code: the entry the chain names (``environ["K"]``,
        ``environ.get("K")``), else all of it (``os.getenv(k)``, ``"K" in environ``, iterating it)."""
        data, base = os.environ._data, ("G", "os", ("attr", "environ"), ("attr", "_data"))
        kind, key = step or (None, None)
        if kind in ("get", "item") and isinstance(key, str):
            k = os.environ.encodekey(key)
            source = f"os.environ[{key!r}]"
            self._add(Read(source, base + (("item", k),), data, k, data[k], "eq") if k in data
                      else Read(source, base + (("item", k),), data, k, None, "absent"))
            return
        self._add(Read("os.environ", base, os.environ, "_data", dict(data), "dict"))

    def _any(self, obj, path, source):
        """``getattr(obj, name)`` with a name computed at run time: every plain value the object holds
        (its own dict's numbers, strings, flags...) is read."""
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict) or isinstance(obj, (type, types.ModuleType, *_CALLABLES)):
            return
        self._own_dict(obj, d, path, source)
        for key, value in list(d.items()):
            if isinstance(key, str) and guard_kind(value) == "eq":
                self._add(Read(f"{source}.{key}", _own_item(path, key), d, key, value, "eq"))
        for i, c in _user_classes(obj):       # and the plain values of its classes the object does not shadow
            for key, value in list(vars(c).items()):
                if isinstance(key, str) and not key.startswith("__") and key not in d and guard_kind(value) == "eq":
                    self._add(Read(f"{source}.{key}", _class_item(path, i, key), vars(c), key, value, "eq"))

    def _in_classes(self, obj, key, path, source):
        """``super().key``: the entry ``key`` of each user class of the object, or its absence there."""
        for i, c in _user_classes(obj):
            if key in vars(c):
                self._add_value(vars(c), key, f"{source}.{key}", _class_item(path, i, key))
            else:
                self._add(Read(f"{source}.{key}", _class_item(path, i, key), vars(c), key, None, "absent"))

    def _absent(self, obj, kind, key, path, source):
        """``hasattr(obj, "k")`` False, ``getattr(obj, "k", default)``, ``d.get("k")``: the absence is
        read too, wherever the entry could be set: the dict; a user module's dict; a user class's own
        dict and its user bases'; the object's own dict and its classes' (a library's plain object
        holding the user's values too: ``types.SimpleNamespace``)."""
        if kind == "item" and isinstance(obj, dict) and id(obj) not in self.skip:
            self._add(Read(f"{source}[{key!r}]", path + (("item", key),) if path else None, obj, key, None,
                           "absent"))
            return
        if kind != "attr" or not isinstance(key, str):
            return
        if isinstance(obj, types.ModuleType):
            if not _stops(obj) and key not in vars(obj):
                self._add(Read(f"{source}.{key}", path + (("attr", key),) if path else None, vars(obj), key, None,
                               "absent"))
            return
        if isinstance(obj, type):
            if not _stops(obj):
                for i, c in enumerate(obj.__mro__):
                    if not is_library(c) and key not in vars(c):
                        self._add(Read(f"{c.__qualname__}.{key}", path + (("attr", "__mro__"), ("item", i), ("own", key))
                                       if path else None, vars(c), key, None, "absent"))
            return
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict) and key not in d and not isinstance(obj, (threading.local, *_CALLABLES)) \
                and (not _stops(obj) or _state_of_library(obj)) and not any(key in vars(c) for c in type(obj).__mro__):
            self._own_dict(obj, d, path, source)
            self._add(Read(f"{source}.{key}", _own_item(path, key), d, key, None, "absent"))
            for i, c in _user_classes(obj):
                self._add(Read(f"{source}.{key}", _class_item(path, i, key), vars(c), key, None, "absent"))

    def _add_value(self, where, key, source, path):
        value = read_at(where, key)
        if not self.structure and id(value) in self.skip:
            return      # a module's own parameter, buffer or child dict: the tree's structure
        kind = guard_kind(value)
        if isinstance(value, dict) and all(isinstance(x, (torch.nn.Module, types.FunctionType)) for x in value.values()):
            kind = "dict"       # children or hooks: compared entry by entry by identity, in C
            self._add(Read(source, path, where, key, dict(value), kind))
            for x in value.values():
                self._value(x, None, f"{source}[...]")
            return
        if kind == "frozen":
            frozen = freeze(value)
            if not checkable(value):
                raise errors.UnsupportedError(
                    f"the traced code reads `{source}`, a {type(value).__name__} too large or nested too deep to "
                    "check on every call; pass what the function needs from it as an argument",
                    user_line=self.line)
            self._add(Read(source, path, where, key, frozen, kind))
            for x in (value.values() if isinstance(value, dict) else value if isinstance(value, _ITERATED) else ()):
                if not _stops(x):
                    self._value(x, None, f"{source}[...]")
            return
        self._add(Read(source, path, where, key, value, kind))
        if kind == "id":
            self._value(value, path, source)

    def _value(self, v, path, source):
        """Something reached by value: remember its path; a function that ran adds its cells and
        defaults; an object adds the attributes the traced code loads by name."""
        owner = getattr(v, "__self__", None) if isinstance(v, (types.MethodType, types.BuiltinMethodType)) else None
        if isinstance(owner, type) and issubclass(owner, torch.autograd.Function) and id(v) not in self.done:
            # ``f = Fn.apply`` (a bound method, a builtin one from torch 2.14 on): what apply looks up on it
            self._function_methods(owner, path + (("attr", "__self__"),) if path is not None else None)
        if isinstance(v, weakref.ref) and id(v) not in self.done:       # ``REF().k``: what it points to
            self.done.add(id(v))
            self._add_value(_Called(v), "value", f"{source}()", None)
            return
        if id(v) not in self.done and isinstance(v, _LRU) and isinstance(getattr(v, "__wrapped__", None),
                                                                     types.FunctionType):
            self._cached(v, path, source)
        if id(v) in self.done or _stops(v) and not isinstance(v, _CALLABLES) and not _settings(v):
            if path is not None and _state_of_library(v):   # where a library method it ran was called from
                self.paths.setdefault(id(v), (path, source))
            elif (isinstance(v, types.BuiltinFunctionType) or c_calls.c_type(v)) and self.structure:
                self._c_function(v)     # ``from gc import get_threshold``, ``from decimal import Decimal``
            return
        self.done.add(id(v))
        if path is not None:
            self.paths.setdefault(id(v), (path, source))
        if isinstance(v, types.MethodType):
            self._value(v.__func__, None, f"{source}.__func__")
            return
        if isinstance(v, types.FunctionType):
            self._function(v, path, source)
        elif isinstance(v, types.ModuleType):        # reached by value: the names the code loads from it
            for name in sorted(self.names & set(vars(v))):
                self._follow(v, path, source, (("attr", name),))
        elif isinstance(v, functools.partial):     # what it calls with: its function, arguments, keywords
            for key in ("func", "args", "keywords"):
                self._add_value(v, key, f"{source}.{key}", path + (("attr", key),) if path else None)
        elif not isinstance(v, (torch.nn.Module, type, types.ModuleType)) and (
                isinstance(getattr(v, "__dict__", None), dict) or _slots(v)):
            self._loaded_from(v, path, source)

    def _loaded_from(self, v, path, source):
        """An object reached by value: the attributes the traced code loads by name that it holds."""
        held = set(getattr(v, "__dict__", ())) | _slots(v)
        names = self.names & held
        if dataclasses.is_dataclass(v):     # a config: library code reads its fields too (``asdict``)
            names |= {f.name for f in dataclasses.fields(v)} & held
        for name in sorted(names):
            self._follow(v, path, source, (("attr", name),))
        # A loaded name it does not hold: its user class's value (that the class still has it, that
        # the object has none of its own), else, where code asks with getattr/hasattr or loads it where an
        # exception is caught (``bytecode.probed_names``), its absence.
        in_classes = {k for _, c in _user_classes(v) for k in vars(c)}
        for name in sorted(self.names - held):
            if name in in_classes:
                self._follow(v, path, source, (("attr", name),))
            elif name in self.probed:
                self._absent(v, "attr", name, path, source)

    def _cached(self, wrapper, path, source):
        """A ``functools.lru_cache``'d function: a call answered from its cache ran none of its body, so
        the body's reads are taken as made (they are the ones a miss makes), hit or miss."""
        self.done.add(id(wrapper))
        inner = wrapper.__wrapped__
        if is_library(inner):
            return
        self.executed.add(inner.__code__)
        self.cached.append(Frame(inner.__code__, USER, inner.__globals__))
        self._value(inner, path + (("attr", "__wrapped__"),) if path else None, f"{source}.__wrapped__")

    def _function(self, fn, path, source):
        if is_library(fn):
            return
        for key in ("__defaults__", "__kwdefaults__"):
            if getattr(fn, key) is not None:
                self._add_value(fn, key, f"{source}.{key}", path + (("attr", key),) if path else None)
        if fn.__code__ not in self.executed:
            return
        # The code that ran, by identity: a helper whose ``__code__`` is replaced (hot reload, a
        # monkeypatch) is another program under the same function object.
        self._add(Read(f"{source}.__code__", path + (("attr", "__code__"),) if path else None, fn, "__code__",
                       fn.__code__, "id"))
        for c in _cell_chains(fn.__code__, self.executed):
            if c.root == "deref":
                where, _ = locate(fn, "cell", c.name)
                cpath = path + (("cell", c.name),) if path else None
                csource = c.name
                try:
                    where.cell_contents
                except ValueError:
                    continue            # an empty cell: the code would have raised
                self._add_value(where, None, csource, cpath)
                self._follow(where.cell_contents, cpath, csource, c.steps)


# Names whose use reads attributes named by a value (``operator.attrgetter("k")``), or a getter the
# bytecode may not see called with its object and name together.
# ``super(C, self).k`` too: the bytecode names neither the object nor the classes searched.
_REFLECTING = frozenset(("attrgetter", "methodcaller", "getattr_static", "__getattribute__", "__getattr__", "super",
                         "vars"))


def reflected_call(fn, code, line, why) -> errors.UnsupportedError:
    """The refusal of a C call the recording saw user code make (``reads.Recording.reflected``)."""
    return _unchecked_call(fn, why, f"{code.co_filename}:{line} in {code.co_name}")


def _unchecked_call(fn, why: str, line) -> errors.UnsupportedError:
    """The refusal of a C call whose answer no guard can check (:func:`.c_calls.verdict`)."""
    return errors.UnsupportedError(f"the traced code calls `{c_calls.named(fn)}`: {why}; compute the value outside "
                                   "the compiled function and pass it in", user_line=line)


def _reach(obj, steps):
    """The objects a load chain passes through from ``obj`` (attributes, items, ``__dict__``), and the
    items of a container it ends at: what reflective code may read from. Best effort: a step that
    fails ends it."""
    out = [obj]
    for kind, key in steps:
        if kind in ("any", "anyclass"):
            continue
        try:
            obj = obj[key] if kind in ("item", "get") and not isinstance(obj, types.ModuleType) else \
                getattr(obj, key) if kind == "attr" else None
        except Exception:       # the user's own lookup (a property, ``__getitem__``) failing here
            break
        if obj is None or type(obj) in _EQ_TYPES:
            break
        out.append(obj)
    if isinstance(obj, (list, tuple, dict, collections.deque)):
        out += [x for x in (obj.values() if isinstance(obj, dict) else obj) if type(x) not in _EQ_TYPES][:_FROZEN_LIMIT]
    return [o for o in out if not isinstance(o, (dict, list, tuple, torch.Tensor))]


def _reflects(f, found) -> bool:
    return not _REFLECTING.isdisjoint(f.code.co_names) or any(
        c.root == "global" and isinstance(f.globals.get(c.name), (operator.attrgetter, operator.methodcaller))
        for c in found)


_ITERATED = (list, tuple, set, frozenset, collections.deque)      # containers whose items are followed


def _settings(obj) -> bool:
    """A library object holding settings (``types.SimpleNamespace``, ``argparse.Namespace``, a
    library's config class): its values are plain or containers, so what the code loads from it by
    name is followed when it is reached by value (``ns = NS; ns.scale``), as it is when named."""
    d = getattr(obj, "__dict__", None)
    return _state_of_library(obj) and len(d) <= _FROZEN_LIMIT and all(
        type(x) in _EQ_TYPES or type(x) in (list, tuple, dict, set, frozenset) for x in d.values())


def _is_special(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def switch_name(name: str) -> str:
    return name.removeprefix("_get_").removeprefix("get_").removeprefix("is_")


def _slots(obj) -> set:
    """The ``__slots__`` members of ``obj``'s user classes (its values, read through the object)."""
    return {k for _, c in _user_classes(obj) for k, d in vars(c).items() if isinstance(d, types.MemberDescriptorType)}


def _user_classes(obj):
    """``(i, cls)`` for the classes of ``obj``'s type's MRO that are the user's (a library's are constant)."""
    return [(i, c) for i, c in enumerate(type(obj).__mro__) if not is_library(c)]


def _cell_chains(code, executed) -> list:
    """The chains of ``code`` and of the nested code in it that ran (a lambda, an inner function, a
    comprehension) that load one of ``code``'s free variables: each nested load of such a name reads
    the function's own cell (nested code closes over the same cell)."""
    found = list(chains(code)[0])
    todo = [(c, frozenset(code.co_freevars)) for c in code.co_consts if isinstance(c, types.CodeType)]
    while todo:
        inner, free = todo.pop()
        free = free - set(inner.co_cellvars)    # a name the nested code defines itself shadows the cell
        todo.extend((c, free) for c in inner.co_consts if isinstance(c, types.CodeType))
        if inner in executed and free & set(inner.co_freevars):
            found += [c for c in chains(inner)[0] if c.root == "deref" and c.name in free]
    return found


def _anon(obj) -> str:
    return f"<{type(obj).__name__} object>"


def assumed(fn, leaves, root_name, rec) -> list:
    """Every read the traced call made, as guardable ``Read`` s, and the installed libraries' code
    it ran (``cache.library_code``: held by identity here, by contents in another process)."""
    from .cache import library_code, process_answers
    return Resolver(fn, leaves, root_name, rec).resolve() + library_code(rec) + process_answers(rec)


