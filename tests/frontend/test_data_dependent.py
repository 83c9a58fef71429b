"""Python reads of a tensor's value (issue #60): LayerDrop's ``torch.rand([]) < p`` branch, BatchNorm with
``momentum=None`` (``1.0 / float(self.num_batches_tracked)``), an ``.item()``-driven branch.

No one graph holds them: which ops run (and, for a random draw, how many numbers the layers after it
draw) is decided per call. ``aotgrad.jit`` hands such a function to ``torch.compile(backend="aotgrad")``
(Dynamo splits its graph at the read and runs it in Python, each piece captured by aotgrad);
``torch.compile`` does so itself; the staged ``capture`` refuses with ``DataDependentError`` naming the
read's line and pointing to them, leaving the module, its buffers and the RNG as they were.
Compared with eager over several training steps: outputs, gradients, parameters and buffers after
each optimizer step, and the global RNG stream after the whole run (a skipped layer's dropout draws
nothing).
"""
import pytest
import torch

import aotgrad
from aotgrad import errors
from tests.eager_check import assert_refused, check, check_usage


class _Layer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(d, d), torch.nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc(x).relu())


class LayerDrop(torch.nn.Module):
    """BART's encoder loop: a layer is skipped when a draw falls under ``p`` (training only)."""

    def __init__(self, p, d=6, n=3):
        super().__init__()
        self.p, self.layers = p, torch.nn.ModuleList(_Layer(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = layer(x)
        return x.pow(2).mean()


class _BN(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(4, 4), norm

    def forward(self, x):
        y = self.norm(self.fc(x) if x.dim() == 2 else self.fc(x.transpose(1, -1)).transpose(1, -1))
        return y.sin().mean()


def _bn1d():
    return _BN(torch.nn.BatchNorm1d(4, momentum=None)), lambda g: (torch.randn(5, 4, generator=g),)


def _bn2d():
    return _BN(torch.nn.BatchNorm2d(4, momentum=None)), lambda g: (torch.randn(2, 4, 3, 3, generator=g),)


def _item_branch():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.sum().item() > 0:         # the branch is decided by the value
                return torch.nn.functional.dropout(y, 0.3).sin().sum()
            return y.cos().sum()
    return M(), lambda g: (torch.randn(3, 4, generator=g),)


def _jit(fn, args, kwargs):
    return aotgrad.jit(fn)


def _dynamo(fn, args, kwargs):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotgrad")


ENTRIES = {"jit": _jit, "dynamo": _dynamo}


def _training(steps, batch, train=True, seed=0):
    """``steps`` SGD steps, each on ``batch(generator)``, the same batches for eager and compiled; keeps
    every loss."""
    def usage(call, model, args, kwargs):
        g = torch.Generator().manual_seed(seed)
        model.train(train)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = call(*batch(g))
            if loss.requires_grad:
                loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return usage


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("seed", [0, 3])
def test_layerdrop_trains_like_eager(entry, p, train, seed):
    def make():
        return LayerDrop(p), (torch.randn(4, 6),), {}
    check_usage(make, _training(4, lambda g: (torch.randn(4, 6, generator=g),), train, seed), compile=ENTRIES[entry])


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("make", [_bn1d, _bn2d, _item_branch])
def test_value_reads_train_like_eager(entry, make):
    def fresh():
        model, batch = make()
        return model, batch(torch.Generator()), {}
    _, batch = make()
    check_usage(fresh, _training(4, batch), compile=ENTRIES[entry])


def _models():
    return {"layerdrop": lambda: (LayerDrop(0.5), lambda g: (torch.randn(4, 6, generator=g),)),
            "bn1d": _bn1d, "bn2d": _bn2d, "item": _item_branch}


READ_LINES = {"layerdrop": "torch.rand([]) < self.p", "bn1d": "y = self.norm(", "bn2d": "y = self.norm(",
              "item": "y.sum().item() > 0"}
READERS = {"bn1d": "batchnorm.py", "bn2d": "batchnorm.py"}     # the library line that read it, in the message


@pytest.mark.parametrize("name", list(READ_LINES))
def test_staged_capture_refuses_naming_the_read_and_where_it_runs(name):
    model, batch = _models()[name]()
    model.train()
    e = assert_refused(model, batch(torch.Generator().manual_seed(0)))
    assert isinstance(e, errors.DataDependentError), repr(e)
    assert READ_LINES[name] in e.user_line, e.user_line
    assert READERS.get(name, "") in str(e), str(e)
    assert "aotgrad.jit" in str(e) and 'torch.compile(backend="aotgrad")' in str(e), str(e)


def test_jit_hands_off_only_where_the_trace_reads_a_value_and_says_so():
    torch._dynamo.reset()       # (a hand-off records the graphs Dynamo compiles in its calls)
    model = LayerDrop(0.5)
    j = aotgrad.jit(model)
    x = torch.randn(4, 6, requires_grad=True)
    model.eval()
    j(x)                                    # eval: `self.training and ...` reads nothing: jit's own graph
    assert len(j.entries) == 1 and j.handoff is None
    model.train()
    with aotgrad.trace() as sink:
        for _ in range(3):
            j(x).backward()
    handed = [e for e in sink.events if e["name"] == "jit hand-off to torch.compile"]
    assert len(handed) == 1 and READ_LINES["layerdrop"] in handed[0]["args"]["reason"], sink.events
    assert len(j.entries) == 1, j.summary()     # the training call was not compiled as an entry of its own
    assert j.handoff is not None and j.handoff.graphs, j.summary()
    assert READ_LINES["layerdrop"] in j.handoff.why.user_line
    assert "torch.compile" in j.summary() and READ_LINES["layerdrop"] in j.summary()
    assert "torch.compile graph 0" in j.program() and "# --- forward" in j.program()
    assert READ_LINES["layerdrop"] in aotgrad.explain(j) and "torch.compile graph 0" in aotgrad.explain(j)
    model.eval()
    graphs = len(j.handoff.graphs)
    j(x)                                    # served by the eval entry again, not by Dynamo
    assert len(j.handoff.graphs) == graphs and len(j.entries) == 1


def test_jit_switching_train_and_eval_trains_like_eager():
    def usage(call, model, args, kwargs):
        g = torch.Generator().manual_seed(5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for train in (False, True, True, False, True):
            model.train(train)
            opt.zero_grad()
            loss = call(torch.randn(4, 6, generator=g))
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out
    check_usage(lambda: (LayerDrop(0.5), (), {}), usage, compile=_jit)


def _whole_step(make_opt, p=0.5):
    """A whole training step (forward, backward, optimizer, zero_grad) over LayerDrop."""
    def make():
        model = LayerDrop(p)
        opt = make_opt(model.parameters())

        def step(x):
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        step.model, step.opt = model, opt
        return step, (), {}
    return make


def _steps(call, fn, args, kwargs):
    """Four steps; keeps the losses, the parameters and the optimizer's state after them."""
    g = torch.Generator().manual_seed(2)
    losses = [call(torch.randn(4, 6, generator=g, requires_grad=True)) for _ in range(4)]
    state = [t.clone() for s in fn.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return losses, [p.detach().clone() for p in fn.model.parameters()], state


@pytest.mark.parametrize("opt", ["SGD", "Adam", "RAdam"])
def test_jit_whole_step_hands_the_step_function_to_dynamo(opt):
    """The read is inside a whole training step (or RAdam's own ``rho_t > 5`` branch): the user's step
    function runs under Dynamo, its optimizer state the user's own, as eager's."""
    make_opt = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
                "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.01)}[opt]
    handed = []
    torch._dynamo.reset()

    def compile(fn, args, kwargs):
        handed.append(aotgrad.jit(fn))
        return handed[-1]
    check_usage(_whole_step(make_opt, 0.5 if opt != "RAdam" else 0.0), _steps, compile=compile)
    assert handed[0].handoff is not None and handed[0].handoff.graphs
    assert "not called yet" not in aotgrad.explain(handed[0]) and "torch.compile graph" in handed[0].program()


@pytest.mark.slow
def test_hf_bart_encoder_layerdrop_trains_like_eager_under_jit():
    """HF BART (tiny random config) training with ``encoder_layerdrop=decoder_layerdrop=0.5``: its
    ``if dropout_probability < self.layerdrop`` skips a layer per call."""
    pytest.importorskip("transformers")
    from tests.models.zoo import _hf, batch_seq2seq

    def make():
        model, args = _hf("BartConfig", "BartForConditionalGeneration", ("input_ids", "labels"), batch_seq2seq,
                          encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=64,
                          max_position_embeddings=16, encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=0.1,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        return model, args, {}

    def usage(call, model, args, kwargs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            opt.zero_grad()
            loss = call(*batch_seq2seq(step))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    jits = []
    check_usage(make, usage, compile=lambda fn, a, k: jits.append(aotgrad.jit(fn)) or jits[-1], atol=1e-4)
    assert jits[0].handoff is not None and "modeling_bart.py" in jits[0].handoff.why.user_line


def test_jit_hand_off_that_dynamo_cannot_run_is_a_typed_refusal():
    """Dynamo's own fake run fails on a view replayed after its base's t_() (as AOTAutograd's would):
    the hand-off raises the read's refusal, typed, with Dynamo's failure as its cause."""
    def f(a):
        out = a * 3
        if out.sum().item() > 0:        # the read jit hands off
            out = out + 1
        v = out.view(9)
        out.t_()
        return v * 2, out
    e = assert_refused(f, (torch.arange(9.0).reshape(3, 3).requires_grad_(),), compile=_jit)
    assert isinstance(e, errors.UnsupportedError) and "torch.compile, which failed too" in str(e), str(e)
    assert "out.sum().item() > 0" in str(e), str(e)


@pytest.mark.parametrize("entry", ENTRIES)
def test_hand_off_across_sizes_grad_modes_and_modes_trains_like_eager(entry):
    """After the hand-off, calls of other batch sizes, under no_grad and in eval keep eager's numbers,
    buffers and RNG stream (Dynamo guards and recompiles them)."""
    def usage(call, model, args, kwargs):
        g = torch.Generator().manual_seed(9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kept = []
        for n, train, grad in ((4, True, True), (6, True, True), (6, True, False), (3, False, True),
                               (8, True, True), (4, True, True)):
            model.train(train)
            opt.zero_grad()
            with torch.set_grad_enabled(grad):
                out = call(torch.randn(n, 4, generator=g))
            if grad:
                out.backward()
                opt.step()
            kept.append(out.detach())
        return kept
    check_usage(lambda: (_Mixed(), (), {}), usage, compile=ENTRIES[entry])


class _Mixed(torch.nn.Module):
    """LayerDrop over layers holding a BatchNorm with momentum=None: two reads per layer."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=None), torch.nn.Dropout(0.3))
            for _ in range(3))

    def forward(self, x):
        x = x.requires_grad_() if torch.is_grad_enabled() else x
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.4:
                continue
            x = layer(x)
        return x.tanh().sum()


def test_jitted_copies_share_dynamo_s_compiled_code():
    """Dynamo's cache keys on the backend callable: every hand-off with the same options uses one, so
    twelve jitted copies of a model (past Dynamo's recompile limit of 8) are still compiled, not run
    eagerly; another option set is another backend."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    copies = [aotgrad.jit(LayerDrop(0.5)) for _ in range(12)]
    for j in copies:
        j(x).backward()
    total = sum(len(j.handoff.graphs) for j in copies)
    assert 0 < total <= 2, total     # (LayerDrop's loop is no graph: Dynamo compiles each layer's body)
    other = aotgrad.jit(LayerDrop(0.5), partitioner="min_cut")
    other(x).backward()
    assert other.handoff.graphs      # compiled again for its own options
