"""What a trace read: every user code object that ran while a call was traced,
with the globals, ``self`` and object arguments it ran with, and the access
chains (``SCALE``, ``self.fc.weight``, ``helpers.act``, ``cfg['lr']``) its
bytecode loads.

``record()`` watches the trace with ``sys.setprofile`` (call events only);
``bytecode.chains(code)`` reads a code object's loads once and caches them. What the
chains resolve to, and the guards on it, is :mod:`aotgrad.guards.state`.
It also copies the Python state the traced code could write (:mod:`.writes`), so
a trace that assigned or changed state outliving the call (``self.calls += 1``,
``HISTORY.append(loss)``) is found, undone and refused: the compiled graph would
not repeat it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import sys
import sysconfig
import threading
import types
from dataclasses import dataclass, field

import torch

from .._torch import CUSTOM_OP_FORWARD, MODULE_CALL_CODES, SWITCH_GETTERS, SWITCH_VALUES
from . import attribution, c_calls
from .bytecode import _text, chains
from .writes import Writes, held_dict
from .. import scoped
from ..scoped import chainable, look_away, restore_profile, take_profile

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NN = os.path.join(_TORCH, "nn", "modules") + os.sep
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = tuple(os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"],
                                                       sysconfig.get_paths()["platstdlib"]})
_CALL_IMPL = MODULE_CALL_CODES

SKIP, USER, NN_METHOD, MODULE_CALL, LIBRARY, STDLIB, HELD = 0, 1, 2, 3, 4, 5, 6
# (STDLIB: the standard library's code, whose reads matter only in a method user code calls on an object
# it holds; HELD: such a frame, its ``self.x`` read as a user method's: ``EVENT.is_set()``, ``len(WEAK)``)
_SWITCH_IDS = {id(f): name for f, name in SWITCH_GETTERS.items()}
_SETPROFILE = sys.setprofile
_RANDOM_PY = random.__file__
_ID, _HASH = id, hash
_CONSTRUCTORS = ("__init__", "__new__", "__post_init__", "__setstate__")
_BUILDING = ("__init__", "__post_init__", "__setstate__")      # their first argument is the object being built
# Library methods whose ``self`` is no object the program holds: a constructor's, a descriptor's (an enum
# member's ``value``, a ``cached_property``: the descriptor is the class's, what it gets is read where it is)
_NOT_HELD = frozenset((*_CONSTRUCTORS, "__get__", "__set__", "__delete__", "__set_name__"))


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
        # globals it runs with; FX's generated graphs and library dataclasses do not. Source the
        # program exec'd with globals of its own (``exec(src, {"torch": torch})``: no ``__name__``,
        # the file ``<string>``) is the user's: its globals are read, in this process alone.
        named = isinstance(module_name, str)
        generated = path.startswith(("<eval_with_key", "<aotgrad")) or not named and path != "<string>" \
            or named and module_name.startswith("namedtuple_")      # torch's eval'd lambdas, namedtuple's __new__
        return SKIP if generated or named and is_library(module_name) else USER
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
    return STDLIB if path.startswith(_STDLIB) else USER


def imported_name(name: str, g) -> str | None:
    """The absolute name of a module code whose globals are ``g`` imports as ``name`` (a relative import's
    led by dots, resolved against the code's package), None where it cannot be."""
    if not name.startswith("."):
        return name
    package = g.get("__package__") if isinstance(g, dict) else None
    try:
        return importlib.util.resolve_name(name, package) if isinstance(package, str) else None
    except (ImportError, ValueError):
        return None


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
    ran: set | None = None      # when a set, the code objects run get added (a block's template trace)
    held: set = field(default_factory=set)      # code of the HELD frames recorded (library methods on user objects)
    switches: dict = field(default_factory=dict)    # torch switch read -> (its getter, the value the trace saw)
    reflected: list = field(default_factory=list)   # (C function, code, line, why): answers no guard can check
    returned: list = field(default_factory=list)    # modules and stateful objects library calls returned to user code
    twins: list = field(default_factory=list)       # (block, its proof's reads, its frames): ``Resolver.resolve``
    process_local: list = field(default_factory=list)   # (C function, code, line): ``id()``/``hash()`` answers (c_calls)
    custom_ops: list = field(default_factory=list)  # (op, what holds its autograd formula, user line): ran
    stopped: bool = False       # the traced function returned and the recording stopped (``stop``)
    last_c: tuple | None = None     # (C function, code, line) of the last C call seen
    replaced: tuple | None = None   # the same, of the call that replaced this recording's profile function

    def event(self, frame, event, arg):
        if event != "call":
            if event == "return":
                if self.watch is not None:
                    self.watch.returned(frame)
                if frame is self.root_frame:
                    self.stop()
                elif self.writes.memoized and frame.f_code in self.writes.memoized:
                    self.writes.memoizes(frame.f_code, arg)
                if type(arg) not in _PLAIN and frame.f_back is not None and self.kinds.get(frame.f_back.f_code) == USER \
                        and (type(arg) is types.ModuleType and self.kinds.get(frame.f_code, SKIP) in (SKIP, STDLIB)
                             or self.kinds.get(frame.f_code) in (STDLIB, LIBRARY) and holds_state(arg)
                             and arg not in self.writes.built):
                    # a module, or a stateful object, a library call handed user code (``importlib.import_module(
                    # name)``, ``logging.getLogger(name)``): what the code then loads from it is read
                    self.returned.append(arg)
            elif event == "c_call":
                self._c_call(frame, arg)
            elif event == "c_return" and self.watch is not None:
                self.watch.c_return(arg)
            return
        code = frame.f_code
        if code is CUSTOM_OP_FORWARD:
            self._custom_op(frame)
        if self.watch is not None:
            self.watch.ran.add(code)
        if self.ran is not None:
            self.ran.add(code)
        kind = self.kinds.get(code)
        if kind is None:
            kind = self.kinds[code] = kind_of(code, frame.f_globals.get("__name__"))
        if kind:
            if self.root_frame is None and (code is self.root or kind == MODULE_CALL
                                            and frame.f_locals.get("self") is self.root):
                self.root_frame = frame
            self._add(frame, code, kind)

    def _c_call(self, frame, fn):
        """A C function called while recording: a torch switch's getter is a read of the switch (from
        any frame: ``torch.backends.cudnn.benchmark`` calls it from torch's Python); ``eval``/``exec``
        from user code run text whose reads no guard can follow."""
        self.last_c = (fn, frame.f_code, frame.f_lineno)
        self.c_event(fn, frame)
        if self.watch is not None:
            self.watch.c_call(fn, frame.f_code)

    def c_event(self, fn, frame):
        """A C call the trace (or the joint's recorded backward) made: one that replaces the profile
        function is noted; a switch's getter read; any other's answer classified (``c_answer``)."""
        if self.replaced is None and _replaces_profile(fn, frame):
            self.replaced = (fn, frame.f_code, frame.f_lineno)
        if not self.switch_read(fn):
            self.c_answer(fn, frame)

    def c_answer(self, fn, frame):
        """What a C call's answer depends on (:mod:`.c_calls`), where user code made it: a getter of
        process state is read as a switch is; one no guard can check is refused (``reflected``); a
        draw from a ``random.Random`` of the program's own puts its state among the streams undone."""
        if (gen := c_calls.generator_call(fn)) is not None:
            return self._generator_call(fn, gen, frame)
        at = self._user_call_site(frame)
        if at is not None:
            if (fn is _ID or fn is _HASH) and at is frame:  # this process's answer (an address, a string's
                self.process_local.append((fn, at.f_code, at.f_lineno))     # seeded hash); deepcopy's memo is not
            why = c_calls.verdict(fn)
            if why == c_calls.GETTER:
                # (asked by the standard library, it is its bookkeeping: a lock's owner, ``current_thread()``'s key)
                name = c_calls.getter_name(fn) if at is frame else None
                if name is not None and name not in self.switches:
                    try:
                        self.switches[name] = (fn, fn())
                    except Exception:       # (``os.getcwd()`` of a removed directory): the call raises it too
                        pass
            elif why is not None:
                self.reflected.append((fn, at.f_code, at.f_lineno, why))
        stream = c_calls.draws_from(fn)
        if stream is not None:
            while frame is not None and frame.f_code.co_filename == _RANDOM_PY:     # (``rng.randint``'s own steps)
                frame = frame.f_back
            if frame is not None and self.kinds.get(frame.f_code) == USER:  # (sympy shuffles with its own)
                self.writes.own_stream(stream, self.watch, f"{frame.f_code.co_filename}:{frame.f_lineno} in "
                                                           f"{frame.f_code.co_name}")

    def _generator_call(self, fn, verdict, frame):
        """A ``torch.Generator``'s method the program called, itself or through torch's Python
        (``torch.initial_seed()``): its seed is guarded as a getter, anything else refused
        (:func:`.c_calls.generator_call`). aotgrad's own calls, and torch's RNG-state functions it
        replays (``c_calls.REPLAYED``), are not the program's."""
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
            if frame.f_code in c_calls.REPLAYED:
                return
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith(_OURS):
            return
        if isinstance(verdict, str):
            self.reflected.append((fn, frame.f_code, frame.f_lineno, verdict))
            self.writes.torch_stream(fn.__self__)
        elif verdict[0] not in self.switches:
            self.switches[verdict[0]] = (verdict[1], fn())

    def _custom_op(self, frame):
        """A custom op's autograd formula ran: the joint graph holds what it computed (``Resolver._custom_ops``)."""
        names = frame.f_locals
        back = frame.f_back
        while back is not None and self.kinds.get(back.f_code) != USER:
            back = back.f_back
        line = None if back is None else f"{back.f_code.co_filename}:{back.f_lineno} in {back.f_code.co_name}"
        self.custom_ops.append((names.get("op"), names.get("info"), line))

    def _user_call_site(self, frame):
        """The user frame a C call made from ``frame`` answers to: ``frame`` itself where it is user code,
        its caller where it is a standard-library function user code called (``os.path.exists`` asks
        ``os.stat``, ``uuid.uuid4`` asks ``os.urandom``: refused); None for library code deeper down (a
        ``LogRecord`` reading the clock for ``LOG.info``: an answer no program computes with). A getter of
        process state the standard library asks (the thread's ident) is its bookkeeping, not guarded."""
        kind = self.kinds.get(frame.f_code)
        if kind == USER:
            return frame
        if not (kind == STDLIB or _frozen_stdlib(frame.f_code)):
            return None
        back = frame.f_back
        # up through the standard library's file-system layers (``Path.exists`` asks ``Path.stat``,
        # which asks ``os.stat``): the file system's answer, which the user's code computes with
        while back is not None and _in_file_system(frame) and _in_file_system(back):
            frame, back = back, back.f_back
        return back if back is not None and self.kinds.get(back.f_code) == USER else None

    def switch_read(self, fn) -> bool:
        """Note a call of ``fn`` if it is one of torch's switch getters (the value it reads now)."""
        name = _SWITCH_IDS.get(id(fn))
        if name is None or SWITCH_GETTERS.get(fn) != name:
            return False
        if name not in self.switches:
            read = SWITCH_VALUES.get(name, fn)
            self.switches[name] = (read, read())
        return True

    def _add(self, frame, code, kind):
        if kind == STDLIB:
            if code.co_name in _BUILDING and code.co_argcount:      # (an object made in the trace is not held)
                self.writes.built.add(frame.f_locals.get(code.co_varnames[0]))
            elif self._held_method(frame, code):
                obj = frame.f_locals.get("self")
                if holds_state(obj) and obj not in self.writes.built:
                    self.frames.setdefault((code, None, id(obj), ()), Frame(code, HELD, None, obj))
                    self.held.add(code)
            return
        f_locals = frame.f_locals
        n_args = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:n_args]
        # The object a constructor builds is its first argument, whatever its name (``def __init__(s)``).
        self_obj = f_locals.get(names[0]) if names[:1] == ("self",) or names and code.co_name in _BUILDING \
            else None
        if kind == LIBRARY:
            g = frame.f_globals
            if code.co_name in _BUILDING and self_obj is not None:
                self.writes.built.add(self_obj)
            if not isinstance(self_obj, torch.nn.Module):
                self_obj = self_obj if self._held_method(frame, code) and holds_state(self_obj) \
                    and self_obj not in self.writes.built else None
            self.frames.setdefault((code, id(g), id(self_obj), ()), Frame(code, kind, g, self_obj))
            return
        if kind != USER:
            if not isinstance(self_obj, torch.nn.Module):
                return
            if kind == MODULE_CALL:     # a module being called is the user's (methods may build new ones)
                self.writes.attrs(self_obj)
                self.writes.module_hooks(self_obj)
            # (a torch module's method loads functions from its module: ``F.linear``, read by identity)
            g = frame.f_globals if kind == NN_METHOD else None
            self.frames.setdefault((code, None, id(self_obj), ()), Frame(code, kind, g, self_obj))
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
        free = seen[len(seen) - len(code.co_freevars):] if code.co_freevars else ()
        held = tuple(v for n, v in free if isinstance(v, _CONTAINERS))
        # A container closed over from outside the call (a custom op's fake kernel's settings, which
        # nothing the traced function reaches leads to) is state its loads read, as an object's is.
        args.update((n, v) for n, v in free if type(v) in (dict, list) and not _defined_in_trace(frame, n))
        self.frames[key] = Frame(code, kind, g, self_obj, args, held)
        if code.co_name in _CONSTRUCTORS:   # an object being built is not state from before the call
            if self_obj is not None:
                self.writes.built.add(self_obj)
            return
        self._writable(frame, code, f_locals, g)

    def _held_method(self, frame, code) -> bool:
        """Whether ``frame`` runs a library method (not a constructor) that user code called directly on
        an object (a property's getter too), or that such a method called on the same object (``Queue.qsize``
        asks ``self._qsize()``): what it reads of ``self`` is the user's object's state."""
        back = frame.f_back
        if back is None or not code.co_argcount or code.co_varnames[0] != "self" or code.co_name in _NOT_HELD:
            return False
        return self.kinds.get(back.f_code) == USER or back.f_code in self.held \
            and back.f_locals.get("self") is frame.f_locals.get("self")

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
            v = g.get(c.name, _GONE) if c.root == "global" else \
                sys.modules.get(imported_name(c.name, g), _GONE) if c.root == "import" else f_locals.get(c.name, _GONE)
            if v is not _GONE:
                w.chain(v, c.steps, c.name, argument=c.root == "fast")
        assigned = [s.target for s in stores if s.target in code.co_freevars]
        outer = [n for n in assigned if not _defined_in_trace(frame, n)]
        if outer:
            w.cells(code, outer)

    def undo_writes(self) -> list:
        """Put back every change the traced code made to state that outlives the call; ``(text, key)`` each."""
        self.root_frame = None      # its locals are the call's own state, not the user's
        for f in (*self.frames.values(), *(f for _, _, rest in self.twins for f in rest)):
            f.containers = ()       # a local list held here would look like lasting state
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


