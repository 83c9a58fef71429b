"""Whose write was it: the capture's own thread's, or another thread's.

A capture finds the Python state its trace wrote by comparing copies (:mod:`.writes`). When other
threads run meanwhile (a data-loading thread drawing from ``random``, a logger bumping a global), a
change found may be theirs: undoing it would take their write back (and repeat their random numbers),
and refusing the capture for it would be a false alarm. So a capture that starts with other threads
alive watches its own thread while user code runs in it (``sys.setprofile`` is per thread: the read
recording, then a lighter watch around the joint's forward and backward, paused inside ops): the
code objects that ran, the objects their stores wrote (as each frame returns) and the calls it made
into a global random stream or a container's changing methods.

* A changed module global, class or object attribute is the capture's when code that ran in its thread
  stores that name *on that object*: the object each of its stores names, as its frame holds it when
  the code returns (``self``, an argument, a global, a closure variable, and what attributes and items
  of them lead to: ``CFG.n += 1``, ``self.a.k = v``, ``type(self).k = v``); ``setattr(x, ...)``,
  ``object.__setattr__(x, ...)``, ``x.__dict__[k] = v``, ``vars(x).update(...)``: that name (any, where
  it is no constant) of ``x``; ``global`` stores and ``globals()[k] = v``: its module's globals; code at
  module level: its namespace; or when it now holds a traced tensor. User code writing through an
  object its bytecode does not name (``for m in mods: m.k = v``, ``setattr(f(), k, v)``), or through a
  setter it looked up (``getattr(builtins, "setattr")``, ``methodcaller("__setattr__", ...)``, a
  ``setattr`` the watch saw called by code not naming it) may have written that name (any name) of any object. A library's writes through objects it does not name are
  to objects of its own, and a name alone is no evidence: torch's ``set_grad_enabled`` stores
  ``self.mode`` on itself, not on the user's ``CFG``. Otherwise it is left as the other thread made
  it, and one the trace *read* that changed meanwhile makes the capture run again (its graph may have
  used either value).
* A changed ``random`` stream, or torch's global generator, is the capture's when its thread called
  one of the stream's methods (a traced op draws from no real stream: the capture's own changes are
  seeding and setting states); it is then refused and put back as without threads (a draw another
  thread made meanwhile is then made again: the rare case of both at once). Otherwise it is left as
  the other thread made it: an eager training thread's dropout keeps its stream while a capture runs. numpy's global stream cannot be told apart (its draws are
  Cython functions, which profiling does not see): a change is the capture's, as without threads.

* A parameter, buffer or submodule registered on (or dropped from) a traced module is the capture's
  when it holds a traced tensor or code that ran in its thread could write its name on the module (or
  called one of its dict's changing methods); otherwise it
  stays as the other thread left it, and a trace that read the module's dict runs again.

* A hook registered on (or removed from) a traced module is the capture's when its thread registered
  or removed a hook (a ``RemovableHandle`` was made or removed in it); otherwise it stays as the other
  thread left it, and the trace, which read the module's hook dicts, runs again.

* An object's attribute (``model.eval()``'s ``training`` flags, ``obj.x = v``) is the capture's when
  code that ran in its thread could write that name on it (as for a global); a container's items (a
  global list appended to, a dict item set, ``set.add``) when its thread called one of the
  container's changing methods (a ``c_call`` whose ``__self__`` it is), or its user code stores
  by subscript or in place anywhere (``d[k] = v`` makes no call: any container may be its
  write). Otherwise they stay as the other thread left them, and a read one runs the trace again.

* torch's process-wide switches are told apart by :mod:`..runtime.modes` from what the watch notes
  when its thread's call of a switch's C setter returns (:meth:`Watch.c_return`).

Cells and iterators stay the capture's.
"""
from __future__ import annotations

import dis
import functools
import inspect
import os
import random
import sys
import types

import torch

from ..runtime.modes import SETTERS, global_state
from .bytecode import _OPERATOR_WRITES, ANY, CHANGERS, SETTER_NAMES, Chain, Store, chains
from .writes import _GONE, _changed, _entries, _own_dict, _same, changed_keys, held_dict, peek, state_changes, traced

_STORING = frozenset(dis.opmap[n] for n in ("STORE_GLOBAL", "DELETE_GLOBAL", "STORE_ATTR", "DELETE_ATTR",
                                             "STORE_SUBSCR", "DELETE_SUBSCR"))
