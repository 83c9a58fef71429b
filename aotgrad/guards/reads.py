"""What a trace read: every user code object that ran while a call was traced,
with the globals, ``self`` and object arguments it ran with, and the access
chains (``SCALE``, ``self.fc.weight``, ``helpers.act``, ``cfg['lr']``) its
bytecode loads.

``record()`` watches the trace with ``sys.setprofile`` (call events only);
``chains(code)`` reads a code object's loads once and caches them. What the
chains resolve to, and the guards on it, is :mod:`aotgrad.guards.state`.
It also copies the Python state the traced code could write (:mod:`.writes`), so
a trace that assigned or changed state outliving the call (``self.calls += 1``,
``HISTORY.append(loss)``) is found, undone and refused: the compiled graph would
not repeat it.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import os
import sys
import sysconfig
import threading
import types
from dataclasses import dataclass, field

import torch

from .._torch import MODULE_CALL_CODES
from . import attribution
from .writes import Writes, held_dict

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NN = os.path.join(_TORCH, "nn", "modules") + os.sep
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = tuple(os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"],
                                                       sysconfig.get_paths()["platstdlib"]})
_CALL_IMPL = MODULE_CALL_CODES

SKIP, USER, NN_METHOD, MODULE_CALL, LIBRARY = 0, 1, 2, 3, 4
_CONSTRUCTORS = ("__init__", "__new__", "__post_init__", "__setstate__")


def kind_of(code, module_name) -> int:
    """How much of a code object's reads matter: all of user code's; only ``self.x`` of
    ``torch.nn`` modules' methods; ``self.x`` and plain globals (flags, settings) of installed
    libraries' code; the hooks of a module a ``_call_impl`` ran for."""
    if code in _CALL_IMPL:
        return MODULE_CALL
    path = code.co_filename
    if code.co_name == "<module>":      # an import or an exec running during the trace, not the traced code
        return SKIP
    if path.startswith("<"):
        # Code made by exec (a user's, or a user dataclass's methods) belongs to the module whose
        # globals it runs with; FX's generated graphs and library dataclasses do not.
        generated = path.startswith(("<eval_with_key", "<aotgrad")) or not isinstance(module_name, str) \
            or module_name.startswith("namedtuple_")        # torch's eval'd lambdas, namedtuple's __new__
        return SKIP if generated or is_library(module_name) else USER
    path = os.path.abspath(path)
    if path.startswith(_NN):    # a torch module's own methods read its settings; the base class's, its internals
        is_method = code.co_argcount and code.co_varnames[0] == "self" and path != _NN + "module.py"
        return NN_METHOD if is_method else SKIP
    if path.startswith((_TORCH, _OURS)):
        return SKIP
    if os.sep + "site-packages" + os.sep in path:     # (a virtual environment's site-packages is under its stdlib)
        # An installed model library's module methods (HF's ``self.config.output_hidden_states``,
        # ``self.training``) read the user's settings as torch's own modules do: their ``self.x``;
        # its functions read its own settings (a flag its ``set_...`` function assigns): plain globals.
        return LIBRARY
    return SKIP if path.startswith(_STDLIB) else USER


def is_library(obj) -> bool:
    """Library objects (torch, the standard library, installed packages) are assumed constant;
    ``obj`` may also be a module's name."""
    mod = obj if isinstance(obj, (type(sys), str)) else getattr(obj, "__module__", None)
    name = getattr(mod, "__name__", mod) if mod is not None else None
    if not isinstance(name, str):
        return False
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in ("torch", "aotgrad", "numpy", "builtins"):
        return True
    file = getattr(sys.modules.get(name), "__file__", None) or ""
    return os.sep + "site-packages" + os.sep in file


@dataclass
class Frame:
    """One distinct way a code object ran: its globals, ``self`` and object arguments."""
    code: object
    kind: int
    globals: dict | None
    self_obj: object = None
    args: dict = field(default_factory=dict)
    containers: tuple = ()      # lists, dicts, tuples, sets among its free variables (closed-over registries)


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.Tensor, torch.dtype, torch.device)
_CONTAINERS = (list, tuple, dict, set, frozenset)