_FILE_SYSTEM = frozenset(("pathlib", "os", "posixpath", "ntpath", "genericpath", "glob", "fnmatch", "shutil"))


def _in_file_system(frame) -> bool:
    """Whether ``frame`` runs one of the standard library's file-system modules."""
    return str(frame.f_globals.get("__name__")).partition(".")[0] in _FILE_SYSTEM


def _frozen_stdlib(code) -> bool:
    """Standard-library code Python froze into itself (``os``, ``genericpath``, ``_collections_abc``), the
    import system's aside (an ``import`` inside the function runs it for the user's line)."""
    name = code.co_filename
    return name.startswith("<frozen ") and not name.startswith(("<frozen importlib", "<frozen zipimport"))


def holds_state(obj) -> bool:
    """An object whose own attributes hold state (not a class, module, tensor or torch module, which
    are read elsewhere): a ``threading.Event``, a logger, a ``WeakValueDictionary``, a config."""
    t = type(obj)       # (by its type alone: no attribute of the object runs its class's code in a profile event)
    return t.__dictoffset__ != 0 and t not in _PLAIN and obj is not None \
        and not issubclass(t, (type, types.ModuleType, torch.Tensor, torch.nn.Module))


@contextlib.contextmanager
def record(fn=None):
    """Record the code that runs inside the block (this thread) until the first call of ``fn``
    returns: capture runs ``fn`` once per trace, the same Python each time, and profiling
    costs every trace it watches about as much again. An existing profiler keeps running."""
    root = getattr(getattr(fn, "func", fn), "__code__", None) if not isinstance(fn, torch.nn.Module) else fn
    # Where other Python threads are alive, a write may be theirs: the capture's thread is watched.
    watch = attribution.Watch(None, is_library) if threading.active_count() > 1 else None
    rec = Recording(root=root, watch=watch)
    if watch is not None:
        # user code as the recording saw it, with its module's name (code made by exec in a notebook
        # or a test has no file to tell by); code it never saw, by its file
        kinds = rec.kinds
        watch.is_user = lambda code: (kinds[code] if code in kinds else kind_of(code, None)) == USER
    saved = take_profile()
    previous = chainable(saved)
    event = rec.event
    if previous is not None:
        def event(frame, what, arg):
            rec.event(frame, what, arg)
            previous(frame, what, arg)
    if rec.watch is not None:       # this thread is watched while user code runs, not only while recording
        rec.watch.rec = rec
        rec.light = rec.watch.profile(previous)

    def stop():
        rec.stopped = True
        restore_profile(saved)
    rec.stop = stop
    rec.restart = lambda: (setattr(rec, "root_frame", None), sys.setprofile(event))
    outer = getattr(_ACTIVE, "rec", None)
    _ACTIVE.rec = rec
    sys.setprofile(event)
    try:
        with scoped.watched(saved):
            yield rec
    finally:
        if not rec.stopped and rec.replaced is None and sys.getprofile() is not event:
            # The traced code replaced the recording's profile function by C code (a profiler's enable()):
            # the last C call it saw did.
            rec.replaced = rec.last_c or (None, None, None)
        restore_profile(saved)
        _ACTIVE.rec = outer
        # Cycles only the collector would free (the recording's frames and copies, hundreds of objects a
        # layer): the stop and restart closures hold the recording, and so does the watch its ``light`` holds.
        rec.stop = rec.restart = None
        if rec.watch is not None:
            rec.watch.rec = None


