"""C functions the traced code calls (``aotgrad.guards.c_calls``): the recording sees a C call by its
function alone, never what the C code reads. Each is let through where its answer depends on its
arguments alone (compared with eager, staged and jit), guarded where it is a getter of process state
(changing that state recompiles under jit, fails the staged step's check), refused at capture
otherwise, naming the call and the user's line and leaving the program's state as it was. Every
guarded or refused case gave a stale graph before (no error)."""
import decimal
import gc
import os
import random
import re
import sys
import threading

import pytest
import torch

import aotgrad
from aotgrad import errors
from tests.guards.test_read_channels import _check, _module

X = torch.tensor([1.0, -2.0])


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "0")


# getter: (the program's read, the change, how the change is undone)
GETTERS = {
    "gc.get_threshold": ("gc.get_threshold()[0] % 7", lambda: gc.set_threshold(gc.get_threshold()[0] + 1),
                         lambda old=gc.get_threshold(): gc.set_threshold(*old)),
    "sys.getrecursionlimit": ("sys.getrecursionlimit() % 7", lambda: sys.setrecursionlimit(sys.getrecursionlimit() + 1),
                              lambda old=sys.getrecursionlimit(): sys.setrecursionlimit(old)),
    "os.getcwd": ("len(os.getcwd())", lambda: os.chdir(os.path.dirname(os.getcwd()) or "/"),
                  lambda old=os.getcwd(): os.chdir(old)),
}


@pytest.mark.parametrize("getter", GETTERS)
def test_a_getter_of_process_state_is_guarded_by_its_answer(getter):
    read, change, undo = GETTERS[getter]
    ns = _module(f"import gc, os, sys\n\ndef f(x):\n    return x * ({read} + 1)\n")
    try:
        _check(ns, ns["f"], change, X)
    finally:
        undo()


def test_the_thread_ident_is_read_in_the_calling_thread():
    """``threading.get_ident()`` answers per thread: a step captured in one thread and called in
    another checks the caller's (a stale graph would return the first thread's number)."""
    ns = _module("import threading\n\ndef f(x):\n    return x * (threading.get_ident() % 9973 + 1)\n")
    f = ns["f"]
    staged, jit = aotgrad.capture(f, X).compile(), aotgrad.jit(f)
    torch.testing.assert_close(staged(X), f(X))
    torch.testing.assert_close(jit(X), f(X))
    got = {}

    def other():
        got["eager"] = f(X)
        got["jit"] = jit(X)
        try:
            staged(X)
        except errors.InputMismatchError as e:
            got["staged"] = e
    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    assert not torch.equal(got["eager"], f(X)), "the idents must differ"
    torch.testing.assert_close(got["jit"], got["eager"])
    assert isinstance(got.get("staged"), errors.InputMismatchError)


# the program's read (``{h}`` is the module's holder), what the refusal names
REFUSED = {
    "a file's read": ("len(open(PATH).read())", "io.open"),
    "time.strftime": ("float(time.strftime('%S'))", "time.strftime"),
    "sys.getrefcount": ("sys.getrefcount(OBJ)", "sys.getrefcount"),
    "socket.gethostname": ("len(socket.gethostname())", "_socket.gethostname"),
}


@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_a_c_call_whose_answer_no_guard_can_check_is_refused(case, entry, tmp_path):
    read, named = REFUSED[case]
    path = tmp_path / "v.txt"
    path.write_text("abc")
    ns = _module(f"import socket, sys, time\nPATH = {str(path)!r}\nOBJ = object()\n\n"
                 f"def f(x):\n    return x * {read}\n")
    run = (lambda: aotgrad.capture(ns["f"], X)) if entry == "capture" else (lambda: aotgrad.jit(ns["f"])(X))
    with pytest.raises(errors.UnsupportedError, match=f"calls `{named}`") as info:
        run()
    assert info.value.user_line and " in f" in info.value.user_line


RNG_DRAWS = {"random()": "RNG.random()", "randint": "RNG.randint(0, 1000)", "choice": "RNG.choice([1.0, 2.0, 3.0])",
             "uniform": "RNG.uniform(0.0, 1.0)", "a subclass": "SUB.random()"}