_NAMESPACE = ((Chain("namespace", "", (), None), frozenset((ANY,))),)
# (code that may write an attribute with no store instruction: a setter called, a namespace written)
_REFLECTIVE = frozenset({"setattr", "delattr", "__setattr__", "__delattr__", "globals", "vars", "__dict__",
                         *CHANGERS, *_OPERATOR_WRITES})      # (and containers' writers)
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The methods of a torch generator that change its stream (reading its state does not).
_TORCH_SETTERS = frozenset({"manual_seed", "seed", "set_state", "graphsafe_set_state", "set_offset"})
_SUBSCRIPT_STORES = frozenset({"STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE", "DELETE_SLICE"})
# Containers a call of one of their changing methods (``CHANGERS``) by the capturing thread makes its own.
_CONTAINERS = (list, dict, set, bytearray)
_scanned: dict = {}     # code -> ``_writes(code)``: code is immutable


class Watch:
    """What the capturing thread ran and drew during one capture."""

    def __init__(self, is_user, is_library):
        self.is_user = is_user      # code -> whether it is the user's (library code's globals() are its own)
        self.is_library = is_library
        self.ran: set = set()       # code objects
        self.wrote: dict = {}       # id of an object (a module: its dict) -> the names code stored on it (ANY: every)
        self.loose: dict = {}       # code -> names it stores on objects its frame did not hold when seen
        self.drew: set = set()      # names of the random streams it called into
        self.owners = _stream_owners()
        self.rec = None             # the read recording it goes with (``reads.record``)
        self.switches: dict = {}    # index in modes.global_state() -> its value right after this thread set it
        self.touched: set = set()   # ids of the containers whose changing methods this thread called
        self._subscripts = None     # whether user code it ran stores by subscript (found once, after)
        self._anywhere = None       # the names user code it ran may have stored on any object (found once)

    def drew_from(self, name) -> bool:
        """Whether this thread drew from the stream ``name``: a call of its methods was seen (Python's
        ``random``). numpy's draws are Cython functions, which profiling does not see: a change of its
        stream is always the capture's (refused and put back, as without threads)."""
        return name in self.drew or name == "numpy.random"

    def c_call(self, arg, code):
        held = getattr(arg, "__self__", None)
        owner = self.owners.get(id(held))
        if owner is not None and (owner[0] != "torch" or arg.__name__ in _TORCH_SETTERS):
            self.drew.add(owner[0])
        elif type(held) in _CONTAINERS and arg.__name__ in CHANGERS:
            self.touched.add(id(held))
        elif arg is setattr or arg is delattr:
            self.set_through(arg, code)

    def set_through(self, setter, code):
        """``setattr``/``delattr`` called by code that does not name it (``getattr(builtins, "setattr")``,
        an alias ``SET = setattr``): no store its bytecode shows names the object, so the user code may
        have written any name of any object (a library's such call writes objects of its own)."""
        if setter.__name__ not in code.co_names and self.is_user(code):
            self.loose[code] = self.loose.get(code, frozenset()) | {ANY}

    def c_return(self, arg):
        """A process-wide torch setting this thread set (``modes.SETTERS``): its value now is this
        thread's (``modes.left_as_found`` keeps another thread's later one)."""
        ix = SETTERS.get(getattr(arg, "__name__", None))
        if ix is not None:
            state = global_state()
            self.switches.update((i, state[i]) for i in ix)

    def profile(self, previous):
        """The profile function of this thread while the read recording is off (``previous``: a
        user's profiler, kept running)."""
        ran, owners, drew, c_return, touched = self.ran, self.owners, self.drew, self.c_return, self.touched
        returned, set_through = self.returned, self.set_through

        def watch(frame, what, arg):        # (c_call inlined: called for every event)
            if what == "call":
                ran.add(frame.f_code)
            elif what == "return":
                returned(frame)
            elif what == "c_call":
                held = getattr(arg, "__self__", None)
                owner = owners.get(id(held))
                if owner is not None and (owner[0] != "torch" or arg.__name__ in _TORCH_SETTERS):
                    drew.add(owner[0])
                elif type(held) in _CONTAINERS and arg.__name__ in CHANGERS:
                    touched.add(id(held))
                elif arg is setattr or arg is delattr:
                    set_through(arg, frame.f_code)
            elif what == "c_return" and arg.__name__ in SETTERS:
                c_return(arg)
            if previous is not None:
                previous(frame, what, arg)
        watch.between_user_code = True      # ops pause it (capture.session): no user code runs in them
        watch.watch = self
        return watch

    def returned(self, frame, scanned=_scanned):
        """A frame of this thread returns: the objects its stores name, as its frame holds them as it
        ends, are noted with the names stored on them (:func:`_writes`)."""
        code = frame.f_code
        stores = (scanned.get(code) or _writes(code))[0]
        if not stores:
            return
        wrote = self.wrote
        for chain, names in stores:
            try:
                obj = _held(frame, chain, self.is_library)
            except Exception:       # (a profile function must not raise)
                obj = _GONE
            if obj is _GONE:
                self.loose[code] = self.loose.get(code, frozenset()) | names
                continue
            key = id(vars(obj)) if isinstance(obj, types.ModuleType) else id(obj)
            had = wrote.get(key)
            wrote[key] = names if had is None or had is names else had | names

    def could_write(self, key, *objs) -> bool:
        """Whether code this thread ran could store ``key`` on one of ``objs`` (an object, a dict)."""
        if any(key in names or ANY in names or id(o) in self.touched for o in objs
               for names in (self.wrote.get(id(o), ()),)):       # (``touched``: ``vars(x).update(...)``)
            return True
        if self._anywhere is None:      # (user code's stores no frame showed the object of: found once)
            user = [c for c in tuple(self.ran) if self.is_user(c)]
            self._anywhere = set().union(*(self.loose.get(c, ()) for c in user), *(_writes(c)[1] for c in user))
        return key in self._anywhere or ANY in self._anywhere

    def _foreign(self, s) -> list:
        """The changed names of a module's globals, an object's or a user class's dict (snapshot ``s``)
        that this thread could not have written."""
        now = s.obj if s.kind == "attrs" else dict(vars(s.obj))
        objs = (s.obj,) if isinstance(s.owner, str) else (s.obj, s.owner)
        return [k for k in changed_keys(now, s.before) if not traced(now.get(k)) and not self.could_write(k, *objs)]

    def adopt(self, snaps) -> list:
        """Take into the copies of module globals the changes this thread could not have made, so that
        they are neither undone nor refused; ``[(globals dict, name)]`` of those."""
        foreign = []
        for s in snaps:
            if s.kind == "state":
                foreign += self._adopt_state(s)
                continue
            if s.kind == "hooks":
                foreign += self._adopt_hooks(s)
                continue
            if s.kind in ("items", "argument"):
                foreign += self._adopt_items(s)
                continue
            if s.kind not in ("class", "attrs"):
                continue        # not a module's globals, an object's or a class's attributes
            d = s.obj if s.kind == "attrs" else held_dict(vars(s.obj))
            for key in self._foreign(s):
                if key in d:
                    s.before[key] = d[key]
                else:
                    del s.before[key]
                foreign.append((d, key))
        return foreign

    def _adopt_items(self, s) -> list:
        """A container another thread changed meanwhile (``LOG.append(...)``, ``CFG[k] = v``): this
        thread called none of its methods that change it (``c_call``) and ran no user code storing
        into some container by subscript. It stays as the other thread left it; its changed items
        are listed (a trace that read one runs again)."""
        if id(s.obj) in self.touched or id(s.obj) in self.wrote or self.subscript_stores() or not _changed(s):
            return []
        obj, before = s.obj, s.before
        now = _entries(obj) if isinstance(obj, dict) else obj.copy()
        keys = [k for k in now.keys() | before.keys() if not _same(now.get(k, _GONE), before.get(k, _GONE))] \
            if isinstance(obj, dict) else range(len(obj)) if isinstance(obj, list) else ()
        s.before = now
        return [(obj, k) for k in keys]

    def subscript_stores(self) -> bool:
        """Whether user code this thread ran stores or deletes by subscript, or updates in place
        (``d[k] = v``, ``xs += [v]``): any container it reaches may be its write."""
        if self._subscripts is None:
            self._subscripts = any(self.is_user(c) and _subscripts(c) for c in tuple(self.ran))
        return self._subscripts

    def _adopt_state(self, s) -> list:
        """A parameter, buffer or child another thread registered (or dropped) on a traced module
        meanwhile: one holding no traced tensor, whose name no code of this thread could write.
        It stays; the module's dict is listed as changed (a trace that read its length runs again)."""
        module, key = s.owner
        d = vars(module)[key]
        theirs = [k for k in state_changes(s) if not self.could_write(k, module, d)
                  and not any(traced(t) for t in _tensors(dict.get(d, k)))]
        for k in theirs:
            if k in d:
                s.before[k] = dict.__getitem__(d, k)
            else:
                del s.before[k]
        return [(vars(module), key)] if theirs else []


    def _adopt_hooks(self, s) -> list:
        """A hook another thread registered on (or removed from) a traced module meanwhile: this thread
        registered and removed none (no ``RemovableHandle`` ran in it). It stays as the other thread left
        it; the module's hook dict is listed as changed (the trace read it: it runs again)."""
        if s.obj.keys() == s.before.keys() and all(s.obj[k] is s.before[k] for k in s.before) \
                or self.ran & _HOOK_CODES:
            return []
        s.before.clear()
        s.before.update(s.obj)
        d = vars(s.owner)
        return [(d, k) for k, v in list(d.items()) if v is s.obj]


