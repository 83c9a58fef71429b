"""The cudagraphs backend's logic, on CPU through the null graph runner:
mutation analysis, static inputs, partitioning, warm-up/record/replay with
a bounded LRU of recordings, output lifetime and the shared memory pool."""
import contextlib
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import aotgrad
from aotgrad.backends import cudagraphs as cg
from aotgrad.backends.cudagraphs.mutation import written_inputs
from aotgrad.backends.cudagraphs.recording import Graphed
from aotgrad.backends.cudagraphs.runners import CaptureFailed, NullRunner
from aotgrad.backends.cudagraphs.segments import segment_ids, why_not_capturable
from aotgrad.backends.cudagraphs.static import static_inputs
from aotgrad.options import CompileOptions
from examples import models
from tests.eager_check import check, check_training


# --- mutation analysis ------------------------------------------------------

def test_mutation_through_list_argument():
    def f(a, b, c):
        torch._foreach_add_([a, b], [c, c])
        return c * 2
    gm = make_fx(f)(torch.ones(2), torch.ones(2), torch.ones(2))
    assert written_inputs(gm) == (0, 1)


def test_mutation_through_a_view_and_a_copy_back():
    def f(x, y, z):
        x.view(-1).add_(1)
        z.copy_(y * 2)         # what functionalization leaves for a mutated input
        return y + 1
    gm = make_fx(f)(torch.ones(2, 2), torch.ones(3), torch.ones(3))
    assert written_inputs(gm) == (0, 2)


def test_functional_graph_writes_nothing():
    gm = make_fx(lambda x: (x.sin() + 1).sum())(torch.ones(3))
    assert written_inputs(gm) == ()


# --- static inputs ----------------------------------------------------------

def test_parameters_and_buffers_are_static():
    m, args = models.make_cnn(batch=2)
    fw = aotgrad.capture(m, *args).compile().forward_graph
    names = [n.name for n in fw.graph.nodes if n.op == "placeholder"]
    found = static_inputs(fw)
    assert {names[i] for i in found} == {n for n in names if n.startswith(("p_", "b_"))}
    assert found and not any(names[i].startswith("input") for i in found)
    assert static_inputs(fw, given=(len(names) - 1,)) == found | {len(names) - 1}


# --- partitioning -----------------------------------------------------------

def test_host_sync_and_data_dependent_shapes_split_the_graph():
    def f(x):
        s = x.sum().item()
        return (x * 2).nonzero(), x + s
    gm = make_fx(f, tracing_mode="fake")(torch.ones(4))
    ids, capturable = segment_ids(gm, "cpu")
    by_name = {n.target.__name__ if callable(n.target) else n.name: ids[n] for n in ids}
    assert not capturable[by_name["_local_scalar_dense.default"]]
    assert not capturable[by_name["nonzero.default"]]
    assert capturable[by_name["sum.default"]] and capturable[by_name["mul.Tensor"]]


def test_cpu_tensor_in_a_cuda_graph_is_not_capturable():
    with FakeTensorMode(allow_non_fake_inputs=True):
        gm = make_fx(lambda x, c: (x + 1, c * 2, x.sin()))(
            torch.empty(3, device="cuda"), torch.empty(3))
    why = {n.name: why_not_capturable(n, "cuda") for n in gm.graph.nodes if n.op == "call_function"}
    assert why["add"] is None and why["sin"] is None
    assert "cpu" in why["mul"]


def test_segmented_graph_runs_like_eager():
    def f(x, w):
        h = (x @ w).relu()
        return h * h.sum().item(), h.cos()
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    run = cg.configure(warmup=0)(gm, [])
    for _ in range(3):
        for got, want in zip(run(x, w), f(x, w)):
            torch.testing.assert_close(got, want)
    graphed = [m.graphed for m in run.top.children() if isinstance(m, cg._Module)]
    assert len(graphed) == 2 and all(g.recordings for g in graphed)