@pytest.mark.parametrize("draw", RNG_DRAWS)
@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_a_draw_from_a_random_of_the_programs_own_is_refused_and_put_back(draw, entry):
    """Python's ``random.Random`` objects of the program's own: a trace would hold the numbers it drew
    (eager draws new ones each call). The stream is left where it was, the global one untouched."""
    ns = _module("import random\nRNG = random.Random(0)\nclass R(random.Random): pass\nSUB = R(1)\n\n"
                 f"def f(x):\n    return x * {RNG_DRAWS[draw]}\n")
    states = ns["RNG"].getstate(), ns["SUB"].getstate(), random.getstate()
    run = (lambda: aotgrad.capture(ns["f"], X)) if entry == "capture" else (lambda: aotgrad.jit(ns["f"])(X))
    with pytest.raises(errors.UnsupportedError, match="draws from `<") as info:
        run()
    assert info.value.user_line and " in f" in info.value.user_line
    assert (ns["RNG"].getstate(), ns["SUB"].getstate(), random.getstate()) == states


def test_a_random_of_the_programs_own_drawn_outside_the_trace_is_not_refused():
    """The draw decides an argument before the call: nothing of the stream is in the trace."""
    ns = _module("import random\nRNG = random.Random(0)\n\ndef f(x, s):\n    return x * s\n")
    s = ns["RNG"].random()
    step = aotgrad.capture(ns["f"], X, s).compile()
    torch.testing.assert_close(step(X, s), ns["f"](X, s))


# A standard-library function the program calls, asking C for state outside its arguments: answered
# as the C call would be from the program's own line (the library's deeper frames are its own).
THROUGH_STDLIB = {"os.path.exists": ("float(os.path.exists(PATH))", "posix.stat"),
                  "os.path.getsize": ("float(os.path.getsize(HERE) > 0)", "posix.stat"),
                  "uuid.uuid4": ("float(uuid.uuid4().int % 5)", "posix.urandom"),
                  "random.SystemRandom": ("random.SystemRandom().random()", "posix.urandom")}


@pytest.mark.parametrize("case", THROUGH_STDLIB)
def test_a_stdlib_function_asking_c_for_outside_state_is_refused(case, tmp_path):
    read, call = THROUGH_STDLIB[case]
    (tmp_path / "here").write_text("x")
    ns = _module(f"import os, random, uuid\nPATH = {str(tmp_path / 'flag')!r}\nHERE = {str(tmp_path / 'here')!r}\n\n"
                 f"def f(x):\n    return x * {read}\n")
    with pytest.raises(errors.UnsupportedError, match=f"calls `{call}`") as info:
        aotgrad.capture(ns["f"], X)
    assert info.value.user_line and " in f" in info.value.user_line


# A NumPy stream of the program's own: its draws run in Cython, which no profile event shows; its state
# taken before the trace tells. (the program's read)
NUMPY_DRAWS = {"a Generator": "G.random()", "its integers": "float(G.integers(0, 1000))",
               "a RandomState": "RS.rand()", "a bit generator's Generator": "np.random.Generator(BG).random()",
               "a module attribute": "HOLDER.rng.normal()",
               "one stream by two names": "G.random() * SAME.rng.random()"}


@pytest.mark.parametrize("draw", NUMPY_DRAWS)
@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_a_draw_from_a_numpy_stream_of_the_programs_own_is_refused_and_put_back(draw, entry):
    np = pytest.importorskip("numpy")
    ns = _module("import numpy as np, types\nG = np.random.default_rng(0)\nRS = np.random.RandomState(0)\n"
                 "BG = np.random.PCG64(1)\nHOLDER = types.SimpleNamespace(rng=np.random.default_rng(2))\n"
                 "SAME = types.SimpleNamespace(rng=G)\n\n"
                 f"def f(x):\n    return x * {NUMPY_DRAWS[draw]}\n")
    state = lambda: repr((ns["G"].bit_generator.state, ns["RS"].get_state(), ns["BG"].state,
                          ns["HOLDER"].rng.bit_generator.state, np.random.get_state()))
    before = state()
    run = (lambda: aotgrad.capture(ns["f"], X)) if entry == "capture" else (lambda: aotgrad.jit(ns["f"])(X))
    with pytest.raises(errors.UnsupportedError, match="draws from `<NumPy "):
        run()
    if threading.active_count() == 1:   # (put back where no other thread may have drawn meanwhile)
        assert state() == before


