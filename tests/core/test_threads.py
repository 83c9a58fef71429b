"""Threads: a capture changes nothing another thread sees, and concurrent first calls of one
``jit`` compile once.

Each test forces the overlap it is about (a forward that waits, in the capturing thread only,
until the other thread has done its part), compares every result with eager PyTorch, joins
every thread with a bounded timeout, and checks afterwards that nothing was left behind: the
modules hold their own parameters, the process-wide functions capture patches are PyTorch's.
"""
import copy
import io
import threading

import pytest
import torch
import torch._dynamo

import aotgrad
from aotgrad.guards import reads
from aotgrad.tracing import views

from ..eager_check import _leaked, assert_close

WAIT = 60       # seconds: every wait and join is bounded


def _start(fn, *args):
    """Run ``fn(*args)`` in a thread; return its join, which re-raises the thread's error."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:      # re-raised by the join
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        t.join(WAIT)
        assert not t.is_alive(), "thread did not finish"
        if "error" in box:
            raise box["error"]
        return box.get("value")
    return join


def _join_all(joins) -> list:
    """Every thread's value, in order; all are joined before the first error is raised (one left
    running would go on into the next test)."""
    results = []
    for j in joins:
        try:
            results.append((j(), None))
        except BaseException as e:
            results.append((None, e))
    for _, e in results:
        if e is not None:
            raise e
    return [v for v, _ in results]


def _patched_now():
    return (torch.nn.Module.__dict__["__call__"], torch.autograd.backward, torch.compiler.is_compiling,
            torch.manual_seed, torch.get_rng_state, torch.Tensor.__dict__.get("retain_grad"),
            torch.autograd.Function.__dict__["apply"])


torch._dynamo.reset()      # importing Dynamo wraps torch.manual_seed: what it leaves is the original
ORIGINAL = _patched_now()


def _assert_nothing_left(*models, params=None):
    assert _patched_now() == ORIGINAL, "a process-wide patch outlived the captures"
    for m in models:
        assert not _leaked(m), f"tracing tensors left in {type(m).__name__}: {_leaked(m)}"
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            assert type(t) in (torch.Tensor, torch.nn.Parameter), f"{name} is a {type(t).__name__}"
    if params is not None:
        for m, before in params:
            assert [id(p) for p in m.parameters()] == before, "a parameter was replaced"


class Net(torch.nn.Module):
    """Linear - BatchNorm - Linear; ``pause(net)`` runs inside each forward (the tests' rendezvous)."""

    def __init__(self, width=6):
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2)
        self.pause = None

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        if self.pause is not None:
            self.pause(self)
        return self.fc2(h) * self.fc1.weight.sum()


