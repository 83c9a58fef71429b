"""Python state another thread writes while a capture runs is that thread's: a data-loading thread's
``random`` draws and a logger's global writes are neither taken back nor a reason to refuse the
capture; the capturing thread's own draws and writes are still refused (and its writes undone); a
global the trace read that another thread changed meanwhile makes the capture run again.

Each test forces the overlap (the traced forward waits, in the capturing thread, until the other
thread has done its part) and bounds every wait.
"""
import random
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


def _overlapping(body, other, entry="jit"):
    """Run ``entry`` on a model whose forward ``body(self, x, pause)`` calls ``pause()``: the first call
    of it waits until ``other()`` (in another thread) has run. Returns (output, model, x)."""
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
