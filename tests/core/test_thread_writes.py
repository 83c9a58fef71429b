"""Python state another thread writes while a capture runs is that thread's: a data-loading thread's
``random`` draws and a logger's global writes are neither taken back nor a reason to refuse the
capture; the capturing thread's own draws and writes are still refused (and its writes undone); a
global the trace read that another thread changed meanwhile makes the capture run again.

Each test forces the overlap (the traced forward waits, in the capturing thread, until the other
thread has done its part) and bounds every wait.
"""
import builtins
import collections
import copy
import functools
import itertools
import operator
import random
import re
import threading

import numpy as np
import pytest
import torch

import aotgrad

from ..eager_check import assert_close
from .test_threads import WAIT, _start

HEARTBEAT = 0       # written by the other thread (this module's globals are copied by every capture here)
SCALE = 2.0         # read by the traced forward
OWN = 0             # written by the traced forward


class Counter:
    beats = 0       # a class attribute another thread bumps
    scale = 2.0     # one the traced forward reads


@pytest.fixture(autouse=True)
def _traced_each_time(monkeypatch):
    """Every first call traces (a disk-cache hit would run no forward to overlap with)."""
    monkeypatch.setenv("AOTGRAD_CACHE", "0")


class Model(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.body = body

    def forward(self, x):
        return self.body(self, x)


ENTRIES = {"jit": lambda m, x: aotgrad.jit(m)(x),
           "capture": lambda m, x: aotgrad.capture(m, x).compile()(x)}


def _overlapping(body, other, entry="jit", box=None):
    """Run ``entry`` on a model whose forward ``body(self, x, pause)`` calls ``pause()``: the first call
    of it waits until ``other()`` (in another thread) has run. Returns (output, model, x); ``box``
    gets the model as ``"model"`` before it runs."""
    torch.manual_seed(0)
    inside, done = threading.Event(), threading.Event()

    def pause():
        if not inside.is_set():
            inside.set()
            assert done.wait(WAIT)

    def helper():
        assert inside.wait(WAIT)
        try:
            other()
        finally:
            done.set()
    model, x = Model(lambda m, x: body(m, x, pause)), torch.randn(2, 4)
    if box is not None:
        box["model"] = model
    join = _start(helper)
    try:
        out = ENTRIES[entry](model, x)
    finally:
        done.set()
        join()
    return out, model, x


@pytest.mark.parametrize("entry", ENTRIES)
def test_another_threads_draws_during_a_capture_are_theirs(entry):
    draw = random.random
    random.seed(7)
    expected = [draw() for _ in range(50)]
    random.seed(7)
    got = []

    def body(m, x, pause):
        h = m.fc(x)
        pause()
        return h.tanh()
    out, model, x = _overlapping(body, lambda: got.extend(draw() for _ in range(50)), entry)
    # Before: refused ("the traced code draws from `random`") and the stream rewound, so the other
    # thread's next draws repeated the ones it had made.
    assert got == expected and draw() != expected[0]
    assert_close(model.fc(x).tanh().detach(), out.detach(), entry, 0, 0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_another_threads_global_write_during_a_capture_is_kept(entry):
    global HEARTBEAT
    HEARTBEAT = 0

    def beat():
        global HEARTBEAT
        HEARTBEAT = 41

    def body(m, x, pause):
        pause()
        return m.fc(x) * SCALE
    out, model, x = _overlapping(body, beat, entry)
    assert HEARTBEAT == 41      # before: put back to 0, and the capture refused
    assert_close(model.fc(x).detach() * SCALE, out.detach(), entry, 0, 0)


def test_another_threads_numpy_draws_during_a_capture_are_the_captures():
    """numpy's draws are invisible to profiling: a change of its global stream during a capture is
    taken as the capture's (refused, put back) rather than risk a graph holding a number it drew."""
    np.random.seed(7)
    first = np.random.rand()
    np.random.seed(7)

    def body(m, x, pause):
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="draws from `numpy.random`"):
        _overlapping(body, lambda: np.random.rand(5))
    assert np.random.rand() == first


@pytest.mark.parametrize("stream", ["random", "numpy"])
def test_the_capturing_threads_own_draw_is_still_refused_and_put_back(stream):
    draw = random.random if stream == "random" else np.random.rand
    seed = random.seed if stream == "random" else np.random.seed
    seed(3)
    first = draw()
    seed(3)
    got = []

    def body(m, x, pause):
        pause()
        return m.fc(x) * draw()
    with pytest.raises(aotgrad.errors.UnsupportedError, match=f"draws from `{'random' if stream == 'random' else 'numpy.random'}`"):
        _overlapping(body, lambda: got.append(None))
    assert got == [None] and draw() == first      # refused and put back, as without threads


def test_the_capturing_threads_own_global_write_is_still_refused_and_undone():
    global OWN, HEARTBEAT
    OWN, HEARTBEAT = 5, 0

    def body(m, x, pause):
        global OWN
        OWN += 1
        pause()
        return m.fc(x)

    def beat():
        global HEARTBEAT
        HEARTBEAT = 7
    with pytest.raises(aotgrad.errors.UnsupportedError, match="assigns `OWN`"):
        _overlapping(body, beat)
    assert OWN == 5 and HEARTBEAT == 7


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_global_the_trace_read_changed_meanwhile_is_captured_again(entry):
    global SCALE
    SCALE = 2.0

    def body(m, x, pause):
        h = m.fc(x) * SCALE
        pause()         # the other thread sets SCALE = 3.0 after this trace has read 2.0
        return h

    def change():
        global SCALE
        SCALE = 3.0
    try:
        out, model, x = _overlapping(body, change, entry)
        # The first trace used 2.0 and would have been guarded on 3.0 (read after the trace), a graph
        # computing * 2.0 for SCALE == 3.0: captured again instead.
        assert_close(model.fc(x).detach() * 3.0, out.detach(), entry, 0, 0)
    finally:
        SCALE = 2.0


@pytest.mark.parametrize("entry", ENTRIES)
def test_another_threads_class_attribute_writes_are_kept_and_a_read_one_captures_again(entry):
    Counter.beats, Counter.scale = 0, 2.0

    def body(m, x, pause):
        h = m.fc(x) * Counter.scale
        pause()
        return h

    def bump():
        Counter.beats += 1
        Counter.scale = 3.0
    try:
        out, model, x = _overlapping(body, bump, entry)
        assert Counter.beats == 1       # before: put back to 0, and the capture refused
        assert_close(model.fc(x).detach() * 3.0, out.detach(), entry, 0, 0)
    finally:
        Counter.scale = 2.0


def test_a_global_written_through_globals_in_the_capturing_thread_is_still_its_own():
    """Code that writes a global whose name the bytecode does not hold (``globals()[name]``) could have
    written any global: a change found is the capture's (refused and put back)."""
    global OWN
    OWN = 5
    name = "OWN"

    def body(m, x, pause):
        globals()[name] += 1
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="assigns `OWN`"):
        _overlapping(body, lambda: None)
    assert OWN == 5