def _eager(model, x):
    """Outputs, gradients and buffers of an eager step of a copy of ``model``."""
    m = copy.deepcopy(model)
    out = m(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, \
        {n: b.clone() for n, b in m.named_buffers()}


def _step(fn, model, x):
    out = fn(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, \
        {n: b.clone() for n, b in model.named_buffers()}


def _assert_same(expected, got, what):
    (out_e, grads_e, bufs_e), (out_c, grads_c, bufs_c) = expected, got
    assert_close(out_e, out_c, f"{what}: output", 1.3e-6, 1e-5)
    for n in grads_e:
        assert_close(grads_e[n], grads_c[n], f"{what}: grad of {n}", 1.3e-5, 1e-4)
    for n in bufs_e:
        assert_close(bufs_e[n], bufs_c[n], f"{what}: buffer {n}", 1.3e-6, 1e-5)


class Blocks(torch.nn.Module):
    """Repeated blocks (traced once, as templates), a tied weight and a buffer the forward rebinds."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8)) for _ in range(3))
        self.out = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(8, 4)
        self.head.weight = self.out.weight      # tied
        self.register_buffer("calls", torch.zeros(()))
        self.pause = None

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        if self.pause is not None:
            self.pause(self)
        self.calls = self.calls + 1
        return (self.out(h) + self.head(h).sin()) * self.calls


def _traced(t) -> bool:
    return not (type(t) in (torch.Tensor, torch.nn.Parameter))


@pytest.mark.parametrize("make", [Net, Blocks])
def test_eager_use_in_another_thread_while_a_capture_holds_the_model(make):
    """While thread A's trace is inside the model's forward (holding its traced parameters),
    the main thread calls the same model eagerly, reads its parameters and runs a backward: it
    sees the real tensors and gets eager's numbers bit for bit (before: FakeTensors or an error)."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(5, 4)
    expected, reference = _eager(model, x), copy.deepcopy(model)
    params = [(model, [id(p) for p in model.parameters()])]
    inside, release, capturer = threading.Event(), threading.Event(), []

    def pause(net):
        if threading.current_thread() in capturer and not inside.is_set():
            assert all(_traced(p) for p in net.parameters()) and _traced(next(iter(net.buffers())))
            inside.set()
            assert release.wait(WAIT)

    def capture():
        capturer.append(threading.current_thread())
        return aotgrad.capture(model, x).compile()
    model.pause = pause
    join = _start(capture)
    try:
        assert inside.wait(WAIT), "the capture never reached the forward"
        assert not any(_traced(t) for m in model.modules() for t in [
            *m.parameters(), *m.buffers(), *m._parameters.values(), *dict(m._buffers).values(),
            *(getattr(m, n) for n in [*m._parameters, *m._buffers])])
        got = _step(model, model, x)        # eager, in this thread, mid-capture (its pause() does nothing)
        for a, b in zip(expected[0], got[0]):
            assert torch.equal(a, b)
        for n, g in expected[1].items():
            assert torch.equal(g, got[1][n]), f"eager grad of {n} changed while another thread captured"
    finally:
        release.set()
        compiled = join()
    _assert_nothing_left(model, params=params)
    for n, t in model.named_buffers():      # the capture wrote none of them: they are the eager step's
        assert torch.equal(t, got[2][n]), n
    # The compiled step equals eager from the same state (the eager step above moved BN's statistics).
    model.zero_grad()
    _assert_same(_eager(model, x), _step(compiled, model, x), "compiled")
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def test_concurrent_captures_of_one_model():
    """Two threads capture one model at the same time (both inside its forward together)."""
    torch.manual_seed(1)
    model, x = Net(), torch.randn(5, 4)
    params = [(model, [id(p) for p in model.parameters()])]
    both = threading.Barrier(2, timeout=WAIT)
    # Per thread: a list both threads append to would be a container one thread's trace reads while
    # the other writes it (a race by the rules of aotgrad.guards.attribution, as in eager).
    met = threading.local()

    def pause(net):
        if getattr(met, "capturing", False) and not getattr(met, "done", False):
            met.done = True
            assert _traced(net.fc1.weight)
            both.wait()

    def capture():
        met.capturing = True
        return aotgrad.capture(model, x).compile()
    model.pause = pause
    compiled = _join_all([_start(capture) for _ in range(2)])
    # The steps read ``met.capturing`` and ``met.done`` (a ``threading.local``: guarded per thread) as
    # their capturing threads left them; this thread's own values must match for them to run here.
    met.capturing = met.done = True
    _assert_nothing_left(model, params=params)
    for c in compiled:
        model.zero_grad()
        state = copy.deepcopy(model.state_dict())
        expected = _eager(model, x)
        _assert_same(expected, _step(c, model, x), "concurrent capture")
        model.load_state_dict(state)


def test_eager_backward_in_another_thread_while_a_jit_compiles():
    """A backward in one thread while another thread traces a forward is that thread's own: it
    runs (before: 'backward() inside the captured function'), and a backward inside the traced
    forward is still refused."""
    torch.manual_seed(2)
    model, other, x = Net(), Net(), torch.randn(5, 4)
    expected_other = _eager(other, x)
    inside, release, capturer = threading.Event(), threading.Event(), []

    def pause(net):
        if threading.current_thread() in capturer and not inside.is_set():
            inside.set()
            assert release.wait(WAIT)
    model.pause = pause
    jitted = aotgrad.jit(model)

    def first_call():
        capturer.append(threading.current_thread())
        return _step(jitted, model, x)
    expected = _eager(_detached(model), x)
    join = _start(first_call)
    try:
        assert inside.wait(WAIT)
        got_other = _step(other, other, x)     # eager forward and backward, mid-capture
    finally:
        release.set()
        got = join()
    for a, b in zip(expected_other[0], got_other[0]):
        assert torch.equal(a, b)
    for n, g in expected_other[1].items():
        assert torch.equal(g, got_other[1][n])
    _assert_same(expected, got, "jit")
    _assert_nothing_left(model, other)


def _detached(model):
    m = copy.deepcopy(model)
    m.pause = None
    return m


def test_backward_inside_the_traced_forward_is_still_refused_with_other_threads_running():
    class Bad(torch.nn.Module):
        def forward(self, x):
            (x * 2).sum().backward()
            return x

    stop, running = threading.Event(), threading.Event()

    def eager_backwards():
        w = torch.ones(3, requires_grad=True)
        n = 0
        while not stop.is_set():
            (w * 2).sum().backward()
            n += 1
            running.set()
        return n
    join = _start(eager_backwards)
    try:
        assert running.wait(WAIT), "the eager thread never ran a backward"   # the capture overlaps it
        with pytest.raises(aotgrad.errors.UnsupportedError, match="backward\\(\\) inside the captured function"):
            aotgrad.capture(Bad(), torch.randn(3, requires_grad=True))
    finally:
        stop.set()
        assert join() > 0
    _assert_nothing_left()


def test_first_calls_of_one_jit_from_eight_threads_compile_once():
    torch.manual_seed(3)
    model, x = Net(), torch.randn(5, 4)
    model.bn.eval()         # every call reads the same statistics: all eight outputs are eager's
    jitted = aotgrad.jit(model)
    start = threading.Barrier(8, timeout=WAIT)
    expected = _detached(model)(x).detach()

    def call():
        start.wait()
        return jitted(x)
    outs = _join_all([_start(call) for _ in range(8)])
    assert len(jitted.entries) == 1, jitted.explain()
    for out in outs:
        assert_close(expected, out.detach(), "output", 1.3e-6, 1e-5)
    torch.stack(outs).square().sum().backward()
    ref = _detached(model)
    torch.stack([ref(x) for _ in range(8)]).square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(q.grad, p.grad, f"grad of {n}", 1.3e-5, 1e-4)
    _assert_nothing_left(model)


def test_different_jits_with_backward_in_threads():
    """Four models, each jitted and trained a few steps in its own thread, all at once."""
    torch.manual_seed(4)
    models = [Net(width=4 + i) for i in range(4)]
    xs = [torch.randn(5, 4) for _ in models]
    refs = [_detached(m) for m in models]
    start = threading.Barrier(len(models), timeout=WAIT)

    def train(model, x):
        jitted, opt = aotgrad.jit(model), torch.optim.SGD(model.parameters(), lr=0.1)
        start.wait()
        for _ in range(3):
            opt.zero_grad()
            jitted(x).square().sum().backward()
            opt.step()
        return len(jitted.entries)
    joins = [_start(train, m, x) for m, x in zip(models, xs)]
    assert _join_all(joins) == [1] * len(models)
    for ref, x, model in zip(refs, xs, models):
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            ref(x).square().sum().backward()
            opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(q, p.detach(), f"trained {n}", 1e-5, 1e-5)
    _assert_nothing_left(*models)


@pytest.mark.slow
def test_torch_compile_with_aotgrad_from_two_threads():
    torch.manual_seed(5)
    models = [Net(), Net()]
    x = torch.randn(5, 4)
    refs = [_detached(m) for m in models]
    start = threading.Barrier(2, timeout=WAIT)

    def run(model, fn):
        start.wait()
        return _step(fn, model, x)      # Dynamo and aotgrad compile here, in both threads at once
    # torch.compile itself in the main thread: PyTorch's registry loads a backend named by its entry
    # point without a lock (two threads' first lookups of "aotgrad" race to register it).
    compiled = [torch.compile(m, backend="aotgrad") for m in models]
    try:
        got = _join_all([_start(run, m, fn) for m, fn in zip(models, compiled)])
    finally:
        torch._dynamo.reset()
    for ref, g in zip(refs, got):
        _assert_same(_eager(ref, x), g, "torch.compile")
    _assert_nothing_left(*models)


def test_a_captured_module_gets_its_own_dicts_back():
    """A capture stands per-thread views in for a module's parameter and buffer dicts while it
    traces; afterwards the module holds its own dict objects again. A view reads as the real dict in
    any thread holding nothing, writes through to it, and pickles as a plain dict."""
    import pickle
    model = torch.nn.Linear(2, 2)
    own = model._parameters
    aotgrad.capture(model, torch.randn(3, 2))
    assert model._parameters is own and type(own) is dict
    with views.holding([(model.__dict__, "_parameters", "weight", 0)], [torch.randn(2, 2)]):
        d = model._parameters
        got = {}
        _start(lambda: got.update(items=list(d.items()), copy=copy.deepcopy(model), pickled=pickle.dumps(model)))()
        assert isinstance(d, views.View) and d["weight"] is not own["weight"]
        extra = torch.nn.Parameter(torch.ones(1))
        _start(lambda: model.register_parameter("extra", extra))()
        assert own["extra"] is extra
    assert got["items"] == list(own.items())[:2]
    assert type(got["copy"]._parameters) is dict and type(pickle.loads(got["pickled"])._parameters) is dict
    assert model._parameters is own and list(own) == ["weight", "bias", "extra"]


class Layer(torch.nn.Module):
    """A block with a per-layer int (``layer_idx``, unread) and a rendezvous inside its forward."""

    def __init__(self, i):
        super().__init__()
        self.fc, self.layer_idx, self.pause = torch.nn.Linear(4, 4), i, None

    def forward(self, x):
        if self.pause is not None:
            self.pause(self)
        return x + self.fc(x).tanh()


class _Local:
    """A test's callable held by a module: pickled (``torch.save``) and deep-copied as None."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce__(self):
        return type(None), ()


def _paused(model, where, elsewhere=None):
    """``(inside, release, capture)``: ``capture(x, **opts)`` captures ``model`` in the calling thread,
    where the first layer call for which ``where(layer)`` holds sets ``inside`` and waits for
    ``release``; ``elsewhere(layer)`` runs for a call in any other thread."""
    inside, release, capturer = threading.Event(), threading.Event(), []

    def pause(layer):
        if threading.current_thread() not in capturer:
            if elsewhere is not None:
                elsewhere(layer)
        elif where(layer) and not inside.is_set():
            inside.set()
            assert release.wait(WAIT)
    local = _Local(pause)
    for layer in model:
        layer.pause = local

    def capture(x, **opts):
        capturer.append(threading.current_thread())
        return aotgrad.capture(model, x, **opts)
    return inside, release, capture


def test_eager_use_in_another_thread_while_a_block_template_is_traced():
    """While thread A traces a block template (counting which per-layer attributes A reads), the main
    thread runs the model eagerly: same numbers bit for bit, the block's class and every value
    unchanged, ``torch.save`` and ``copy.deepcopy`` (an EMA copy) work and keep the plain class, and
    A's count is not disturbed."""
    torch.manual_seed(2)
    model, x = torch.nn.Sequential(*[Layer(i) for i in range(3)]), torch.randn(5, 4)
    expected = _eager(model, x)
    def elsewhere(layer):
        assert layer.layer_idx in (0, 1, 2)      # a read in this thread, while A watches
    inside, release, capture = _paused(model, reads.watched, elsewhere)
    join = _start(capture, x)
    try:
        assert inside.wait(WAIT), "the capture never traced a template"
        assert type(model[0]) is Layer and model[0].__class__ is Layer and model[0].layer_idx == 0
        buf = io.BytesIO()
        torch.save(model, buf)
        ema = copy.deepcopy(model)
        assert [(type(m), m.pause) for m in ema] == [(Layer, None)] * 3 and not any(map(reads.watched, ema))
        got = _step(model, model, x)
        assert torch.equal(expected[0], got[0])
        assert all(torch.equal(g, got[1][n]) for n, g in expected[1].items())
    finally:
        release.set()
        captured = join()
    assert all(type(layer) is Layer for layer in model) and not any(map(reads.watched, model))
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert [type(layer) for layer in loaded] == [Layer] * 3
    torch.save(ema, io.BytesIO())       # the copy saves after the capture too
    info = next(s.info for s in captured.history if s.name == "trace joint")
    assert info["reused blocks"] == 3       # the eager calls' reads of layer_idx were not counted
    model.zero_grad()
    _assert_same(expected, _step(captured.compile(), model, x), "compiled")


def test_prologue_gathers_what_this_thread_holds():
    """A step's prologue reads parameters with ``dict.__getitem__`` when its thread holds no traced
    values; a thread holding some (a capture running in it) reads those, another thread the real ones."""
    model, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
    match = aotgrad.capture(model, x).compile().path.match
    flat, why = match((x,), {})
    assert why is None and flat[0] is model.weight and flat[1] is model.bias
    held = torch.randn(2, 2, requires_grad=True)
    seen = {}
    with views.holding([(model.__dict__, "_parameters", "weight", 0)], [held]):
        seen["here"] = match((x,), {})[0][0]
        _start(lambda: seen.__setitem__("there", match((x,), {})[0][0]))()
    assert seen["here"] is held and seen["there"] is model.weight
    assert match((x,), {})[0][0] is model.weight


def test_a_parameter_registered_meanwhile_in_another_thread_is_kept():
    """While thread A's capture holds a module's per-thread view, the main thread registers a new
    parameter on the module: it stays registered (A's capture does not take it for its own write,
    undo it and refuse), and A's capture, run again for the changed module, trains as eager does."""
    torch.manual_seed(3)
    model, x = torch.nn.Sequential(*[Layer(i) for i in range(2)]), torch.randn(5, 4)
    inside, release, capture = _paused(model, lambda layer: True)
    join = _start(lambda: capture(x, reuse_blocks=False))
    extra = torch.nn.Parameter(torch.ones(4))
    try:
        assert inside.wait(WAIT), "the capture never ran the forward"
        assert isinstance(model[0].fc._parameters, views.View)
        model[0].fc.register_parameter("extra", extra)
    finally:
        release.set()
        captured = join()
    assert model[0].fc.extra is extra and model[0].fc._parameters["extra"] is extra
    assert _start(lambda: model[0].fc.extra)() is extra
    assert type(model[0].fc._parameters) is dict
    expected = _eager(model, x)
    model.zero_grad()
    got = _step(captured.compile(), model, x)
    _assert_same(expected, got, "compiled")
    assert "0.fc.extra" not in expected[1] and extra.grad is None and got[1].keys() == expected[1].keys()


@pytest.mark.parametrize("change", ["register", "remove"])
def test_a_hook_registered_or_removed_meanwhile_in_another_thread_is_kept(change):
    """While thread A captures the model, the main thread registers a forward hook on one of its
    modules (or removes one): the hook stays as the main thread left it (before: A's capture took
    the change for its own, put the hook dict back and the user's hook was gone, with no error), and
    A's capture, run again for the changed hooks, trains as eager does with them."""
    torch.manual_seed(3)
    model, x = torch.nn.Sequential(*[Layer(i) for i in range(2)]), torch.randn(5, 4)
    old = model[1].fc.register_forward_hook(lambda mod, args, out: out - 1) if change == "remove" else None
    inside, release, capture = _paused(model, lambda layer: True)
    join = _start(lambda: capture(x, reuse_blocks=False))
    try:
        assert inside.wait(WAIT), "the capture never ran the forward"
        if change == "register":
            model[1].fc.register_forward_hook(lambda mod, args, out: out * 3)
        else:
            old.remove()
    finally:
        release.set()
        captured = join()
    assert len(model[1].fc._forward_hooks) == (change == "register")
    expected = _eager(model, x)
    model.zero_grad()
    _assert_same(expected, _step(captured.compile(), model, x), "compiled")


def test_a_module_is_compiled_by_dynamo_after_a_capture():
    """After ``aotgrad.jit`` captured a module, ``torch.compile`` of the same module still makes one
    graph: the per-thread views a capture stands in for its parameter and buffer dicts are gone
    (Dynamo cannot trace a view's ``__getitem__``: it would run the module eagerly, with no graph)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    x = torch.randn(3, 2)
    aotgrad.jit(model)(x)
    graphs = []
    torch._dynamo.reset()
    try:
        torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(x)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


def test_a_jit_compiled_while_another_thread_holds_the_model_sees_later_registrations():
    """The main thread's ``jit`` compiles while thread A holds traced values in the same model (as
    a capture does: the modules' dicts are A's views until A lets go). The jit's guards hold the
    modules' own dicts, not A's views: a parameter registered after A let go (into the module's own
    dict, the views being gone) makes it compile again."""
    torch.manual_seed(5)
    model, x = torch.nn.Sequential(*[Layer(i) for i in range(2)]), torch.randn(5, 4)
    held, release = threading.Event(), threading.Event()

    def hold():
        homes = [(m.fc.__dict__, "_parameters", n, 0) for m in model for n in ("weight", "bias")]
        with views.holding(homes, [torch.zeros(())]):
            held.set()
            assert release.wait(WAIT)
    join = _start(hold)
    step = aotgrad.jit(model)
    try:
        assert held.wait(WAIT)
        assert isinstance(model[1].fc._parameters, views.View)
        expected = _eager(model, x)
        _assert_same(expected, _step(step, model, x), "jit while A holds the model")
        assert isinstance(model[1].fc._parameters, views.View)
    finally:
        release.set()
        join()
    assert type(model[1].fc._parameters) is dict
    model[1].fc.register_parameter("seen", torch.nn.Parameter(torch.zeros(1)))
    model.zero_grad()
    _assert_same(_eager(model, x), _step(step, model, x), "jit after a registration")
    assert len(step.entries) == 2, "the parameter registered after A let go was not seen by the guards"


class _Drawer:
    """A thread that, each time it is asked, draws numbers from torch's global generator (as an
    eager training loop's dropout does) and says when it is done. ``draws``: every number it drew
    (64-bit: a stream rewound under it would repeat some)."""

    def __init__(self):
        self.ask, self.done, self.stop, self.draws = threading.Event(), threading.Event(), False, []
        self.join = _start(self._run)

    def _run(self):
        while True:
            assert self.ask.wait(WAIT)
            self.ask.clear()
            if self.stop:
                return
            self.draws += torch.randint(0, 2 ** 62, (64,)).tolist()
            self.done.set()

    def draw(self):
        """Called in the capturing thread: the other thread draws, meanwhile."""
        self.done.clear()
        self.ask.set()
        assert self.done.wait(WAIT), "the drawing thread did not draw"

    def close(self):
        self.stop = True
        self.ask.set()
        self.join()


@pytest.fixture
def draws_during_analysis(monkeypatch):
    """A :class:`_Drawer` that draws while every capture of the test analyzes its function (the
    capture's RNG check sees the generator moved; it was not the capture)."""
    from aotgrad.capture import capture as capture_module
    monkeypatch.setenv("AOTGRAD_CACHE", "0")       # every compile captures (a disk-cache hit would not)
    drawer, real = _Drawer(), capture_module.analyze

    def analyze(*args, **kwargs):
        drawer.draw()
        return real(*args, **kwargs)
    monkeypatch.setattr(capture_module, "analyze", analyze)
    try:
        yield drawer
    finally:
        drawer.close()


_COMPILERS = {
    "capture": lambda model, x: aotgrad.capture(model, x).compile(),
    "jit": lambda model, x: aotgrad.jit(model),
    "dynamo": lambda model, x: torch.compile(model, backend="aotgrad"),
}


@pytest.mark.parametrize("entry", list(_COMPILERS))
def test_another_threads_draws_during_a_capture_are_its_own(entry, draws_during_analysis):
    """While a capture runs, another thread draws from torch's global generator. The capture is not
    refused for it (before: "the function changed the global RNG while being traced"), and the other
    thread's stream is not put back under it (before: the refusal rewound it, and that thread drew
    the same numbers again)."""
    torch.manual_seed(6)
    torch._dynamo.reset()
    model, x = Net(), torch.randn(5, 4)
    expected = _eager(model, x)
    try:
        _assert_same(expected, _step(_COMPILERS[entry](model, x), model, x), entry)
    finally:
        torch._dynamo.reset()
    draws = draws_during_analysis.draws
    assert draws and len(set(draws)) == len(draws), "the other thread's stream was rewound"
    _assert_nothing_left(model)


def test_a_capture_that_seeds_is_refused_while_another_thread_draws(draws_during_analysis):
    """The capture's own seeding is still told apart from the other thread's draws: its recording saw
    the generator's setter called in the capturing thread (no torch.manual_seed to note it)."""
    def seeds(x):
        torch.default_generator.manual_seed(0)
        return x * 2
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(aotgrad.errors.UnsupportedError, match="calls `torch._C.Generator.manual_seed`.*in seeds"):
        aotgrad.jit(seeds)(x)
    assert draws_during_analysis.draws
