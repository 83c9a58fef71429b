"""C functions the traced user code calls, by what their answer depends on.

The read recording sees a C call by its function alone (the profile's ``c_call`` carries no
arguments and no result), and nothing of what the C code reads inside. So a C function called from
user code is let through only where its answer is known to depend on its arguments alone, which the
trace's other reads already guard (``len``, ``math.sqrt``, a ``dict``'s ``get``, a ``str``'s
``join``, torch's ops and functions): one kind of answer per function, by the module of the
function (or of the class that defines the method):

* a known getter of process state that takes no arguments (``gc.get_threshold``,
  ``sys.getrecursionlimit``, ``os.getcwd``, ``threading.get_ident``): guarded by calling it again
  on every call, as torch's switches are;
* anything else (a module or class not on the list: ``random.Random``'s draws, a file's ``read``,
  ``queue.SimpleQueue.get``, ``time.strftime``, a C extension's own functions): refused at capture,
  naming the call and the user's line. Its answer is not something a guard can check.

C does more than its calls show: a C type's constructor and operators, and its attributes and items,
run with no profile event. So a C type of a module not on the list, loaded by user code, is refused
as its functions are (``decimal.Decimal``: its arithmetic reads the thread's decimal context); and so
is a read C answers from an object the guards hold by identity alone (:func:`state_read`: a
``ctypes.c_double``'s ``value``). (A memoryview is read by its bytes, as a ``bytearray``: ``state.freeze``.)

torch's own C functions are on the list: torch's process-wide state is read through its switches and
modes (:mod:`..runtime.modes`), its ops are traced. Draws from a ``random.Random`` of the program's
own are refused where its methods run too (``rng.randint`` is Python calling ``getrandbits``):
:func:`draws_from`.
"""
from __future__ import annotations

import _random
import _thread
import datetime
import gc
import os
import random
import sys
import types
import weakref

import torch

# Modules (top-level names) whose C functions answer from their arguments alone.
_PURE = frozenset((
    "builtins", "math", "cmath", "_operator", "operator", "itertools", "_functools", "functools", "_collections",
    "collections", "_bisect", "bisect", "_heapq", "heapq", "_struct", "struct", "_json", "json", "_string", "string",
    "_sre", "re", "_abc", "abc", "_weakref", "weakref", "_codecs", "codecs", "binascii", "zlib", "_hashlib",
    "hashlib", "_sha1", "_sha2", "_sha256", "_sha512", "_sha3", "_md5", "_blake2", "unicodedata",
    "_contextvars", "contextvars", "_typing", "typing", "array", "_warnings", "warnings",
    "_stat", "types", "enum", "dataclasses", "copy", "fractions", "numbers", "torch", "numpy", "aotgrad",
))
# Functions and methods of other modules that answer from their arguments alone, or whose answer is
# no value a program computes with (``time.sleep``, ``gc.collect``, a stream's ``write``: as ``print``).
_PURE_FUNCTIONS = frozenset(("sys.getsizeof", "sys.intern", "sys.exc_info", "sys.exception", "sys._getframe",
                             "sys.is_finalizing", "sys.audit", "posix.fspath", "nt.fspath", "time.sleep", "_thread.allocate_lock",
                             "_thread.RLock", "_thread.start_new_thread", "_thread.start_joinable_thread", "gc.collect",
                             "gc.enable", "gc.disable"))
_PURE_METHODS = {"_io": frozenset(("write", "writelines", "flush")),     # a stream's (``sys.stdout.write``)
                 # a lock held for a block (``with self.mutex:`` in ``Queue.qsize``): it waits, and answers nothing
                 "_thread": frozenset(("__enter__", "__exit__", "release"))}