def _replaces_profile(fn, frame) -> bool:
    """Whether the C call of ``fn`` from ``frame`` replaces this thread's profile function, through which
    capture records what the trace reads: ``sys.setprofile`` called by code not aotgrad's own."""
    return fn is _SETPROFILE and not frame.f_code.co_filename.startswith(_OURS)


_ACTIVE = threading.local()     # the recording whose block this thread is in


def thread_watch():
    """The :class:`.attribution.Watch` of the capture this thread is in (other threads were alive when it
    started), or None."""
    rec = getattr(_ACTIVE, "rec", None)
    return rec.watch if rec is not None else None


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
    with _profiled(light):
        yield


@contextlib.contextmanager
def _profiled(event):
    """``event`` is this thread's profile function inside the block."""
    saved = take_profile()
    sys.setprofile(event)
    try:
        yield
    finally:
        restore_profile(saved)


@contextlib.contextmanager
def backward_code(runs_user_code: bool):
    """The joint's backward runs code the forward's recording never saw (a custom Function's
    ``backward``, a module's backward hooks, a saved-tensor hook's unpack: ``runs_user_code``, which
    the caller finds in the autograd graph): what its user and library frames read and write is
    recorded too, until the block ends (the traced function returned long ago, so the recording had
    stopped). A backward of torch's own formulas alone runs none: it is not watched."""
    rec = getattr(_ACTIVE, "rec", None)
    if rec is None or rec.restart is None or not runs_user_code:
        yield
        return
    kinds, add = rec.kinds, rec._add

    def event(frame, what, arg):        # calls only: this thread's profile sees every op's Python too
        if what == "call":
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = kind_of(code, frame.f_globals.get("__name__"))
            if kind:
                add(frame, code, kind)
        elif what == "c_call":
            rec.c_event(arg, frame)
        if previous is not None:
            previous(frame, what, arg)
    event.between_user_code = True      # ops pause it (capture.session): no user code runs in them
    previous = chainable(take_profile())
    with _profiled(event):
        yield
        if sys.getprofile() is not event:       # replaced in C (a profiler's enable() in a custom backward)
            rec.replaced = rec.replaced or (None, None, None)


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
def switches_only(watch):
    """An ATen operator is dispatched inside the block, ``watch`` being this thread's profile function:
    where that is a recording's alone (no other profiler chained, no other thread's writes to tell
    apart), a C profile function watches the block, noting only calls of torch's switch getters (a
    decomposition reading ``torch._C._get_mkldnn_enabled()``), which the recording then reads. No user
    code runs in an ATen op's dispatch; torch's Python there ran a Python event a call (a fifth of a
    block template's metadata pass)."""
    rec = getattr(watch, "__self__", None)
    if _watch_switches is None or type(rec) is not Recording or rec.watch is not None:
        yield
        return
    state = SwitchWatch((_GETTERS, []))
    _watch_switches(state)
    try:
        yield
    finally:
        sys.setprofile(watch)
        for fn in state[1]:
            rec.switch_read(fn)