def test_a_numpy_draw_is_refused_while_another_thread_runs():
    """No watch sees a Cython draw, so a change made while other threads ran cannot be told from theirs:
    refused all the same (a graph holding the numbers would be wrong), the stream left as it is."""
    pytest.importorskip("numpy")
    ns = _module("import numpy as np\nG = np.random.default_rng(0)\n\ndef f(x):\n    return x * G.random()\n")
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, args=(60,), daemon=True)
    t.start()
    try:
        with pytest.raises(errors.UnsupportedError, match="draws from `<NumPy Generator"):
            aotgrad.capture(ns["f"], X)
    finally:
        stop.set()
        t.join(60)


def test_a_numpy_stream_the_function_makes_or_only_holds_is_not_refused():
    """A Generator made inside from a seed draws the same numbers on every call, as eager does; one
    held and not drawn from is not a draw."""
    pytest.importorskip("numpy")
    ns = _module("import numpy as np\nG = np.random.default_rng(0)\n\n"
                 "def f(x):\n    return x * np.random.default_rng(7).random() * (G is not None)\n")
    step = aotgrad.capture(ns["f"], X).compile()
    for _ in range(2):
        torch.testing.assert_close(step(X), ns["f"](X))


# A torch.Generator's seed, read by the program or through torch's Python: guarded as a getter.
# (the program's read, the change; ``G`` a generator of the program's own, ``H.gen`` one it holds)
GENERATOR_SEEDS = {"torch.initial_seed()": ("torch.initial_seed()", "torch.manual_seed(torch.initial_seed() + 1)"),
                   "torch.random.initial_seed()": ("torch.random.initial_seed()",
                                                   "torch.manual_seed(torch.initial_seed() + 1)"),
                   "the default generator's": ("torch.default_generator.initial_seed()",
                                               "torch.default_generator.manual_seed(torch.initial_seed() + 1)"),
                   "a generator of its own": ("G.initial_seed()", "G.manual_seed(G.initial_seed() + 1)"),
                   "a held generator": ("H.gen.initial_seed()", "H.gen.manual_seed(H.gen.initial_seed() + 1)")}
_GENERATORS = "import types\nG = torch.Generator().manual_seed(3)\nH = types.SimpleNamespace(gen=torch.Generator())\n"


@pytest.fixture
def _rng_kept():
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


@pytest.mark.parametrize("case", GENERATOR_SEEDS)
def test_a_generators_seed_is_guarded_by_its_answer(case, _rng_kept):
    read, change = GENERATOR_SEEDS[case]
    ns = _module(_GENERATORS + f"\ndef f(x):\n    return x * ({read} % 97 + 1)\n\n"
                 f"def change():\n    {change}\n")
    _check(ns, ns["f"], ns["change"], X)


# Any other method of a torch.Generator reads or sets its stream, which the graph neither holds nor
# replays (the draws after it would run on from where the trace left the generator): refused, naming
# the method and the line, every generator's state put back. (the program's expression, the refusal)
GENERATOR_STATE = {
    "a generator made and seeded inside": ("torch.rand(2, generator=torch.Generator().manual_seed(0))", "calls `torch._C.Generator.manual_seed`"),
    "its own generator reseeded": ("(G.manual_seed(7), torch.rand(2, generator=G))[1]", "calls `torch._C.Generator.manual_seed`"),
    "its state saved and restored": ("(S := G.get_state(), torch.rand(2, generator=G), G.set_state(S), "
                                     "torch.rand(2, generator=G))[3]", "calls `torch._C.Generator.get_state`"),
    "its seed()": ("(G.seed() % 7 + 1)", "calls `torch._C.Generator.seed`"),
    "a held generator reseeded": ("(H.gen.manual_seed(1), torch.randn(2, generator=H.gen))[1]", "calls `torch._C.Generator.manual_seed`"),
    "the default generator's state": ("(S := torch.default_generator.get_state(), torch.rand(2), "
                                      "torch.default_generator.set_state(S), torch.rand(2))[3]", "calls `torch._C.Generator.get_state`"),
    # (its change is also the global stream's: refused as torch.manual_seed's would be, whichever is seen first)
    "the default generator's manual_seed": ("(torch.default_generator.manual_seed(3), torch.rand(2))[1]",
                                            "calls `torch._C.Generator.manual_seed`|changed the global RNG"),
}