# Getters of process state, called with no arguments: guarded by their answer on every call.
GETTERS = {f"{getattr(f, '__module__', None) or m.__name__}.{f.__name__}": f for m, f in (
    (gc, gc.get_threshold), (gc, gc.isenabled), (sys, sys.getrecursionlimit), (sys, sys.getswitchinterval),
    (sys, sys.getdefaultencoding), (sys, sys.getfilesystemencoding), (os, os.getcwd), (os, os.getpid),
    (os, os.getppid), (os, os.cpu_count), (_thread, _thread.get_ident), (_thread, _thread.get_native_id),
)}
# A torch.Generator's seed, read through torch's Python too (``torch.initial_seed()``): guarded as a getter;
# any other method of a generator reads or sets its stream, which no guard sees and no graph replays.
GETTERS["torch.default_generator.initial_seed"] = torch.default_generator.initial_seed
_GENERATOR_GETTERS = frozenset(("initial_seed",))
_GENERATOR_STATE = "it reads or sets a torch.Generator's stream, which the compiled graph neither holds nor " \
    "replays (its draws would run on from where the trace left the generator); seed or restore the generator " \
    "outside the compiled function (the default generator's state saved and restored inside it, with " \
    "`torch.get_rng_state`/`set_rng_state` or `torch.random.fork_rng`, is replayed)"
_GETTER_IDS = {id(f): name for name, f in GETTERS.items()}
# torch's functions whose calls of the default generators' methods aotgrad replays (``passes.rng_positions``,
# ``tracing.patches``: the seeds the code sets, the states it saves and restores)
REPLAYED = frozenset(f.__code__ for m in (torch.random, getattr(torch.cuda, "random", None)) if m is not None
                     for f in vars(m).values() if isinstance(f, types.FunctionType)
                     and f.__name__ in ("manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state",
                                        "get_rng_state_all", "set_rng_state_all"))
_UNSET = object()
_EVALUATED = "the text it evaluates reads Python state that aotgrad cannot check on later calls"
_BUILTINS_READING = {"eval": _EVALUATED, "exec": _EVALUATED, "input": "it reads the program's standard input"}
_CLOCKS = "its answer changes from call to call and the compiled graph would hold the first one"

GETTER = "getter"
_verdicts = weakref.WeakKeyDictionary()     # module or class -> {name: verdict}


def verdict(fn) -> str | None:
    """What the answer of a C call of ``fn`` by user code depends on: None (its arguments: let
    through), :data:`GETTER` (process state :data:`GETTERS` reads again), else why it is refused."""
    owner = _owner(fn)
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return None
    if owner is None:       # (bound to nothing: rare, not cached)
        return _of_function(fn, None, name)
    free = isinstance(owner, types.ModuleType)
    key = owner if free or isinstance(owner, type) else type(owner)
    known = _verdicts.get(key)
    if known is None:
        known = _verdicts[key] = {}
    hit = known.get(name, _UNSET)
    if hit is _UNSET:
        hit = known[name] = _of_function(fn, owner, name) if free else \
            _of_method(next((c for c in key.__mro__ if name in vars(c)), key), name)
    return hit


def _owner(fn):
    """What ``fn`` is bound to: a module, a class, an object; the class of an unbound method
    (``str.join(...)``); None."""
    owner = getattr(fn, "__self__", None)
    return getattr(fn, "__objclass__", None) if owner is None else owner


def _module_of(fn, owner) -> str:
    """The module a C function bound to a module (or to nothing) belongs to."""
    return getattr(owner, "__name__", None) or getattr(fn, "__module__", None) or "builtins"


def _of_function(fn, owner, name):
    if id(fn) in _GETTER_IDS:
        return GETTER
    module = _module_of(fn, owner)
    if module == "builtins" and name in _BUILTINS_READING:
        return _BUILTINS_READING[name]
    if module.split(".")[0] in _PURE or f"{module}.{name}" in _PURE_FUNCTIONS:
        return None
    if module == "time":
        return _CLOCKS
    if isinstance(fn, type):
        return "a C type: making its objects and computing with them (its operators, its attributes) runs in C, " \
            "where no guard sees what it reads (`decimal`'s arithmetic reads the thread's decimal context)"
    return "its answer comes from state outside its arguments that aotgrad cannot see or check on later calls"