class SwitchWatch(tuple):
    """``(getters, found)``: the state of the C profile function ``switches_only`` sets, which is what
    ``sys.getprofile()`` returns while it watches. Code that saves this thread's profile function and
    puts it back (``runtime.modes`` reading the settings unseen, inside an op) puts this back with
    ``sys.setprofile``: called as a Python profile function, it notes the same calls."""
    __slots__ = ()

    def __call__(self, frame, event, arg):
        if event == "c_call":
            try:
                if arg in self[0]:
                    self[1].append(arg)
            except TypeError:       # an unhashable callable: not a getter
                pass


try:
    from ._tags import CProfile, take_profile as _take_profile, watch_switches as _watch_switches
    scoped.C_PROFILER = (_take_profile, CProfile)
except ImportError:     # not built: the recording watches ops' Python as any other
    _watch_switches = None
_GETTERS = frozenset(SWITCH_GETTERS)


@contextlib.contextmanager
def paused():
    """A recording watching this thread stops inside the block: for library work no user code
    runs in (wrapping inputs, a block call's kernel), where watching only costs. Another
    profiler (a user's) keeps running (:func:`..scoped.look_away`)."""
    if watching() is None:
        yield
        return
    with look_away():
        yield


# ---------------------------------------------------------------- attribute reads of given objects