@pytest.mark.parametrize("case", GENERATOR_STATE)
@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_a_generators_stream_read_or_set_is_refused_and_put_back(case, entry, _rng_kept):
    read, refusal = GENERATOR_STATE[case]
    ns = _module(_GENERATORS + f"\ndef f(x):\n    return x * {read}\n")
    states = ns["G"].get_state(), ns["H"].gen.get_state(), torch.get_rng_state()
    run = (lambda: aotgrad.capture(ns["f"], X)) if entry == "capture" else (lambda: aotgrad.jit(ns["f"])(X))
    with pytest.raises(errors.UnsupportedError, match=refusal) as info:
        run()
    assert info.value.user_line and " in f" in info.value.user_line
    if threading.active_count() == 1:   # (put back where no other thread may have drawn from it meanwhile)
        after = ns["G"].get_state(), ns["H"].gen.get_state(), torch.get_rng_state()
        assert all(torch.equal(a, b) for a, b in zip(states, after))


def test_a_generators_draws_and_the_replayed_rng_functions_are_not_refused(_rng_kept):
    """Draws with a generator (the graph's op draws from it on each call, as eager does), and the
    default generator's state saved and restored through torch's functions (replayed): exactly
    eager's, call after call."""
    ns = _module(_GENERATORS + "\ndef f(x):\n    s = torch.get_rng_state()\n    a = torch.rand(2)\n"
                 "    torch.set_rng_state(s)\n    with torch.random.fork_rng():\n"
                 "        b = torch.rand(2)\n    return x * a * torch.rand(2) * b * torch.rand(2, generator=G)\n")
    f = ns["f"]
    for step in (aotgrad.capture(f, X).compile(), aotgrad.jit(f)):
        torch.manual_seed(0)
        ns["G"].manual_seed(3)
        got = [step(X) for _ in range(3)]
        torch.manual_seed(0)
        ns["G"].manual_seed(3)
        for g in got:
            torch.testing.assert_close(g, f(X))


def test_computing_with_a_taken_rng_state_is_refused(_rng_kept):
    """``torch.get_rng_state()`` is a real tensor: computed with, the graph would hold the state as it
    stood at capture (eager's changes with every draw)."""
    with pytest.raises(errors.UnsupportedError, match="computes with an RNG state") as info:
        aotgrad.capture(_computes_with_the_state, X)
    assert info.value.user_line and " in _computes_with_the_state" in info.value.user_line


def _computes_with_the_state(x):
    return x * torch.get_rng_state()[:2].float()


# C functions whose answer depends on their arguments alone: let through, exactly eager's
PURE = {
    "math": "math.sqrt(H[0]) + math.floor(2.5)",
    "builtins": "len(L) + sum(L) + max(L) + abs(-H[0]) + round(2.4) + sorted(L)[0]",
    "str methods": "len(' '.join(['a', 'bc']).upper().split())",
    "dict methods": "D.get('k', 0.0) + len(list(D.items()))",
    "a dict subclass's C method": "DS.get('k')",
    "struct": "struct.unpack('f', struct.pack('f', 1.5))[0]",
    "re": "re.match('a+', 'aaab').end()",
    "json": "json.loads('[2.0]')[0]",
    "hashing": "len(hashlib.sha256(b'x').hexdigest())",
    "operator/functools/itertools": "functools.reduce(operator.mul, itertools.repeat(2.0, 2))",
    "sys.getsizeof": "float(sys.getsizeof(0) > 0)",
    "torch": "float(torch.get_default_dtype() is torch.float32) + torch.tensor(3.0).item()",
    "side effects, as print": "float(sys.stdout.write('') + 0 * gc.collect() + 2)",
    # standard-library work whose C calls answer from their arguments, or whose answers no program
    # computes with (a log record's clock: a frame below the function the program called)
    "logging inside": "(LOG.info('step') or 2.0)", "os.path.join": "len(os.path.join('a', 'b'))",
    "copy.deepcopy": "copy.deepcopy([2.0])[0]", "collections.Counter": "collections.Counter('aab')['a']",
    "string.Template": "len(string.Template('$a').substitute(a='xy'))",
    "os.environ.get": "len(os.environ.get('AOTGRAD_NOT_SET', 'ab'))",
    "an import inside": "__import__('math').sqrt(4.0)",
    "isinstance of an ABC": "float(isinstance({}, collections.abc.Mapping))",
    "dataclasses.replace": "dataclasses.replace(CFG, scale=3.0).scale",
}