class _Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * random.random()


def test_a_draw_in_a_traced_backward_of_the_capturing_thread_is_still_refused():
    """A custom Function's backward is traced in the joint, after the read recording stopped: the
    capturing thread is still watched there where other threads run."""
    def body(m, x, pause):
        h = _Noisy.apply(m.fc(x))
        pause()
        return h.sum()
    with pytest.raises(aotgrad.errors.UnsupportedError, match="draws from `random`"):
        _overlapping(body, lambda: [random.random() for _ in range(5)])


# ---------------------------------------------------------------- torch's process-wide switches

# name -> (write, read, the value the write sets); each switch starts at another value (``_switches``).
# Not torch.set_num_threads: under OpenMP it is each thread's own, and a helper thread's call of it
# leaves later multi-threaded training in the process computing garbage (test_threads.py after it).
SWITCHES = {
    "default dtype": (lambda: torch.set_default_dtype(torch.float64), torch.get_default_dtype, torch.float64),
    "deterministic": (lambda: torch.use_deterministic_algorithms(True), torch.are_deterministic_algorithms_enabled,
                      True),
    "matmul precision": (lambda: torch.set_float32_matmul_precision("medium"), torch.get_float32_matmul_precision,
                         "medium"),
    "oneDNN": (lambda: setattr(torch.backends.mkldnn, "enabled", False), lambda: torch.backends.mkldnn.enabled,
               False),
    "anomaly": (lambda: torch.autograd.set_detect_anomaly(True), torch.is_anomaly_enabled, True),
    "cuDNN benchmark": (lambda: setattr(torch.backends.cudnn, "benchmark", True),
                        lambda: torch.backends.cudnn.benchmark, True),
}