@dataclass(eq=False)
class _Watch:
    names: frozenset
    thread: int
    read: set = field(default_factory=set)
    subs: dict = field(default_factory=dict)    # name -> the value the watching thread reads instead
    raw: bool = False                           # the instance's __dict__ was read (its real values)


_WATCHES: dict = {}         # id(object) -> [_Watch]
_WATCH_LOCK = threading.Lock()
_WATCHED_CLASSES: dict = {}  # class -> [watched instances of it, its own __getattribute__ or _GONE]
_MODULE_OWN = frozenset(f.__code__ for f in (torch.nn.Module.__getattr__, torch.nn.Module.__setattr__,
                                              torch.nn.Module.__delattr__))


def _watching_getattribute(get):
    """A ``__getattribute__`` (``get`` the one it stands in for) that notes, for a watched instance
    and its watching thread alone, each watched name read, and every name when the instance's
    ``__dict__`` is read (``vars(self)``) by code other than ``nn.Module``'s own attribute plumbing
    or aotgrad's; every other read, in any thread, is ``get``'s."""
    def __getattribute__(self, name):
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
    __getattribute__.aotgrad_watch = True
    return __getattribute__


def _watch_class(cls: type) -> bool:
    """``cls`` reads its instances' attributes through :func:`_watching_getattribute` until the last
    watch of one of them ends (its ``__getattribute__`` is put back then). The class stays the
    class: ``type(obj)``, ``copy.deepcopy`` and pickling see nothing. False where the class refuses
    the assignment (a C type)."""
    held = _WATCHED_CLASSES.get(cls)
    if held is None:
        own = cls.__dict__.get("__getattribute__", _GONE)
        try:
            cls.__getattribute__ = _watching_getattribute(cls.__getattribute__)
        except (TypeError, AttributeError):
            return False
        held = _WATCHED_CLASSES[cls] = [0, own]
    held[0] += 1
    return True