# A hook registered or removed through the module's API runs these (a direct write to a hook dict
# does not: the capturing thread's own is then taken for another's, and the guards see it next call).
_HOOK_CODES = frozenset({torch.utils.hooks.RemovableHandle.__init__.__code__,
                         torch.utils.hooks.RemovableHandle.remove.__code__})


def _tensors(v) -> list:
    if isinstance(v, torch.nn.Module):
        return [*v.parameters(), *v.buffers()]
    return [v] if v is not None else []


def _stream_owners() -> dict:
    """id -> (name, object) of the global random streams a draw is a method call of."""
    owners = {id(random._inst): ("random", random._inst)}
    # torch's default generators: seeding or setting one (torch.manual_seed, torch.seed,
    # default_generator.set_state) is a call of its C methods; traced ops draw from none of them.
    cuda = torch.cuda.default_generators if torch.cuda.is_initialized() else ()
    owners.update({id(g): ("torch", g) for g in (torch.default_generator, *cuda)})
    np_random = getattr(sys.modules.get("numpy"), "random", None)
    rand = getattr(getattr(np_random, "mtrand", None), "_rand", None)
    if rand is not None:
        owners[id(rand)] = ("numpy.random", rand)
    return owners


def _writes(code) -> tuple:
    """``(((chain of an object it stores on, frozenset of the names), ...), the names it stores on
    objects no chain names)``, from its bytecode (``bytecode.chains``'s stores; ``ANY`` stands for every
    name: ``setattr(x, k, v)``, ``x.__dict__[k] = v``): the chains are followed in its frame
    (:meth:`Watch.returned`). Code at module level (a class body, text exec'd) writes its namespace.
    aotgrad's own code is none of the program's."""
    hit = _scanned.get(code)
    if hit is not None:
        return hit
    hit = ((), frozenset())
    if not code.co_flags & inspect.CO_OPTIMIZED:
        hit = (_NAMESPACE, frozenset())
    elif not code.co_filename.startswith(_OURS) and (_STORING.intersection(code.co_code[::2])
                                                     or _REFLECTIVE.intersection(code.co_names)
                                                     or SETTER_NAMES.intersection(code.co_consts)):
        targets, anywhere = {}, set()
        try:
            stores = chains(code)[1]
        except Exception:       # (bytecode its reader does not follow: a profile function must not raise)
            stores = [Store("", None, None, i.argval) for i in dis.get_instructions(code)
                      if i.opname in ("STORE_ATTR", "DELETE_ATTR")]
        for st in stores:
            if st.name is not None:
                (targets.setdefault(st.on, set()) if st.on is not None else anywhere).add(st.name)
        hit = (tuple((c, frozenset(n)) for c, n in targets.items()), frozenset(anywhere))
    _scanned[code] = hit
    return hit