@pytest.fixture
def _switches():
    """Every switch as a test starts it (none at its ``SWITCHES`` value), and again after."""
    from aotgrad.runtime import modes
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision("highest")
    torch.autograd.set_detect_anomaly(False)
    torch.backends.mkldnn.enabled, torch.backends.cudnn.benchmark = True, False
    state = modes.global_state()
    try:
        yield
    finally:
        modes.set_global_state(state)


@pytest.mark.parametrize("switch", SWITCHES)
def test_another_threads_switch_during_a_capture_is_kept(switch, _switches):
    write, read, value = SWITCHES[switch]
    before = read()

    def body(m, x, pause):
        pause()
        return m.fc(x).tanh()
    # Before: put back as the capture ended (all of torch's switches were), B's write silently lost.
    try:
        out, model, x = _overlapping(body, write)
    except aotgrad.errors.UnsupportedError as e:      # the trace read the switch: refused, typed
        assert "changed while the function was captured" in str(e) and switch in ("default dtype",)
        out = None
    assert read() == value != before
    if out is not None:
        assert_close(model.fc(x).tanh().detach(), out.detach(), switch, 1e-6, 1e-6)


def test_the_capturing_threads_own_switch_left_changed_is_still_refused_and_put_back(_switches):
    def body(m, x, pause):
        torch.use_deterministic_algorithms(True)
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="deterministic algorithms was off, now on"):
        _overlapping(body, lambda: torch.set_float32_matmul_precision("medium"))
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "medium"      # the other thread's, meanwhile


def test_a_switch_set_and_put_back_by_the_capture_and_changed_by_another_thread_is_kept(_switches):
    """The traced code sets a switch and sets it back; another thread sets it meanwhile, after: its
    value is kept, and the capture is not refused for it."""
    def body(m, x, pause):
        with torch.backends.mkldnn.flags(enabled=False):
            h = m.fc(x)
        pause()
        return h
    try:
        out, model, x = _overlapping(body, lambda: setattr(torch.backends.mkldnn, "enabled", False))
        assert_close(model.fc(x).detach(), out.detach(), "oneDNN", 0, 0)
    except aotgrad.errors.UnsupportedError as e:     # the trace read it (to put it back): the read's guard
        assert "changed while the function was captured" in str(e)
    assert torch.backends.mkldnn.enabled is False


def test_a_switch_both_threads_changed_is_refused_and_the_other_threads_value_kept(_switches):
    def body(m, x, pause):
        torch.set_float32_matmul_precision("high")
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="another thread changed float32 matmul precision"):
        _overlapping(body, lambda: torch.set_float32_matmul_precision("medium"))
    assert torch.get_float32_matmul_precision() == "medium"


def test_a_thread_local_switch_left_changed_is_the_captures_whatever_other_threads_do(_switches):
    """Grad mode is per thread: another thread cannot have changed this one's."""
    def body(m, x, pause):
        torch.set_grad_enabled(False)
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="grad mode was on, now off"):
        _overlapping(body, lambda: torch.set_grad_enabled(False))
    assert torch.is_grad_enabled()


# ---------------------------------------------------------------- objects and containers another thread writes

class Settings:
    def __init__(self):
        self.scale, self.beats = 2.0, 0


SETTINGS = Settings()       # a plain object the traced forward reads
LOG: list = []              # containers the traced forward reaches (loads) without changing them
TABLE: dict = {}
TAGS: set = set()


def _reaches_everything(m, x, pause):
    h = m.fc(x) * SETTINGS.scale
    assert LOG is not None and TABLE is not None and TAGS is not None      # (loads: copied by the capture)
    pause()
    return h


