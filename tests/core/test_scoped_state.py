"""Run-time state is scoped: two captures running at once in two threads (or nested in one)
do not see each other's state, and the process-wide settings capture changes come back."""
import threading

import torch

import aotgrad
from aotgrad import scoped, tracing
from aotgrad.tracing import patches

from ..eager_check import check


def _in_thread(fn):
    """Start ``fn`` in a thread; return a function that joins it and re-raises its error."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:       # re-raised by the caller's join
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join(30)
        assert not t.is_alive(), "thread did not finish"
        if "error" in box:
            raise box["error"]
        return box.get("value")
    return join


def _process_wide():
    """What captures patch for the whole process while they trace."""
    engine = torch._C._dynamo.compiled_autograd
    slot = engine.set_autograd_compiler(None, False)
    engine.set_autograd_compiler(*slot)
    return ([torch.Tensor.__dict__.get(n) for n in ("register_hook", "retain_grad")],
            torch.autograd.Function.__dict__["apply"], torch.autograd.backward, torch.get_rng_state,
            torch.compiler.is_compiling(), slot)


def test_seed_in_one_capture_is_not_seen_by_a_capture_in_another_thread():
    """Thread A's function seeds the RNG while thread B's capture of a random function is under
    way; with one process-wide record B was refused for A's seed (and the interleaved save/restore
    of torch.manual_seed, Tensor.retain_grad or the engine's compiler slot left them patched)."""
    b_tracing, a_seeded, b_done = threading.Event(), threading.Event(), threading.Event()

    def fa(x):
        torch.manual_seed(0)       # the same state as before: A's capture changes no RNG
        a_seeded.set()
        b_done.wait(30)
        return x * 2

    def fb(x):
        b_tracing.set()
        a_seeded.wait(30)
        return torch.nn.functional.dropout(x, 0.5, training=True) + x

    xa, xb = torch.randn(3), torch.randn(4, 4, requires_grad=True)     # drawn before the common seed

    def capture_b():
        try:
            return aotgrad.capture(fb, xb).compile()
        finally:
            b_done.set()

    patched = _process_wide()
    torch.manual_seed(0)
    join_b = _in_thread(capture_b)
    assert b_tracing.wait(30)
    join_a = _in_thread(lambda: aotgrad.capture(fa, xa).compile())
    step_b, step_a = join_b(), join_a()
    torch.manual_seed(0)
    assert tracing.current() == tracing.Trace(), "capture left this thread's trace context set"
    assert not any(p.users for p in patches.PATCHES.values()) and _process_wide() == patched, \
        "capture left torch patched"
    check(fb, (torch.randn(4, 4, requires_grad=True),), compile=lambda *_a, **_k: step_b)
    check(fa, (torch.randn(3),), compile=lambda *_a, **_k: step_a)


def test_a_stack_is_private_to_its_thread_and_nests():
    stack = scoped.Stack("test")
    stack.append(1)
    seen = _in_thread(lambda: (len(stack), stack.append(2), list(stack))[::2])()
    assert seen == (0, [2])
    stack.append(3)
    assert list(stack) == [1, 3] and stack[-1] == 3 and stack.pop() == 3 and stack.pop() == 1
    assert not stack


_EVENTS: dict = {}     # name -> (event to set on arrival, event to wait for): modules are deep-copied


class _Waiting(torch.nn.Module):
    """Two identical blocks (reused by capture) and a forward that waits on the other thread."""

    def __init__(self, name):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                          for _ in range(2))
        self.name = name

    def forward(self, x):
        arrive, wait_for = _EVENTS[self.name]
        arrive.set()
        wait_for.wait(30)
        for b in self.blocks:
            x = b(x)
        return x.sum()


def test_block_reuse_in_two_threads_leaves_module_call_unpatched():
    """A's capture starts reusing blocks, B's starts, A's ends, B's ends: with each capture patching
    Module.__call__ and putting back what it found, B put back A's patch for good."""
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    _EVENTS.update(a=(a_in, b_in), b=(b_in, a_done))
    torch.manual_seed(0)
    ma, mb = _Waiting("a"), _Waiting("b")
    x = torch.randn(3, 4)
    before = torch.nn.Module.__dict__["__call__"]

    def capture_a():
        try:
            return aotgrad.capture(ma, x).compile()
        finally:
            a_done.set()

    join_a = _in_thread(capture_a)
    assert a_in.wait(30)
    join_b = _in_thread(lambda: aotgrad.capture(mb, x).compile())
    step_a, step_b = join_a(), join_b()
    assert torch.nn.Module.__dict__["__call__"] is before and not patches.MODULE_CALLS.users
    for m, step in ((ma, step_a), (mb, step_b)):
        eager = [g.detach() for g in torch.autograd.grad(m(x), list(m.parameters()))]
        loss = step(x)
        assert torch.equal(loss, m(x))
        assert all(torch.allclose(g, e) for g, e in zip(torch.autograd.grad(loss, list(m.parameters())), eager))