@pytest.mark.parametrize("case", PURE)
def test_a_c_call_pure_in_its_arguments_is_let_through(case):
    ns = _module("import collections, collections.abc, copy, dataclasses, functools, gc, hashlib, itertools, json, "
                 "logging, math, operator, os, re, string, struct, sys\n"
                 "H = [4.0]\nL = [1.0, 3.0]\nD = {'k': 2.0}\nclass DS(dict): pass\nDS = DS(k=5.0)\n"
                 "LOG = logging.getLogger('aotgrad.test_stdlib_pure')\n"
                 "@dataclasses.dataclass\nclass Cfg:\n    scale: float = 2.0\nCFG = Cfg()\n\n"
                 f"def f(x):\n    return x * ({PURE[case]})\n")
    f = ns["f"]
    torch.testing.assert_close(aotgrad.capture(f, X).compile()(X), f(X))
    jit = aotgrad.jit(f)
    torch.testing.assert_close(jit(X), f(X))
    torch.testing.assert_close(jit(X), f(X))
    assert len(jit.entries) == 1


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * (sys.getrecursionlimit() % 7 + 1)


def test_a_getter_in_a_custom_backward_is_guarded():
    """The joint's recorded backward (a custom ``Function``'s) reads the getter: guarded the same way."""
    old = sys.getrecursionlimit()

    def f(x):
        return _Scaled.apply(x).sum()

    x = torch.tensor([1.0, -2.0], requires_grad=True)
    staged = aotgrad.capture(f, x).compile()
    try:
        sys.setrecursionlimit(old + 1)
        with pytest.raises(errors.InputMismatchError, match="getrecursionlimit"):
            staged(x)
    finally:
        sys.setrecursionlimit(old)


# A library method the program calls on an object it holds reads that object's state (``self.x``), as
# a method of its own would: (the holder, the program's read, the change, its undo)
HELD = {
    "threading.Event.is_set": ("EV = threading.Event()", "(2.0 if EV.is_set() else 3.0)", "EV.set()", "EV.clear()"),
    "an Event subclass": ("class E(threading.Event): pass\nEV = E()", "(2.0 if EV.is_set() else 3.0)", "EV.set()",
                          "EV.clear()"),
    "Logger.isEnabledFor": ("LOG = logging.getLogger('aotgrad.test_c_calls')\nLOG.setLevel(logging.INFO)",
                            "(2.0 if LOG.isEnabledFor(logging.DEBUG) else 3.0)", "LOG.setLevel(logging.DEBUG)",
                            "LOG.setLevel(logging.INFO)"),
    "Logger.getEffectiveLevel (self through a local, up to its parent)": (
        "PARENT = logging.getLogger('aotgrad.test_eff')\nPARENT.setLevel(logging.INFO)\n"
        "LOG = logging.getLogger('aotgrad.test_eff.child')",
        "(2.0 if LOG.getEffectiveLevel() == logging.INFO else 3.0)", "PARENT.setLevel(logging.DEBUG)",
        "PARENT.setLevel(logging.INFO)"),
    "len of a WeakValueDictionary": ("class O: pass\nKEEP = [O(), O()]\nWD = weakref.WeakValueDictionary(a=KEEP[0])",
                                     "len(WD)", "WD['b'] = KEEP[1]", "WD.pop('b')"),
    "Queue.qsize (a method it calls on itself)": ("Q = queue.Queue()\nQ.put(1)", "Q.qsize()", "Q.put(2)", "Q.get()"),
    "a thread's name (a property)": ("T = threading.Thread(target=print, name='ab')", "len(T.name)",
                                     "T.name = 'abc'", "T.name = 'ab'"),
    "UserDict item": ("D = collections.UserDict(k=2.0)", "D['k']", "D['k'] = 3.0", "D['k'] = 2.0"),
}