# name -> (the other thread's write given the model, whether it holds after)
OBJECT_WRITES = {
    "model.eval()": (lambda m: m.eval(), lambda m: not m.training and not m.fc.training),
    "module attribute": (lambda m: setattr(m, "note", 7), lambda m: m.note == 7),
    "object attribute": (lambda m: setattr(SETTINGS, "beats", 3), lambda m: SETTINGS.beats == 3),
    "list append": (lambda m: LOG.append("beat"), lambda m: LOG == ["beat"]),
    "dict item": (lambda m: TABLE.__setitem__("beat", 1), lambda m: TABLE == {"beat": 1}),
    "set add": (lambda m: TAGS.add("beat"), lambda m: TAGS == {"beat"}),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("write", OBJECT_WRITES)
def test_another_threads_write_to_an_object_the_capture_reached_is_kept(write, entry):
    LOG.clear(), TABLE.clear(), TAGS.clear()
    SETTINGS.beats = 0
    change, holds = OBJECT_WRITES[write]
    box = {}
    # Before: put back when the capture ended (B's write lost) and the capture refused for it.
    out, model, x = _overlapping(_reaches_everything, lambda: change(box["model"]), entry, box)
    assert holds(model)
    assert_close(model.fc(x).detach() * 2.0, out.detach(), write, 0, 0)


def test_the_capturing_threads_own_container_write_is_still_refused_and_undone():
    LOG.clear()
    TABLE.clear()

    def body(m, x, pause):
        LOG.append(1)
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="changes the contents of `LOG`"):
        _overlapping(body, lambda: TABLE.__setitem__("beat", 1))
    assert LOG == [] and TABLE == {"beat": 1}


def test_a_container_write_by_subscript_in_the_capturing_thread_is_its_own():
    """``TABLE[k] = v`` is no call the watch sees: where user code stores by subscript, a changed
    container may be the capture's, which is refused and put back."""
    TABLE.clear()

    def body(m, x, pause):
        TABLE["mine"] = 1
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="changes the contents of `TABLE`"):
        _overlapping(body, lambda: None)
    assert TABLE == {}


def test_the_capturing_threads_own_attribute_write_is_still_refused_and_undone():
    def body(m, x, pause):
        m.calls = getattr(m, "calls", 0) + 1
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="assigns `calls`"):
        _overlapping(body, lambda: None)


class _Config:
    def __init__(self):
        self.beats, self.mode, self.name, self.value, self.step = 0, "a", "a", "a", "a"

    def bump(self):
        self.beats += 1


CONFIG = _Config()


def _bump_attribute():
    CONFIG.beats += 1


def _bump_dict():
    CONFIG.__dict__["beats"] = CONFIG.beats + 1


# the capture's own write of CONFIG.beats, each way
OWN_WRITES = {"attribute": _bump_attribute, "setattr": lambda: setattr(CONFIG, "beats", CONFIG.beats + 1),
              "__dict__": _bump_dict, "method": lambda: CONFIG.bump()}


@pytest.mark.parametrize("own, theirs", [("attribute", "mode"), ("setattr", "name"), ("__dict__", "value"),
                                         ("method", "name")])
def test_another_threads_write_of_a_name_library_code_stores_is_kept_beside_the_captures_own(own, theirs):
    """The other thread sets ``CONFIG.<theirs>``, a name torch's or the standard library's code that runs
    in the capturing thread also stores (on objects of its own: ``set_grad_enabled``'s ``self.mode``)
    or holds as a constant; the capture's own write of ``CONFIG.beats`` is refused and undone, theirs
    is kept and not blamed. Before: any library code's store of that name, or the name among the
    constants of library code calling ``setattr``, counted as the capture's: the other thread's value
    was put back and the error named it."""
    CONFIG.__init__()

    def body(m, x, pause):
        OWN_WRITES[own]()
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="assigns `beats` of _Config") as e:
        _overlapping(body, lambda: setattr(CONFIG, theirs, "b"))
    assert theirs not in str(e.value).split("(")[0]
    assert CONFIG.beats == 0 and getattr(CONFIG, theirs) == "b"