def _of_method(cls, name):
    module = getattr(cls, "__module__", None) or "builtins"
    if issubclass(cls, _random.Random):
        return None     # (draws_from: a stream of the program's own, refused where any code draws)
    if module.split(".")[0] in _PURE or name in _PURE_METHODS.get(module, ()):
        return None
    return f"`{module}.{cls.__qualname__}.{name}` answers from the object's state inside C, which aotgrad cannot " \
        "see or check on later calls"


_PYTHON = (types.FunctionType, classmethod, staticmethod, property)


def c_type(v) -> bool:
    """Whether ``v`` is a class C implements: no Python function in it or its bases, so making its
    objects and computing with them runs C code alone (no profile event shows a type's call)."""
    return isinstance(v, type) and not any(isinstance(x, _PYTHON) for c in v.__mro__ for x in vars(c).values())


# C types whose objects never change: a field read off one is its value for good (its methods may read
# process state, ``datetime.timestamp()`` the time zone: their calls are classified as any C call's).
_IMMUTABLE = (datetime.date, datetime.time, datetime.timedelta, datetime.timezone)


def state_read(obj, kind, key) -> str | None:
    """Why ``obj.key`` (``kind`` "attr") or ``obj[key]`` ("item"), read by user code from an object the guards
    hold by identity alone, is refused: C answers it from the object's own state (a C type's attribute,
    method or item: ``ctypes.c_double(...).value``), as its method's call would be (:func:`_of_method`).
    None where Python code answers, which is recorded."""
    name = "__getitem__" if kind == "item" else key
    cls = next((c for c in type(obj).__mro__ if isinstance(name, str) and name in vars(c)), None)
    found = vars(cls)[name] if cls is not None and name not in ("__dict__", "__weakref__") else None
    if found is None or isinstance(found, _PYTHON) or not c_type(type(found)) or not hasattr(found, "__get__") \
            or isinstance(found, types.MemberDescriptorType) and "__slots__" in vars(cls) \
            or isinstance(obj, _IMMUTABLE) and isinstance(found, (types.GetSetDescriptorType, types.MemberDescriptorType)):
        return None     # (a value; Python code; a Python class's slot, read through the object; a field of a value)
    return _of_method(cls, name)


def generator_call(fn):
    """For a method of a ``torch.Generator`` (``g.manual_seed``, ``torch.initial_seed()``'s call of the
    default generator's): ``(name, getter)`` of its seed, guarded as a getter, or why it is refused;
    None for any other function."""
    gen = getattr(fn, "__self__", None)
    if not isinstance(gen, torch.Generator):
        return None
    if fn.__name__ not in _GENERATOR_GETTERS:
        return _GENERATOR_STATE
    name = "torch.default_generator" if gen is torch.default_generator else f"<torch.Generator at {id(gen):#x}>"
    return f"{name}.{fn.__name__}", getattr(gen, fn.__name__)


def getter_name(fn) -> str | None:
    return _GETTER_IDS.get(id(fn))


def draws_from(fn):
    """The ``random.Random`` of the program's own that a C call of ``fn`` draws from (its C
    methods: ``random``, ``getrandbits``, ``seed``...), or None. Python's global stream
    (``random.random()``) is another's (:mod:`.writes`, by its state)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, random.Random) and owner is not random._inst:
        return owner
    return None


def named(fn) -> str:
    """How a refusal names ``fn``: ``module.function`` or ``module.Class.method``."""
    owner = _owner(fn)
    if owner is None or isinstance(owner, types.ModuleType):
        return f"{_module_of(fn, owner)}.{fn.__name__}"
    cls = owner if isinstance(owner, type) else type(owner)
    return f"{cls.__module__}.{cls.__qualname__}.{fn.__name__}"