@dataclass
class Recording:
    frames: dict = field(default_factory=dict)      # (code, id(globals), id(self), ids of args) -> Frame
    kinds: dict = field(default_factory=dict)       # code -> kind
    writes: Writes = field(default_factory=lambda: Writes(is_library))   # state a write could change

    root: object = None         # the traced function's code, or its module: recording stops when it returns
    root_frame: object = None
    stop: object = None
    light: object = None        # the watch alone (``user_code``), where other threads run
    watch: object = None        # other threads ran meanwhile: what this thread ran (``.attribution``)

    def event(self, frame, event, arg):
        if event != "call":
            if event == "return":
                if frame is self.root_frame:
                    self.stop()
                elif self.writes.memoized and frame.f_code in self.writes.memoized:
                    self.writes.memoizes(frame.f_code, arg)
            elif event == "c_call" and self.watch is not None:
                self.watch.c_call(arg)
            return
        code = frame.f_code
        if self.watch is not None:
            self.watch.ran.add(code)
        kind = self.kinds.get(code)
        if kind is None:
            kind = self.kinds[code] = kind_of(code, frame.f_globals.get("__name__"))
        if kind:
            if self.root_frame is None and (code is self.root or kind == MODULE_CALL
                                            and frame.f_locals.get("self") is self.root):
                self.root_frame = frame
            self._add(frame, code, kind)

    def _add(self, frame, code, kind):
        f_locals = frame.f_locals
        n_args = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:n_args]
        self_obj = f_locals.get("self") if names[:1] == ("self",) else None
        if kind == LIBRARY:
            g = frame.f_globals
            self_obj = self_obj if isinstance(self_obj, torch.nn.Module) else None
            self.frames.setdefault((code, id(g), id(self_obj), ()), Frame(code, kind, g, self_obj))
            return
        if kind != USER:
            if not isinstance(self_obj, torch.nn.Module):
                return
            if kind == MODULE_CALL:     # a module being called is the user's (methods may build new ones)
                self.writes.attrs(self_obj)
                self.writes.module_hooks(self_obj)
            self.frames.setdefault((code, None, id(self_obj), ()), Frame(code, kind, None, self_obj))
            return
        # Arguments and the free variables nested code (a comprehension, a generator expression, a
        # lambda, an inner function) sees: loads from them are followed like loads from ``self``.
        seen = [(n, f_locals.get(n, _GONE)) for n in (*names[1 if self_obj is not None else 0:], *code.co_freevars)]
        args = {n: v for n, v in seen if not isinstance(v, _PLAIN) and not is_library(type(v))
                and hasattr(v, "__dict__")}
        g = frame.f_globals
        key = (code, id(g), id(self_obj), tuple((n, id(v)) for n, v in seen if not isinstance(v, _PLAIN)))
        if key in self.frames:
            return
        held = tuple(v for n, v in seen[len(seen) - len(code.co_freevars):] if isinstance(v, _CONTAINERS)) \
            if code.co_freevars else ()
        self.frames[key] = Frame(code, kind, g, self_obj, args, held)
        if code.co_name in _CONSTRUCTORS:   # an object being built is not state from before the call
            if self_obj is not None:
                self.writes.built.add(id(self_obj))
            return
        self._writable(frame, code, f_locals, g)

    def _writable(self, frame, code, f_locals, g):
        """Copy the state this code could write that may outlive the call (see :mod:`.writes`)."""
        w = self.writes
        w.module_dict(g)
        root = self.root_frame
        if frame is root or root is not None and root.f_code in _CALL_IMPL and frame.f_back is root:
            # The traced function's own arguments: a list or dict there stands for the caller's,
            # which the compiled function never changes (it gets the tensors, not the containers).
            for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                w.argument(f_locals.get(n), n)
        found, stores = chains(code)
        for c in found:
            v = g.get(c.name, _GONE) if c.root == "global" else f_locals.get(c.name, _GONE)
            if v is not _GONE:
                w.chain(v, c.steps, c.name)
        assigned = [s.target for s in stores if s.target in code.co_freevars]
        outer = [n for n in assigned if not _defined_in_trace(frame, n)]
        if outer:
            w.cells(code, outer)

    def undo_writes(self) -> list:
        """Put back every change the traced code made to state that outlives the call; ``(text, key)`` each."""
        self.root_frame = None      # its locals are the call's own state, not the user's
        for f in self.frames.values():      # a local list held here would look like lasting state
            f.containers = ()
        return self.writes.undo(self.watch)

    def raced(self, reads) -> str | None:
        """The source of a read whose value another thread changed while this was traced, if any."""
        foreign = {(id(d), k) for d, k in self.writes.foreign}
        return next((r.source for r in reads if (id(held_dict(r.where)), r.key) in foreign), None)