@pytest.mark.parametrize("entry", ENTRIES)
def test_another_threads_write_of_an_attribute_the_trace_read_captures_again(entry):
    SETTINGS.scale = 2.0

    def body(m, x, pause):
        h = m.fc(x) * SETTINGS.scale
        pause()
        return h
    try:
        out, model, x = _overlapping(body, lambda: setattr(SETTINGS, "scale", 3.0), entry)
        assert_close(model.fc(x).detach() * 3.0, out.detach(), entry, 0, 0)
    finally:
        SETTINGS.scale = 2.0


# ---------------------------------------------------------------- oneDNN: the user's switch, traced RNNs plain

class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h.tanh() if torch.backends.mkldnn.enabled else h.sigmoid()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_forward_branching_on_onednn_reads_the_users_switch(enabled):
    """Before: a capture turned oneDNN off while it traced, so the forward took the other branch."""
    from ..eager_check import check
    with torch.backends.mkldnn.flags(enabled=enabled):
        check(_Branchy(), (torch.randn(2, 4),))
        assert torch.backends.mkldnn.enabled is enabled


@pytest.mark.parametrize("rnn", ["LSTM", "GRU"])
def test_recurrent_modules_still_trace_into_plain_ops(rnn):
    from ..eager_check import check
    assert torch.backends.mkldnn.enabled
    check(getattr(torch.nn, rnn)(4, 5, num_layers=2), (torch.randn(3, 2, 4),))
    ops = {str(n.target) for n in aotgrad.capture(torch.nn.LSTM(4, 5), torch.randn(3, 2, 4)).joint.graph.nodes}
    assert not any("mkldnn" in o for o in ops) and torch.backends.mkldnn.enabled


def test_another_threads_eager_lstm_during_a_capture_sees_onednn_on():
    """oneDNN is off only while a traced RNN op dispatches, not for the whole capture."""
    seen = []

    def body(m, x, pause):
        pause()
        return m.fc(x)
    _overlapping(body, lambda: seen.append(torch.backends.mkldnn.enabled))
    assert seen == [True]


@pytest.mark.parametrize("entry", ["jit", "capture"])
def test_the_captures_own_write_through_execd_code_is_refused_while_a_thread_idles(entry):
    """Code made by ``exec`` (a notebook cell) is the user's to the watch as to the recording: its
    write to a global dict is the capture's, refused and undone, with another thread merely alive."""
    import types
    ns = types.ModuleType("_thread_writes_execd")
    exec(compile("TABLE = {'k': 0}\n\ndef f(x):\n    (lambda: TABLE.__setitem__('k', TABLE['k'] + 1))()\n"
                 "    TABLE['k'] = TABLE['k'] + 1\n    return x * 2\n", "<cell>", "exec"), vars(ns))
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, args=(WAIT,), daemon=True)
    idle.start()
    try:
        x = torch.randn(3)
        with pytest.raises(aotgrad.errors.UnsupportedError, match="TABLE"):
            aotgrad.jit(ns.f)(x) if entry == "jit" else aotgrad.capture(ns.f, x)
        assert ns.TABLE == {"k": 0}
    finally:
        stop.set()
        idle.join(WAIT)


MEMO: dict = {}

# the capture's own write through library code storing by subscript into what the user holds
LIBRARY_ITEM_WRITES = {
    "register_buffer(name, None)": (lambda m: m.register_buffer("extra", None),
                                    "registers or replaces the buffer `extra`", lambda m: "extra" not in m._buffers),
    "register_parameter(name, None)": (lambda m: m.register_parameter("extra", None),
                                       "parameter `extra`", lambda m: "extra" not in m._parameters),
    "copy.deepcopy into a memo": (lambda m: copy.deepcopy([1.0], MEMO), "MEMO", lambda m: MEMO == {}),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("write", LIBRARY_ITEM_WRITES)
def test_the_captures_own_item_write_through_library_code_is_refused_beside_another_thread(write, entry):
    """torch's ``register_buffer`` stores ``self._buffers[name] = None``, ``copy.deepcopy`` its memo
    item: stores by subscript no call shows. The store names its container (the chain before its
    key), so the capture's own write is refused and undone as without threads. Before: with another
    thread alive the write was taken for that thread's and kept (the capture ran, eager's later
    calls would write again)."""
    MEMO.clear()
    do, message, untouched = LIBRARY_ITEM_WRITES[write]
    box = {}

    def body(m, x, pause):
        do(m)
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match=re.escape(message)):
        _overlapping(body, lambda: None, entry, box)
    assert untouched(box["model"])