@pytest.mark.parametrize("fn", [
    lambda x, w: torch.nonzero(x > 0).float().sum() * w,
    lambda x, w: torch.masked_select(x, x > 0).sum() * w,
    lambda x, w: (x * w).sum().item() * w.cos(),
], ids=["nonzero", "masked_select", "item"])
def test_data_dependent_programs_run_in_segments(fn):
    check(fn, (torch.randn(6), torch.randn((), requires_grad=True)), calls=3,
          fw_compiler=cg.configure(warmup=0))


# --- warm-up / record / replay ----------------------------------------------

class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def _graphed(fn, written=(), in_place=(), **cfg):
    return Graphed(fn, "g", cg.Config(**cfg), in_place, written, NullRunner)


def test_warmup_then_record_then_replay_on_static_copies():
    fn = Counting(lambda x: (x * 2,))
    g = _graphed(fn, warmup=2)
    x = torch.ones(3)
    inputs = [x * k for k in (1, 2, 3, 4)]      # kept alive: each at its own address
    outs = [g(i)[0] for i in inputs]
    for k, o in zip((1, 2, 3, 4), outs):
        torch.testing.assert_close(o, torch.full((3,), 2. * k))
    (rec,) = g.recordings.values()
    assert rec.calls == 4 and rec.replays == 2
    assert rec.inputs[0] is not x and fn.calls == 4


class FailsToCapture(NullRunner):
    """A runner whose capture fails for inputs of 2 elements (a CUDA capture of an op that syncs):
    it raises before running anything, as a failed CUDA capture records kernels it never runs."""
    def record(self, fn, inputs):
        if inputs[0].numel() == 2:
            raise CaptureFailed(RuntimeError("operation not permitted when stream is capturing"))
        return super().record(fn, inputs)


def test_a_failed_capture_runs_that_shape_without_graphs_and_never_records_it_again():
    fn = Counting(lambda x: (x * 2, x.sum()))
    g = Graphed(fn, "g", cg.Config(warmup=0), (), (), FailsToCapture)
    with pytest.warns(UserWarning, match="could not be recorded.*operation not permitted"):
        out = g(torch.ones(2))
    calls = fn.calls
    for k in range(3):
        torch.testing.assert_close(g(torch.full((2,), float(k)))[0], torch.full((2,), 2. * k))
        torch.testing.assert_close(g(torch.full((3,), float(k)))[1], torch.tensor(3. * k))
    torch.testing.assert_close(out[0], torch.full((2,), 2.))        # not overwritten by later calls
    assert fn.calls == calls + 3 + 3 and g.eager_calls == 4         # 2 elements: eagerly each call
    assert [r is None for r in g.recordings.values()] == [True, False]


def test_in_place_inputs_are_not_copied_and_writes_reach_the_caller():
    def step(p, x):
        x.add_(1)
        return (p * x,)
    p, x = torch.ones(3), torch.zeros(3)
    g = _graphed(step, written=(1,), in_place=(0,), warmup=0)   # no warm-up: x is not seen as stable
    for _ in range(3):
        g(p, x)
    (rec,) = g.recordings.values()
    assert rec.inputs[0] is p and rec.inputs[1] is not x
    torch.testing.assert_close(x, torch.full((3,), 3.))
    p.fill_(5)                                  # an optimizer step, in place
    torch.testing.assert_close(g(p, x)[0], torch.full((3,), 20.))


def test_inputs_at_a_stable_address_are_used_in_place_until_they_move():
    fn = Counting(lambda x: (x * 2,))
    g = _graphed(fn, warmup=1)
    x = torch.ones(3)
    g(x), g(x)                                  # warm-up, record at the same address
    (rec,) = g.recordings.values()
    assert rec.inputs[0].data_ptr() == x.data_ptr()
    x.fill_(3)                                  # new data, same memory: no copy needed
    torch.testing.assert_close(g(x)[0], torch.full((3,), 6.))
    y = torch.full((3,), 4.)                    # moved: recorded again, now copying in
    torch.testing.assert_close(g(y)[0], torch.full((3,), 8.))
    assert rec.inputs[0].data_ptr() not in (x.data_ptr(), y.data_ptr())
    torch.testing.assert_close(g(x)[0], torch.full((3,), 6.))


def _saved_by_a_forward(pool, value):
    """A saved tensor as a backward gets it: handed out in the memory of a forward recorded in ``pool``."""
    fwd = Graphed(lambda a: (a * 1,), "fwd", cg.Config(warmup=0), (), (), NullRunner, pool=pool)
    return fwd, fwd(value)[0]