def _defined_in_trace(frame, name) -> bool:
    """Whether the cell ``name`` that ``frame``'s code assigns belongs to a running frame (made in the call)."""
    code, f = frame.f_code, frame.f_back
    while f is not None:
        if name in f.f_code.co_cellvars and _encloses(f.f_code, code):
            return True
        f = f.f_back
    return False


def _encloses(outer, inner) -> bool:
    return any(c is inner or isinstance(c, types.CodeType) and _encloses(c, inner) for c in outer.co_consts)


_GONE = object()


@contextlib.contextmanager
def record(fn=None):
    """Record the code that runs inside the block (this thread) until the first call of ``fn``
    returns: capture runs ``fn`` once per trace, the same Python each time, and profiling
    costs every trace it watches about as much again. An existing profiler keeps running."""
    root = getattr(getattr(fn, "func", fn), "__code__", None) if not isinstance(fn, torch.nn.Module) else fn
    rec = Recording(root=root, watch=attribution.watch(lambda code: kind_of(code, None) == USER))
    previous = sys.getprofile()
    event = rec.event
    if previous is not None:
        def event(frame, what, arg):
            rec.event(frame, what, arg)
            previous(frame, what, arg)
    if rec.watch is not None:       # this thread is watched while user code runs, not only while recording
        rec.watch.rec = rec
        rec.light = rec.watch.profile(previous)
    rec.stop = lambda: sys.setprofile(previous)
    rec.restart = lambda: (setattr(rec, "root_frame", None), sys.setprofile(event))
    outer = getattr(_ACTIVE, "rec", None)
    _ACTIVE.rec = rec
    sys.setprofile(event)
    try:
        yield rec
    finally:
        sys.setprofile(previous)
        _ACTIVE.rec = outer


_ACTIVE = threading.local()     # the recording whose block this thread is in


def watch_again():
    """The recording of this thread's block, stopped when the traced function returned, watches its
    next call too: a trace retried (symbolic sizes failed, static ones next) runs its Python again,
    maybe further than the failed one got."""
    rec = getattr(_ACTIVE, "rec", None)
    if rec is not None:
        rec.restart()


@contextlib.contextmanager
def user_code():
    """The block runs the user's code again after the read recording stopped (the joint trace): where
    other threads run too, this thread stays watched meanwhile (:mod:`.attribution`), for the writes
    and random draws the trace makes there. (Watching costs a profile event per call: only here.)"""
    rec = getattr(_ACTIVE, "rec", None)
    light = rec.light if rec is not None else None
    if light is None or watching() is not None:      # none, or recording, or watching already
        yield
        return
    previous = sys.getprofile()
    sys.setprofile(light)
    try:
        yield
    finally:
        sys.setprofile(previous)


def watching() -> Recording | None:
    """The :class:`Recording` watching this thread, or None."""
    return _recording_of(sys.getprofile())


def _recording_of(event, depth=0) -> Recording | None:
    """The Recording a profile function is (part of): a bound method, or a closure chaining them."""
    owner = getattr(event, "__self__", None) or getattr(event, "watch", None)
    if isinstance(owner, (Recording, attribution.Watch)):
        return owner if isinstance(owner, Recording) else owner.rec
    for cell in (getattr(event, "__closure__", None) or ()) if depth < 3 else ():
        found = cell.cell_contents if isinstance(cell.cell_contents, Recording) else \
            _recording_of(cell.cell_contents, depth + 1) if callable(cell.cell_contents) else None
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def paused():
    """A recording watching this thread stops inside the block: for library work no user code
    runs in (wrapping inputs, a block call's kernel), where watching only costs. Another
    profiler (a user's) keeps running."""
    watcher = sys.getprofile() if watching() is not None else None
    if watcher is not None:
        sys.setprofile(None)
    try:
        yield
    finally:
        if watcher is not None:
            sys.setprofile(watcher)