def _unwatch_class(cls: type) -> None:
    held = _WATCHED_CLASSES[cls]
    held[0] -= 1
    if held[0]:
        return
    del _WATCHED_CLASSES[cls]
    if held[1] is _GONE:
        del cls.__getattribute__
    else:
        cls.__getattribute__ = held[1]


@contextlib.contextmanager
def attribute_reads(targets, subs=None, raw=None):
    """Which of the named attributes of each object (``targets``: ``[(obj, names)]``) this thread
    reads inside the block, however it reads them (``obj.x``, ``getattr``, ``vars(obj)``, through
    another object holding ``obj``): yields one set per target, filled as they are read. Meanwhile
    the object's class reads attributes through a watching ``__getattribute__`` that passes every
    other object's and every other thread's reads straight through: the object keeps its class
    (``type(obj)``, a ``deepcopy`` or a ``torch.save`` taken meanwhile see it) and its values. An
    object whose class cannot take one (a C type) counts every name as read.

    ``subs`` (one ``{name: value}`` per target) are what this thread reads instead of the object's
    own values, by attribute (``vars(obj)`` still shows the real ones); ``raw`` (a list) gets True
    appended when some read went through ``vars(obj)``/``__dict__`` (it saw the real values)."""
    watches = []
    with _WATCH_LOCK:
        for k, (obj, names) in enumerate(targets):
            w = _Watch(frozenset(names), threading.get_ident(), subs=dict(subs[k]) if subs else {})
            if not _watch_class(type(obj)):
                w.read.update(names)
                w.raw = True
                watches.append((obj, w, None))
                continue
            watches.append((obj, w, type(obj)))
            _WATCHES.setdefault(id(obj), []).append(w)
    try:
        yield [w.read for _, w, _ in watches]
    finally:
        if raw is not None:
            raw.append(any(w.raw for _, w, _ in watches))
        with _WATCH_LOCK:
            for obj, w, cls in watches:
                if cls is None:
                    continue
                held = _WATCHES[id(obj)]
                held.remove(w)
                if not held:
                    del _WATCHES[id(obj)]
                _unwatch_class(cls)