def _records(g):
    """How many runners ``g`` has made: one per recording."""
    made = [0]
    make = g.make_runner

    def counted():
        made[0] += 1
        return make()
    g.make_runner = counted
    return made


def test_inputs_that_settle_after_recording_are_read_in_place_once():
    """A backward's saved tensors move once (the forward's warm-up ran eagerly, its recording hands out
    recorded memory) and then stay: after ``SETTLED`` replays at one address the shape is recorded once
    more reading them in place. A later move records again copying in, and never promotes again."""
    from aotgrad.backends.cudagraphs.recording import Recording
    fn = Counting(lambda x, t: (x * 2 + t,))
    g = _graphed(fn, warmup=1)
    fwd, x = _saved_by_a_forward(g.pool, torch.ones(3))
    kept = [torch.full((3,), 7.), torch.zeros(3)]
    g(*kept)                                    # warm-up at other addresses: nothing is stable
    (rec,) = g.recordings.values()
    for k in range(Recording.SETTLED + 3):
        x.fill_(k)
        t = torch.full((3,), float(k))          # a new tensor every call (a backward's tangent)
        torch.testing.assert_close(g(x, t)[0], torch.full((3,), 3. * k))
    assert rec.promoted and rec.inputs[0].data_ptr() == x.data_ptr() and rec.inputs[1].data_ptr() != t.data_ptr()
    y = torch.full((3,), 4.)                    # moved: recorded again, copying in
    torch.testing.assert_close(g(y, t)[0], torch.full((3,), 8. + t[0].item()))
    for k in range(Recording.SETTLED + 3):      # settled again: no second promotion
        torch.testing.assert_close(g(x, t)[0], 2 * x + t)
    assert rec.inputs[0].data_ptr() != x.data_ptr()


def test_a_fresh_input_that_sat_at_one_address_moves_out_of_place_alone_and_once():
    """A caching allocator gives a backward's fresh tangent the same address for a while, so it is
    read in place like the saved tensors beside it; when it moves, the shape is recorded again with
    the tangent alone copied in (the saved tensors stay in place), and later moves record nothing."""
    fn = Counting(lambda x, t: (x * 2 + t,))
    g = _graphed(fn, warmup=1)
    records = _records(g)
    fwd, x = _saved_by_a_forward(g.pool, torch.ones(3))
    t = torch.zeros(3)
    for k in range(4):                          # warm-up, record, replays: both at one address
        x.fill_(k)
        t.fill_(10 * k)
        torch.testing.assert_close(g(x, t)[0], torch.full((3,), 12. * k))
    (rec,) = g.recordings.values()
    assert records[0] == 1 and rec.inputs[0].data_ptr() == x.data_ptr() and rec.inputs[1].data_ptr() == t.data_ptr()
    for k in range(6):                          # the tangent moves every call from now on
        x.fill_(k)
        t = torch.full((3,), 5. + k)
        torch.testing.assert_close(g(x, t)[0], 2 * x + t)
    assert records[0] == 2 and not rec.promoted
    assert rec.inputs[0].data_ptr() == x.data_ptr() and rec.inputs[1].data_ptr() != t.data_ptr()


def test_plain_memory_that_settles_after_a_move_is_not_read_in_place():
    """Only memory a recording of the pool holds is promoted: a caller's tensor that moved once and
    then sits still (or an allocator's fresh tensor at a recurring address) stays copied in."""
    fn = Counting(lambda x: (x * 3,))
    g = _graphed(fn, warmup=1)
    records = _records(g)
    a, b = torch.ones(3), torch.full((3,), 2.)
    g(a), g(a)                                  # warm-up and record: a is read in place
    torch.testing.assert_close(g(b)[0], torch.full((3,), 6.))       # moved: recorded again, copying
    for k in range(3 * 3):
        b.fill_(k)
        torch.testing.assert_close(g(b)[0], torch.full((3,), 3. * k))
    (rec,) = g.recordings.values()
    assert records[0] == 2 and not rec.promoted and rec.inputs[0].data_ptr() != b.data_ptr()