# ---------------------------------------------------------------- attribute reads of given objects

@dataclass(eq=False)
class _Watch:
    names: frozenset
    thread: int
    read: set = field(default_factory=set)
    subs: dict = field(default_factory=dict)    # name -> the value the watching thread reads instead
    raw: bool = False                           # the instance's __dict__ was read (its real values)


_WATCHES: dict = {}         # id(object) -> [_Watch]: the object's class is its watching subclass meanwhile
_WATCH_LOCK = threading.Lock()
_WATCHING_CLASS: dict = {}  # class -> its watching subclass
_BASE: dict = {}            # watching subclass -> class
_MODULE_OWN = frozenset(f.__code__ for f in (torch.nn.Module.__getattr__, torch.nn.Module.__setattr__,
                                              torch.nn.Module.__delattr__))


def _watching_class(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` that notes, for the watching thread, each watched name
    read, and every name when the instance's ``__dict__`` is read (``vars(self)``) by code other
    than ``nn.Module``'s own attribute plumbing or aotgrad's. ``__class__`` still reads ``cls``."""
    sub = _WATCHING_CLASS.get(cls)
    if sub is not None:
        return sub
    get = cls.__getattribute__

    def __getattribute__(self, name):
        if name == "__class__":
            return cls
        watches = _WATCHES.get(id(self))
        if watches:
            tid = threading.get_ident()
            for w in watches:
                if w.thread != tid:
                    continue
                if name in w.names:
                    w.read.add(name)
                    if name in w.subs:
                        return w.subs[name]
                elif name == "__dict__":
                    caller = sys._getframe(1).f_code
                    if caller not in _MODULE_OWN and not caller.co_filename.startswith(_OURS):
                        w.read.update(w.names)
                        w.raw = True
        return get(self, name)
    sub = type(cls)(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
    _WATCHING_CLASS[cls], _BASE[sub] = sub, cls
    return sub


@contextlib.contextmanager
def attribute_reads(targets, subs=None, raw=None):
    """Which of the named attributes of each object (``targets``: ``[(obj, names)]``) this thread
    reads inside the block, however it reads them (``obj.x``, ``getattr``, ``vars(obj)``, through
    another object holding ``obj``): yields one set per target, filled as they are read. Each object
    is an instance of a subclass of its class meanwhile (``__class__`` still answers the class);
    another thread reading it meanwhile reads the same values and is not counted. An object whose
    class cannot be subclassed counts every name as read.

    ``subs`` (one ``{name: value}`` per target) are what this thread reads instead of the object's
    own values, by attribute (``vars(obj)`` still shows the real ones); ``raw`` (a list) gets True
    appended when some read went through ``vars(obj)``/``__dict__`` (it saw the real values)."""
    watches = []
    with _WATCH_LOCK:
        for k, (obj, names) in enumerate(targets):
            w = _Watch(frozenset(names), threading.get_ident(), subs=dict(subs[k]) if subs else {})
            watches.append((obj, w))
            held = _WATCHES.setdefault(id(obj), [])
            if not held:
                try:
                    object.__setattr__(obj, "__class__", _watching_class(type(obj)))
                except Exception:      # a class refusing subclasses (``__init_subclass__``), a fixed layout
                    del _WATCHES[id(obj)]
                    w.read.update(names)
                    w.raw = True
                    continue
            held.append(w)
    try:
        yield [w.read for _, w in watches]
    finally:
        if raw is not None:
            raw.append(any(w.raw for _, w in watches))
        with _WATCH_LOCK:
            for obj, w in watches:
                held = _WATCHES.get(id(obj))
                if held is None or w not in held:
                    continue
                held.remove(w)
                if not held:
                    del _WATCHES[id(obj)]
                    object.__setattr__(obj, "__class__", _BASE[type(obj)])


# ---------------------------------------------------------------- bytecode

@dataclass(frozen=True)
class Chain:
    root: str            # "global", "deref" (a free variable), "fast" (an argument)
    name: str
    steps: tuple         # ("attr", name) or ("item", constant), in load order
    line: int | None


@dataclass(frozen=True)
class Store:
    """An assignment to state that outlives the call (a global, a closure cell, an attribute of an argument)."""
    target: str
    line: int | None


_ROOTS = {"LOAD_GLOBAL": "global", "LOAD_DEREF": "deref", "LOAD_CLASSDEREF": "deref", "LOAD_FAST": "fast"}
_ATTR = ("LOAD_ATTR", "LOAD_METHOD")
# Methods that change a list, dict or set in place: ``HISTORY.append(x)`` writes to ``HISTORY``.
_MUTATORS = frozenset(("attr", m) for m in (
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "__setitem__", "__delitem__", "__iadd__", "__ior__", "difference_update",
    "intersection_update", "symmetric_difference_update"))
_cache: dict = {}      # a true cache: code objects are immutable, so their chains never change


def chains(code) -> tuple:
    """``(chains, stores)`` of one code object (cached)."""
    hit = _cache.get(code)
    if hit is None:
        hit = _cache[code] = _scan(code)
    return hit


def _scan(code, instructions=None):
    n_args = code.co_argcount + code.co_kwonlyargcount
    args, free = set(code.co_varnames[:n_args]), set(code.co_freevars)
    found, stores, cur, line, pending = [], [], None, None, None
    ins_list = _normalized(dis.get_instructions(code) if instructions is None else instructions)
    callee, ended = None, None      # ``cur`` is the first argument of a call of a builtin in _THROUGH
    skip = 0
    for at, ins in enumerate(ins_list):
        line = ins.positions.lineno if getattr(ins, "positions", None) and ins.positions.lineno else line
        if skip:
            skip -= 1
            continue
        op = ins.opname
        sup, skip = _super(cur, code, ins_list, at) if cur is not None else (None, 0)
        if sup is not None:
            cur = sup
            continue
        if callee is not None and cur is not None:
            step, skip = _through(callee, ins_list, at)
            if step is not None:        # ``type(x)``, ``vars(x)``, ``getattr(x, "k"[, d])``, ``hasattr(x, "k")``
                cur, callee = Chain(cur.root, cur.name, cur.steps + (step,), cur.line), None
                continue
            if callee in ("getattr", "hasattr") and op not in _ATTR and not (
                    op == "LOAD_CONST" and at + 1 < len(ins_list) and ins_list[at + 1].opname == "BINARY_SUBSCR"):
                # a name computed at run time (``getattr(self, name)``): any attribute may be the one read
                cur = Chain(cur.root, cur.name, cur.steps + (("any", None),), cur.line)
                callee = None
        if op not in _ATTR + ("LOAD_CONST", "BINARY_SUBSCR"):
            callee = None
        ended = _callee(cur)
        if cur is not None and op in _ATTR:
            cur = Chain(cur.root, cur.name, cur.steps + (("attr", ins.argval),), cur.line)
            continue
        if cur is not None and op == "LOAD_CONST" and isinstance(ins.argval, (str, int)):
            step, skip = _method_read(cur, ins_list, at)
            if step is not None:        # ``x.__getattribute__("k")``, ``x.__dict__.get("k"[, d])``
                cur = Chain(cur.root, cur.name, cur.steps[:-1] + (step,), cur.line)
                continue
            pending = ins.argval
            continue
        if cur is not None and op == "BINARY_SUBSCR" and pending is not None:
            cur, pending = Chain(cur.root, cur.name, cur.steps + (("item", pending),), cur.line), None
            continue
        if op in ("STORE_ATTR", "DELETE_ATTR"):     # ``self.n += 1`` leaves no chain before its store
            stores.append(Store((_text(cur) if cur is not None else "") + "." + ins.argval, line))
        if cur is not None and op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            stores.append(Store(_text(cur) + "[...]", line))
        if cur is not None:
            cur = _ended(cur, op)
            found.append(cur)
            if cur.steps and cur.steps[-1] in _MUTATORS:
                stores.append(Store(_text(cur), line))
        cur, pending = None, None
        root = _ROOTS.get(op)
        if root == "deref" and ins.argval in args:
            # An argument nested code closes over (``self`` read in a comprehension too) is a cell
            # of this frame, loaded with LOAD_DEREF: still the argument.
            root = "fast"
        if root == "deref" and ins.argval not in free or root == "fast" and ins.argval not in args:
            root = None
        if root is not None:
            callee = ended if ended in _THROUGH else None    # the reading function loaded just before this chain
            cur = Chain(root, ins.argval, (), line)
        elif op == "STORE_GLOBAL" or op == "STORE_DEREF" and ins.argval in free:
            stores.append(Store(ins.argval, line))
    if cur is not None:
        found.append(cur)
    return tuple(dict.fromkeys(found)), tuple(stores)


_PAIRS = {"LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"), "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
          "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST")}
_SAME = {"LOAD_FAST_CHECK": "LOAD_FAST", "LOAD_FAST_BORROW": "LOAD_FAST"}


def _normalized(instructions) -> list:
    """Instructions as 3.11 spells them: newer Pythons' paired loads and stores
    (``LOAD_FAST_LOAD_FAST (x, self)``, 3.13) are two instructions, and ``PUSH_NULL`` (which 3.13
    puts between a called function and its arguments) is dropped."""
    out = []
    for ins in instructions:
        if ins.opname == "PUSH_NULL":
            continue
        pair = _PAIRS.get(ins.opname)
        if pair is not None and isinstance(ins.argval, tuple) and len(ins.argval) == 2:
            out += [ins._replace(opname=op, argval=name) for op, name in zip(pair, ins.argval)]
        else:
            out.append(ins._replace(opname=_SAME[ins.opname]) if ins.opname in _SAME else ins)
    return out


def _super(cur, code, ins, at):
    """``(chain, instructions to skip)`` where ``cur`` with ``ins[at:]`` is ``super().k``: ``k`` read in
    every class of the first argument (3.11: a call of ``super``; 3.12: its own instruction)."""
    if ins[at].opname == "LOAD_SUPER_ATTR" and cur.root == "fast" and not cur.steps:
        return Chain(cur.root, cur.name, (("anyclass", ins[at].argval),), cur.line), 0
    if cur.root == "global" and cur.name == "super" and not cur.steps and code.co_argcount:
        end = _call_at(ins, at, 0)
        if end is not False and end + 1 < len(ins) and ins[end + 1].opname in _ATTR:
            return Chain("fast", code.co_varnames[0], (("anyclass", ins[end + 1].argval),), cur.line), end + 1 - at
    return None, 0


def _ended(cur, op) -> Chain:
    """The chain ``cur`` as the instruction ``op`` ends it: iterated (``for v in self.it``: an iterator
    is advanced), or ``x.__getattribute__(name)`` with a name computed at run time (a class's own,
    ``object.__getattribute__``, is a library object where following stops at once)."""
    if op == "GET_ITER":
        return Chain(cur.root, cur.name, cur.steps + (("iter", None),), cur.line)
    if cur.steps and cur.steps[-1] in _GETATTRS:
        return Chain(cur.root, cur.name, cur.steps[:-1] + (("any", None),), cur.line)
    return cur


# Functions whose call with a chain as first argument reads on along it: ``type(x).k`` is
# ``x.__class__.k``, ``vars(x)["k"]`` is ``x.__dict__["k"]``, ``getattr(x, "k")`` and ``hasattr(x, "k")`` read
# ``x.k``, and so do ``object.__getattribute__(x, "k")``, ``nn.Module.__getattr__(x, "k")`` and
# ``inspect.getattr_static(x, "k")`` (each a "getattr" here).
_THROUGH = ("type", "vars", "getattr", "hasattr", "next")
_GETATTRS = frozenset(("attr", n) for n in ("__getattribute__", "__getattr__", "getattr_static"))


def _callee(chain) -> str | None:
    """Which reading function of ``_THROUGH`` the chain just loaded is, if it is one."""
    if chain is None:
        return None
    if chain.steps:
        return "getattr" if chain.steps[-1] in _GETATTRS else None
    return ("getattr" if chain.name == "getattr_static" else chain.name) if chain.root == "global" else None


def _method_read(chain, ins, at):
    """``(step, instructions to skip)`` where the chain's last step is a method that reads an entry named
    by the constant at ``ins[at]`` and is called with it: ``x.__getattribute__("k")`` reads ``x.k``,
    ``d.get("k"[, default])`` reads ``d["k"]`` where ``d`` is a dict (a "get" step)."""
    last = chain.steps[-1] if chain.steps else None
    if last in _GETATTRS and isinstance(ins[at].argval, str):
        end = _call_at(ins, at + 1, 1)
        return (("attr", ins[at].argval), end - at) if end is not False else (None, 0)
    if last == ("attr", "get"):
        end = _call_at(ins, at + 1, 1)
        if end is False and at + 1 < len(ins) and ins[at + 1].opname == "LOAD_CONST":
            end = _call_at(ins, at + 2, 2)
        return (("get", ins[at].argval), end - at) if end is not False else (None, 0)
    return None, 0


def _call_at(ins, k, n):
    """The index of the call of ``n`` arguments that ``ins[k:]`` is (3.11: PRECALL first), else False."""
    if k < len(ins) and ins[k].opname == "PRECALL":
        k += 1
    return k < len(ins) and ins[k].opname == "CALL" and ins[k].argval == n and k


def _through(callee, ins, at):
    """``(step, instructions to skip after this one)`` where ``ins[at:]`` ends the call of ``callee``
    whose first argument was just loaded, else ``(None, 0)``."""
    call = functools.partial(_call_at, ins)
    if callee == "next":        # ``next(x)``, ``next(x, default)``: x advanced
        end = call(at, 1)
        if end is False and ins[at].opname == "LOAD_CONST":
            end = call(at + 1, 2)
        return (("next", None), end - at) if end is not False else (None, 0)
    if callee in ("type", "vars"):
        end = call(at, 1)
        return ((("attr", "__class__" if callee == "type" else "__dict__"), end - at) if end is not False
                else (None, 0))
    if ins[at].opname != "LOAD_CONST" or not isinstance(ins[at].argval, str):
        return None, 0
    end = call(at + 1, 2)
    if end is False and callee == "getattr" and at + 1 < len(ins) and ins[at + 1].opname == "LOAD_CONST":
        end = call(at + 2, 3)   # with a constant default
    return (("attr", ins[at].argval), end - at) if end is not False else (None, 0)


def _text(chain: Chain) -> str:
    return chain.name + "".join(f".{s}" if k == "attr" else f"[{s!r}]" for k, s in chain.steps
                                if k not in ("next", "iter"))


def attr_names(codes) -> set:
    """Every attribute name the given code objects load (for objects reached by value)."""
    names: set = set()
    for code in codes:
        for c in chains(code)[0]:
            names.update(s for k, s in c.steps if k == "attr")
    return names


def store_line(rec: Recording, key) -> str | None:
    """``file:line`` of a recorded code object's assignment to ``key``, for the error message."""
    for f in rec.frames.values():
        for s in chains(f.code)[1]:
            t, k = s.target, str(key)
            if t == k or t.endswith("." + k) or t.startswith((k + ".", k + "[")):
                return f"{f.code.co_filename}:{s.line} in {f.code.co_name}"
    module = sys.modules.get(str(key))
    for f in rec.frames.values():       # a container changed through a local name: where it was loaded
        for c in chains(f.code)[0]:
            if _text(c) == str(key) or c.name == str(key) or module is not None and c.root == "global" \
                    and f.globals is not None and f.globals.get(c.name) is module:     # ``import numpy as np``
                return f"{f.code.co_filename}:{c.line} in {f.code.co_name}"
    return None