def watched(obj) -> bool:
    """Whether some thread watches ``obj``'s attribute reads now (:func:`attribute_reads`)."""
    return id(obj) in _WATCHES


def _registers_hook(chain) -> bool:
    """``m.register_forward_hook`` and the like: where a hook is registered (``key`` ``"register"``)."""
    last = chain.steps[-1] if chain.steps else (None, "")
    return last[0] == "attr" and str(last[1]).startswith("register_") and "hook" in str(last[1])


def store_line(rec: Recording, key) -> str | None:
    """``file:line`` of a recorded code object's assignment to ``key``, for the error message."""
    if key in rec.writes.lines:
        return rec.writes.lines[key]
    for f in rec.frames.values():
        for s in chains(f.code)[1]:
            t, k = s.target, str(key)
            if t == k or t.endswith("." + k) or t.startswith((k + ".", k + "[")):
                return f"{f.code.co_filename}:{s.line} in {f.code.co_name}"
    module = sys.modules.get(str(key))
    # a container changed through a local name: where it was loaded (one held in another, ``rows[...]``:
    # where the outer one was)
    loaded = str(key).split("[...]", 1)[0]
    for f in rec.frames.values():
        for c in chains(f.code)[0]:
            if _text(c) == loaded or c.name == loaded or loaded == "register" and _registers_hook(c) \
                    or module is not None and c.root == "global" \
                    and f.globals is not None and f.globals.get(c.name) is module:     # ``import numpy as np``
                return f"{f.code.co_filename}:{c.line} in {f.code.co_name}"
    return None