# An object a library function hands the program (not one it built in the call): what the program then
# loads from it is read, as from an object it named. (the holder, the program's read, the change, its undo)
RETURNED = {
    "logging.getLogger(name).level": (
        "LOG = logging.getLogger('aotgrad.test_returned')\nLOG.setLevel(logging.INFO)",
        "(2.0 if logging.getLogger('aotgrad.test_returned').level == logging.INFO else 3.0)",
        "LOG.setLevel(logging.DEBUG)", "LOG.setLevel(logging.INFO)"),
    "inspect.getattr_static(o, name).x": (
        "class C: pass\nHOLDER = C()\nHOLDER.cfg = C()\nHOLDER.cfg.scale = 2.0",
        "inspect.getattr_static(HOLDER, 'cfg').scale", "HOLDER.cfg.scale = 3.0", "HOLDER.cfg.scale = 2.0"),
}


@pytest.mark.parametrize("case", [*HELD, *RETURNED])
def test_library_state_a_held_method_or_a_returned_object_reads_is_guarded(case):
    make, read, change, undo = HELD.get(case) or RETURNED[case]
    ns = _module(f"import collections, inspect, logging, queue, weakref\n{make}\n\ndef f(x):\n    return x * {read}\n\n"
                 f"def change():\n    {change}\n\ndef undo():\n    {undo}\n")
    try:
        _check(ns, ns["f"], ns["change"], X)
    finally:
        ns["undo"]()


def test_an_object_the_trace_builds_is_not_held():
    """A library object made inside the function (an ``Event``, a ``contextlib.suppress``) is the call's
    own: its state is not guarded (the guard would hold a dead object), and the step runs again."""
    ns = _module("import contextlib\n\ndef f(x):\n    e = threading.Event()\n    e.set()\n"
                 "    with contextlib.suppress(KeyError):\n        x = x * (2.0 if e.is_set() else 3.0)\n    return x\n")
    f = ns["f"]
    step = aotgrad.capture(f, X).compile()
    for _ in range(2):
        torch.testing.assert_close(step(X), f(X))
    jit = aotgrad.jit(f)
    for _ in range(2):
        torch.testing.assert_close(jit(X), f(X))
    assert len(jit.entries) == 1


def test_a_dict_subclass_holding_attributes_is_guarded_as_an_object():
    """``class Cfg(dict)`` with attributes (EasyDict, HF's ModelOutput): its ``__dict__`` is its
    attribute, not its entry ``'__dict__'``. Before, every call of the staged step failed its check
    ("now it is gone") and jit crashed storing the entry."""
    ns = _module("class Cfg(dict): pass\nCFG = Cfg(a=1)\nCFG.scale = 2.0\n\ndef f(x):\n    return x * CFG.scale\n\n"
                 "def change():\n    CFG.scale = 3.0\n")
    _check(ns, ns["f"], ns["change"], X)


# A C function called where the recording sees no call (from C: functools.partial, map, a sort key)
# answers as a direct call does: the resolver classifies the C functions the code loads.
INDIRECT_GETTERS = {"functools.partial": "functools.partial(gc.get_threshold)()[0] % 7",
                    "map": "list(map(lambda g: g()[0] % 7, [gc.get_threshold]))[0]"}


@pytest.mark.parametrize("call", INDIRECT_GETTERS)
def test_a_getter_called_from_c_is_guarded(call):
    read, change, undo = GETTERS["gc.get_threshold"]
    ns = _module(f"import functools, gc\n\ndef f(x):\n    return x * ({INDIRECT_GETTERS[call]} + 1)\n")
    try:
        _check(ns, ns["f"], change, X)
    finally:
        undo()


@pytest.mark.parametrize("read", ["list(map(sys.getrefcount, [OBJ]))[0]",
                                  "len(sorted([OBJ, [1]], key=sys.getrefcount))"])
def test_a_c_function_called_from_c_is_refused(read):
    ns = _module(f"import sys\nOBJ = object()\n\ndef f(x):\n    return x * {read}\n")
    with pytest.raises(errors.UnsupportedError, match="calls `sys.getrefcount`") as info:
        aotgrad.capture(ns["f"], X)
    assert info.value.user_line and " in f" in info.value.user_line