@pytest.mark.parametrize("make", ["mlp", "cnn", "gpt_tiny"])
def test_training_past_the_promotion_matches_eager(make):
    made = {"mlp": (models.make_mlp, lambda s: None),
            "cnn": (lambda: models.make_cnn(batch=4), lambda s: models.cnn_batch(batch=4, seed=100 + s)),
            "gpt_tiny": (lambda: models.make_gpt_tiny(batch=2, dropout=0.1),
                         lambda s: models.gpt_batch(models.GPT_TINY, batch=2, seed=100 + s))}[make]
    backend = cg.configure(warmup=1)
    check_training(made[0], steps=7, fw_compiler=backend, batches=None if make == "mlp" else made[1],
                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert any(r.promoted for r in backend.last_compiled().recordings.values())


def test_one_recording_per_shape_bounded_and_warned_once():
    fn = Counting(lambda x: (x + 1,))
    g = _graphed(fn, warmup=0, max_recordings=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (1, 2, 1, 3, 4, 2):
            torch.testing.assert_close(g(torch.zeros(n))[0], torch.ones(n))
    assert len(g.recordings) == 2 and g.eager_calls == 2
    assert len([w for w in caught if "max_recordings" in str(w.message)]) == 1


def test_evict_policy_drops_the_least_recently_used():
    g = _graphed(lambda x: (x + 1,), warmup=0, max_recordings=2, on_full="evict")
    with pytest.warns(UserWarning, match="evict"):
        for n in (1, 2, 1, 3):
            g(torch.zeros(n))
    assert [k[0][0] for k in g.recordings] == [(1,), (3,)]


# --- output lifetime --------------------------------------------------------

def test_outputs_the_user_keeps_are_not_overwritten():
    g = _graphed(lambda x: (x * 2,), warmup=0)
    first = g(torch.ones(2))[0]
    g(torch.full((2,), 5.))
    torch.testing.assert_close(first, torch.full((2,), 2.))


def test_outputs_in_parameter_memory_are_returned_as_they_are():
    p = torch.ones(3)
    g = _graphed(lambda p, x: (p.view(3), p * x), in_place=(0,), warmup=0)
    g(p, torch.ones(3))
    out, _ = g(p, torch.ones(3))
    assert out.data_ptr() == p.data_ptr()


@pytest.mark.parametrize("warmup,calls,forwards", [(0, 1, 2), (1, 6, 3)])
def test_two_forwards_then_backwards_use_each_forwards_own_saved_tensors(warmup, calls, forwards):
    """Each later forward moves the earlier ones' saved tensors; with a warm-up, the calls before reach the
    backward's promotion (its saved tensors read in place), so the moved ones are read where they now are."""
    m, args = models.make_mlp()
    compiled = aotgrad.capture(m, *args).compile(fw_compiler=cg.configure(warmup=warmup))
    for _ in range(calls):                      # warm-up, record, replays (and the backward's promotion)
        compiled(*args).backward()
    m.zero_grad()
    xs = [torch.randn_like(args[0]) for _ in range(forwards)]
    outs = [compiled(x, args[1]) for x in xs]
    for o in reversed(outs):
        o.backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    for x in xs:
        m(x, args[1]).backward()
    for got, want in zip(grads, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(got, want)


def test_a_replay_of_another_shape_in_the_pool_moves_saved_tensors_it_may_overwrite():
    """Only a replay of a recording captured earlier in the pool (or the same one) can write
    over a saved tensor: that one moves it to a copy first, a later one leaves it where it is."""
    g = _graphed(lambda x: (x * 2, x + 1), warmup=0)
    a, b = torch.ones(2), torch.ones(3)
    g(a)                                        # recording 1
    _, saved_b = g(b)                           # recording 2: handed out in its memory
    at, version = saved_b.data_ptr(), saved_b._version
    g(torch.zeros(3))                           # recording 2 again: saved_b moves
    assert saved_b.data_ptr() != at and saved_b._version == version
    torch.testing.assert_close(saved_b, torch.full((3,), 2.))
    _, saved_a = g(a)
    at = saved_a.data_ptr()
    g(b)                                        # recording 2, captured after recording 1
    assert saved_a.data_ptr() == at


# What a caller may keep of an output across later replays, and how it reads it back.
KEPT = {
    "the tensor": (lambda out: out, lambda k: k),
    "a view beside it": (lambda out: (out, out[1:]), lambda k: torch.cat([k[0][:1], k[1]])),
    "a view alone": (lambda out: out.view(2, 2), lambda k: k.reshape(-1)),
    "its storage alone": (lambda out: out.untyped_storage(), lambda k: torch.empty(0).set_(k)),
    "a view written in place": (lambda out: out[1:].mul_(10), lambda k: torch.cat([k[:1] * 0 + 2, k])),
}


@pytest.fixture(params=["exchange", "copy"])
def exchange(request, monkeypatch):
    """Both ways an output leaves recorded memory: its storage given a copy when a replay would write
    over it, or (a torch without that exchange) a copy at once."""
    if request.param == "copy":
        monkeypatch.setattr(cg.runners, "swap_storage_memory", None)
    return request.param


@pytest.mark.parametrize("kept", sorted(KEPT))
@pytest.mark.parametrize("drop", [None, "evicted", "recorded again"])
def test_what_the_caller_keeps_of_an_output_outlives_replays_and_its_recording(kept, drop, exchange):
    """Kept, viewed, written in place, or held by its storage alone: later replays of its recording
    and of one captured before it, and the recording dropped (evicted, or recorded again for a moved
    input) with its memory reused, leave the caller's values as they were."""
    keep, read = KEPT[kept]
    g = _graphed(lambda p, x: (p[:len(x)] * x * 2, x + 1), warmup=1,
                 max_recordings=1 if drop == "evicted" else 8, on_full="evict")
    p = torch.ones(4)
    for x in (torch.ones(3), torch.ones(3), torch.ones(4)):    # shape 3 captured first (its replays may write
        g(p, x)                                                 # over later recordings), shape 4 warmed up
    k = keep(g(p, torch.ones(4))[0])                            # captured: handed out in its memory
    want = read(k).clone()
    torch.testing.assert_close(want, torch.tensor([2., 20, 20, 20]) if "written" in kept else torch.full((4,), 2.))
    first = []
    if drop == "recorded again":
        p = torch.full((4,), 3.)                                # a stable input moved: shape 4 recorded again
        first = [torch.full((4,), 5.)]
    elif drop == "evicted":
        first = [torch.ones(3), torch.ones(3)]                  # shape 4's recording evicted, shape 3 captured
    for x in first + [torch.full((4,), 5.), torch.ones(3), torch.full((4,), 7.)]:
        fresh = g(p, x)[0]
        torch.testing.assert_close(fresh, p[:len(x)] * x * 2)
        torch.testing.assert_close(read(k), want)
    filler = [torch.full((4,), -1.) for _ in range(64)]         # memory a dropped recording freed is reused
    torch.testing.assert_close(read(k), want)
    assert filler


def test_outputs_dropped_before_the_next_replay_are_not_copied(exchange):
    """A training step that lets go of its outputs (the loss, the gradients set to None) before the next
    call gets them in recorded memory, step after step: nothing is copied out."""
    m, args = models.make_mlp()
    backend = cg.configure(warmup=0)
    compiled = aotgrad.capture(m, *args).compile(fw_compiler=backend)
    for _ in range(5):
        loss = compiled(*args)
        loss.backward()
        pool = backend.last_compiled().pool
        in_recorded_memory = [pool.holds(t) for t in (loss, *(p.grad for p in m.parameters()))]
        assert in_recorded_memory == [exchange == "exchange"] * len(in_recorded_memory)
        del loss
        m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("form", ["accumulated", "retain_graph", "hooks keep views"])
def test_outputs_and_saved_tensors_kept_across_replays_train_like_eager(form, exchange):
    """Gradients accumulated in place over micro-batches (zero_grad(set_to_none=False)), a backward run
    twice (retain_graph), and saved tensors a pack hook keeps as views, two forwards before their
    backwards: what is kept moves out of recorded memory before a replay writes there."""
    m, args = models.make_mlp()
    compiled = aotgrad.capture(m, *args).compile(fw_compiler=cg.configure(warmup=0))
    hooks = (lambda t: t[...], lambda t: t) if form == "hooks keep views" else None

    def run(f):
        torch.manual_seed(0)
        xs = [torch.randn_like(args[0]) for _ in range(3)]
        for p in m.parameters():
            p.grad = None
        context = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
        with context:
            outs = [f(x, args[1]) for x in xs[:2]]
        if form == "retain_graph":
            outs[0].backward(retain_graph=True)
            f(xs[2], args[1])
            outs[0].backward()
        else:
            for o in reversed(outs):
                o.backward()
                f(xs[2], args[1])
        return [o.detach().clone() for o in outs], [p.grad.clone() for p in m.parameters()]

    run(compiled)                                               # record, so later calls replay
    got, want = run(compiled), run(m)
    torch.testing.assert_close(got, want)


def test_forward_and_backward_share_one_pool():
    m, args = models.make_mlp()
    c = aotgrad.capture(m, *args).compile()
    backend = cg.configure()

    def examples(gm):
        return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fw1, bw1 = backend(c.forward_graph, examples(c.forward_graph)), backend(c.backward_graph, examples(c.backward_graph))
    fw2 = backend(c.forward_graph, examples(c.forward_graph))
    assert fw1.pool is bw1.pool and bw1.forward is fw1 and fw2.pool is not fw1.pool


# --- whole programs, compared with eager --------------------------------------

def test_mlp_matches_eager_while_replaying():
    m, args = models.make_mlp()
    backend = cg.configure(warmup=0)
    check(m, args, calls=4, fw_compiler=backend)
    (rec,) = backend.last_compiled().recordings.values()
    assert rec.replays == 1     # the backward ran on its recording


def test_cnn_batchnorm_dropout_trains_like_eager():
    backend = cg.configure(warmup=1)
    check_training(lambda: models.make_cnn(batch=4), steps=4, fw_compiler=backend,
                   batches=lambda step: models.cnn_batch(batch=4, seed=100 + step))
    (rec,) = backend.last_compiled().recordings.values()
    assert rec.calls == 4 and rec.replays == 3      # warm-up, record, two replays


def test_gpt_tiny_trains_like_eager_with_adamw():
    check_training(lambda: models.make_gpt_tiny(batch=2, dropout=0.1), steps=3,
                   fw_compiler=cg.configure(warmup=1),
                   batches=lambda step: models.gpt_batch(models.GPT_TINY, batch=2, seed=100 + step),
                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def test_dynamic_shapes_get_one_recording_each_up_to_the_bound():
    w = torch.randn(4, 5, requires_grad=True)

    def f(x, w):
        return (x @ w).relu().sum()
    backend = cg.configure(warmup=0, max_recordings=2)
    compiled = aotgrad.capture(f, torch.randn(3, 4), w, dynamic=True).compile(fw_compiler=backend)
    with pytest.warns(UserWarning, match="max_recordings"):
        for n in (3, 5, 3, 7):
            x = torch.randn(n, 4)
            torch.testing.assert_close(compiled(x, w), f(x, w))
    fw = backend.last_compiled().forward
    assert len(fw.recordings) == 2 and fw.eager_calls == 1


def test_a_backward_pairs_only_with_its_own_forward():
    m, args = models.make_mlp()
    c = aotgrad.capture(m, *args).compile()
    other = aotgrad.capture(models.make_mlp()[0], *args).compile()
    backend = cg.configure()

    def examples(gm):
        return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fw = backend(other.forward_graph, examples(other.forward_graph))
    bw = backend(c.backward_graph, examples(c.backward_graph))
    assert bw.forward is None and bw.pool is not fw.pool


def test_bad_options_are_named():
    with pytest.raises(aotgrad.errors.AotgradError, match="on_full='drop'"):
        cg.configure(on_full="drop")


# --- options through CompileOptions ---------------------------------------------

def _bounded_shapes(make_compiled):
    """Calls at three shapes under ``max_recordings=2``: the third runs eagerly, with a warning."""
    w = torch.randn(4, 5, requires_grad=True)

    def f(x, w):
        return (x @ w).relu().sum()
    compiled = make_compiled(f, torch.randn(3, 4), w)
    with pytest.warns(UserWarning, match="max_recordings"):
        for n in (3, 5, 7):
            x = torch.randn(n, 4)
            out = compiled(x, w)
            torch.testing.assert_close(out, f(x, w))
            out.backward()


def test_cudagraphs_options_reach_the_compiler_through_compile_options():
    opts = CompileOptions(fw_compiler="cudagraphs", cudagraphs={"warmup": 0, "max_recordings": 2})
    _bounded_shapes(lambda f, *args: aotgrad.capture(f, *args, dynamic=True).compile(options=opts))


def test_cudagraphs_options_reach_the_compiler_through_jit():
    _bounded_shapes(lambda f, *args: aotgrad.jit(f, dynamic=True, fw_compiler="cudagraphs",
                                                 cudagraphs={"warmup": 0, "max_recordings": 2}))


def test_configured_forward_and_backward_share_one_compiler_and_match_eager():
    m, args = models.make_mlp()
    fw_c, bw_c = aotgrad.backends.compilers(CompileOptions(fw_compiler="cudagraphs", cudagraphs={"warmup": 0}))
    assert fw_c is bw_c and fw_c is not cg.cudagraphs and fw_c.config == cg.Config(warmup=0)
    check(m, args, calls=3, options=CompileOptions(fw_compiler="cudagraphs", cudagraphs={"warmup": 0}))


@pytest.mark.parametrize("given, message", [
    (dict(fw_compiler="cudagraphs", cudagraphs={"max_recording": 4}), "did you mean max_recordings=4"),
    (dict(fw_compiler="cudagraphs", cudagraphs={"on_full": "drop"}), "on_full='drop'"),
    (dict(fw_compiler="cudagraphs", cudagraphs={"warmup": -1}), "warmup >= 0"),
    (dict(fw_compiler="cudagraphs", cudagraphs={"warmup": True}), "warmup >= 0"),
    (dict(fw_compiler="cudagraphs", cudagraphs=4), "give a dict"),
    (dict(fw_compiler="inductor", cudagraphs={"warmup": 0}), "neither fw_compiler='inductor'"),
])
def test_cudagraphs_options_are_checked_when_given(given, message):
    with pytest.raises(aotgrad.errors.OptionError, match=message):
        CompileOptions(**given)
    with pytest.raises(aotgrad.errors.OptionError, match=message):
        aotgrad.jit(lambda x: x, **given)
    with pytest.raises(aotgrad.errors.OptionError, match=message):
        aotgrad.backend(**given)


def test_cudagraphs_options_are_part_of_the_cache_key():
    from aotgrad.guards import cache
    base = CompileOptions(fw_compiler="cudagraphs")
    small = CompileOptions(fw_compiler="cudagraphs", cudagraphs={"max_recordings": 2})
    assert cache._options(base) != cache._options(small)
    assert cache._options(small) == cache._options(CompileOptions(fw_compiler="cudagraphs",
                                                                   cudagraphs=cg.Config(max_recordings=2)))


def test_null_runner_replay_writes_over_later_recordings_in_its_pool():
    """As a GPU replay may through its temporaries, so the CPU tests see a saved tensor or output
    left in recorded memory that a replay of an earlier recording reuses."""
    from aotgrad.backends.cudagraphs.runners import Pool
    pool = Pool()
    first, second, other = NullRunner(pool), NullRunner(pool), NullRunner(Pool())
    first.record(lambda x: (x * 2,), [torch.ones(2)])
    later = second.record(lambda x: (x + 1, x > 0, x.long()), [torch.ones(3)])
    elsewhere = other.record(lambda x: (x + 1,), [torch.ones(3)])
    second.replay()                             # its own outputs are recomputed, nothing else
    torch.testing.assert_close(first.outputs[0], torch.full((2,), 2.))
    first.replay()
    assert later[0].isnan().all() and not later[1].any() and (later[2] != 1).all()
    torch.testing.assert_close(elsewhere[0], torch.full((3,), 2.))      # another pool: untouched
    torch.testing.assert_close(first.outputs[0], torch.full((2,), 2.))