@functools.cache        # (code is immutable)
def _subscripts(code) -> bool:
    """Whether the code stores or deletes by subscript, or updates in place (``d[k] = v``, ``xs += [v]``)."""
    return any(i.opname in _SUBSCRIPT_STORES or i.opname == "BINARY_OP" and "=" in i.argrepr
               or i.opname.startswith("INPLACE_") for i in dis.get_instructions(code))


def _held(frame, chain, is_library):
    """The object ``chain`` names in ``frame`` now, or ``_GONE``: followed through dicts only (``peek``),
    ``__class__`` as the object's type."""
    if chain.root in ("globals", "namespace"):
        return frame.f_globals if chain.root == "globals" else frame.f_locals
    v = frame.f_locals.get(chain.name, _GONE) if chain.root in ("fast", "deref") else \
        frame.f_globals.get(chain.name, _GONE) if chain.root == "global" else \
        sys.modules.get(chain.name, _GONE) if chain.root == "import" else _GONE
    for kind, key in chain.steps:
        if v is _GONE or kind not in ("attr", "item"):
            return _GONE
        if (kind, key) == ("attr", "__class__"):
            v = type(v)
        elif (kind, key) == ("attr", "__dict__"):       # (a class's: the class; a module's: its globals)
            v = v if isinstance(v, type) else vars(v) if isinstance(v, types.ModuleType) else _own_dict(v)
            v = _GONE if v is None else v
        else:
            v = peek(v, kind, key, is_library)
    return v