# the capture's own container write that no call of the container's methods shows: C calls it for
# the program (a bound method handed to map, a partial), or a function writing its first argument
C_ITEM_WRITES = {
    "operator.setitem": lambda: operator.setitem(TABLE, "k", 1),
    "dict.__setitem__ on the type": lambda: dict.__setitem__(TABLE, "k", 1),
    "operator.iadd": lambda: operator.iadd(LOG, [1]),
    "map(LOG.append, ...)": lambda: list(map(LOG.append, [1])),
    "deque(map(...), maxlen=0)": lambda: collections.deque(map(LOG.append, [1]), maxlen=0),
    "starmap(TABLE.__setitem__, ...)": lambda: list(itertools.starmap(TABLE.__setitem__, [("k", 1)])),
    "partial(TABLE.__setitem__, 'k')": lambda: functools.partial(TABLE.__setitem__, "k")(1),
    "partial(SEEN.__isub__, ...)": lambda: functools.partial(SEEN.__isub__, {1})(),
    "map(LOG.__imul__, ...)": lambda: list(map(LOG.__imul__, [0])),
}
SEEN = {1}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("write", C_ITEM_WRITES)
def test_the_captures_own_container_write_through_c_is_refused_beside_another_thread(write, entry):
    """Without threads each is refused and undone (the container changed); with another thread alive
    the change was taken for that thread's: the capture ran, left the item written (twice: by each
    trace), and later calls did not write it as eager does. The bytecode names the container: the
    first argument of a function writing it, the object of a changing method loaded as a value."""
    LOG[:] = [1]
    TABLE.clear()
    SEEN.add(1)

    def body(m, x, pause):
        C_ITEM_WRITES[write]()
        pause()
        return m.fc(x)
    try:
        with pytest.raises(aotgrad.errors.UnsupportedError):
            _overlapping(body, lambda: None, entry)
        assert LOG == [1] and TABLE == {} and SEEN == {1}
    finally:
        LOG.clear()


SET_ATTR = setattr      # a setter under another name (``setter = setattr`` in a config module)

# the capture's own write of CONFIG.beats through a setter no name in its bytecode shows
DYNAMIC_SETTERS = {
    "getattr(builtins, 'setattr')": lambda: getattr(builtins, "setattr")(CONFIG, "beats", 1),
    "vars(builtins)['setattr']": lambda: vars(builtins)["setattr"](CONFIG, "beats", 1),
    "an alias of setattr": lambda: SET_ATTR(CONFIG, "beats", 1),
    "getattr(builtins, 'delattr')": lambda: getattr(builtins, "delattr")(CONFIG, "beats"),
    "getattr(object, '__setattr__')": lambda: getattr(object, "__setattr__")(CONFIG, "beats", 1),
    "operator.methodcaller('__setattr__', ...)": lambda: operator.methodcaller("__setattr__", "beats", 1)(CONFIG),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("write", DYNAMIC_SETTERS)
def test_the_captures_own_write_through_a_setter_it_looked_up_is_refused_beside_another_thread(write, entry):
    """Without threads each is refused and undone (``CONFIG.beats`` changed). With another thread alive
    the change was taken for that thread's: the capture ran and left ``CONFIG`` written. The watch sees
    the setter called (C calls it, or the thread called it from Python) with no name of it in the
    code: that code may have written any name of any object."""
    CONFIG.__init__()

    def body(m, x, pause):
        DYNAMIC_SETTERS[write]()
        pause()
        return m.fc(x)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="beats"):
        _overlapping(body, lambda: None, entry)
    assert CONFIG.beats == 0