# State C holds that no profile event shows the code reading: a ctypes object's value, a field or item
# (a memoryview is guarded by its bytes: test_read_channels.VALUES); a C type's objects made and computed with (``decimal``'s
# arithmetic reads the thread's decimal context). (the program's read, what the refusal names, the change:
# each changes eager's result, and each ran a stale graph before)
C_STATE = {
    "ctypes.c_double's value": ("CD.value", "reads `CD.value`", "CD.value = 3.0"),
    "a ctypes array's item": ("CA[0]", "reads `CA[0]`", "CA[0] = 3.0"),
    "a ctypes structure's field": ("PT.v", "reads `PT.v`", "PT.v = 3.0"),
    # held in a list (guarded whole, its objects by identity), in a deque, two lists deep
    "a ctypes value in a list": ("LC[0].value", "reads `LC[0].value`", "LC[0].value = 3.0"),
    "a ctypes value in a deque": ("DC[0].value", "reads `DC[0].value`", "DC[0].value = 3.0"),
    "a ctypes array's item two lists deep": ("LL[0][0][0]", "reads `LL[0][0][0]`", "LL[0][0][0] = 3.0"),
    "decimal arithmetic": ("float(decimal.Decimal(1) / decimal.Decimal(3))", "calls `decimal.Decimal`",
                           "decimal.getcontext().prec = 3"),
    "a C type imported by name": ("float(Decimal(1) / Decimal(3))", "calls `decimal.Decimal`",
                                  "decimal.getcontext().prec = 3"),
}


@pytest.mark.parametrize("case", C_STATE)
@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_state_c_holds_out_of_sight_is_refused(case, entry):
    read, named, change = C_STATE[case]
    ns = _module("import collections, ctypes, decimal\nfrom decimal import Decimal\n"
                 "CD = ctypes.c_double(2.0)\nCA = (ctypes.c_double * 2)(2.0, 1.0)\n"
                 "class P(ctypes.Structure):\n    _fields_ = [('v', ctypes.c_double)]\nPT = P(2.0)\n"
                 "LC = [ctypes.c_double(2.0)]\nDC = collections.deque([ctypes.c_double(2.0)])\n"
                 "LL = [[(ctypes.c_double * 1)(2.0)]]\n\n"
                 f"def f(x):\n    return x * {read}\n\ndef change():\n    {change}\n")
    before = ns["f"](X)
    with decimal.localcontext():
        ns["change"]()
        assert not torch.equal(ns["f"](X), before), "the change must change eager's result"
    run = (lambda: aotgrad.capture(ns["f"], X)) if entry == "capture" else (lambda: aotgrad.jit(ns["f"])(X))
    with pytest.raises(errors.UnsupportedError, match=re.escape(named)) as info:
        run()
    assert info.value.user_line and " in f" in info.value.user_line


def test_a_global_found_among_the_builtins_is_read_there():
    """``builtins.SCALE = 2.0`` (a notebook's or a launcher's injected setting): the module's globals
    lack the name, so the absence there was the only read, and a changed builtin ran the old graph."""
    import builtins
    builtins.AOTGRAD_TEST_SCALE = 2.0
    ns = _module("def f(x):\n    return x * AOTGRAD_TEST_SCALE\n\ndef change():\n    import builtins\n"
                 "    builtins.AOTGRAD_TEST_SCALE = 3.0\n")
    try:
        _check(ns, ns["f"], ns["change"], X)
    finally:
        del builtins.AOTGRAD_TEST_SCALE


# A field of a C value that never changes (datetime's types) is its value for good: read where it is
# held (a global, a list item), guarded by the object's identity; a new object there runs again.
IMMUTABLE_FIELDS = {
    "timedelta.seconds, a global": ("TD = datetime.timedelta(seconds=2)", "TD.seconds",
                                    "global TD\n    TD = datetime.timedelta(seconds=3)"),
    "date.day in a list": ("L = [datetime.date(2026, 1, 2)]", "L[0].day", "L[0] = datetime.date(2026, 1, 3)"),
    "datetime.minute in a dict": ("D = {'t': datetime.datetime(2026, 1, 2, 3, 2)}", "D['t'].minute",
                                  "D['t'] = datetime.datetime(2026, 1, 2, 3, 3)"),
}


@pytest.mark.parametrize("case", IMMUTABLE_FIELDS)
def test_a_field_of_an_immutable_c_value_is_read_not_refused(case):
    setup, read, change = IMMUTABLE_FIELDS[case]
    ns = _module(f"import datetime\n{setup}\n\ndef f(x):\n    return x * {read}\n\ndef change():\n    {change}\n")
    _check(ns, ns["f"], ns["change"], X)
