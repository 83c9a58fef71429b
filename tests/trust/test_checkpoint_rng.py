"""Activation checkpointing and randomness inside captured code, next to eager.

Every program runs eagerly and compiled under each entry point from the same seed; the
compiled run must give eager's outputs and gradients (so eager's dropout masks) and leave
the global RNG exactly where eager leaves it, after the forward and after the backward.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import aotgrad
from aotgrad.ir.ops import is_random
from aotgrad.errors import UnsupportedError
from tests.eager_check import as_is, check


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _capture(**options):
    def compile(fn, args, kwargs, **opts):
        captured = aotgrad.capture(fn, *args, **kwargs)
        aotgrad.verify(captured)
        return captured.compile(**options)
    return compile


ENTRIES = {
    "capture": _capture(),
    "min_cut": _capture(partitioner="min_cut"),
    "jit": lambda fn, args, kwargs, **opts: aotgrad.jit(fn),
    "torch.compile": lambda fn, args, kwargs, **opts: torch.compile(fn, backend="aotgrad"),
}


def block(x, w):
    return F.dropout((x @ w).tanh(), 0.5, True)


def fused_block(x, w):
    """``block`` with CUDA's dropout kernel (``native_dropout``: the mask is drawn from the input's
    own node, not from an ``empty_like``), which the CPU runs when called by name."""
    return torch.native_dropout((x @ w).tanh(), 0.5, True)[0]


def _save_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


SAC_POLICY = functools.partial(create_selective_checkpoint_contexts, _save_mm)
SAC_LIST = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])


class RandomBackward(torch.autograd.Function):
    """Its backward draws fresh numbers: from the RNG as it stands at backward(), not the forward's."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * torch.rand_like(g)


def forked_then_redrawn(x, w):
    with torch.random.fork_rng():
        a = F.dropout(x @ w, 0.5)
    return a + F.dropout(x @ w, 0.5)      # eager: the same mask again


def forked_only(x, w):
    with torch.random.fork_rng():
        a = F.dropout(x @ w, 0.5)
    return a * 2                           # eager: the RNG ends where it started


PROGRAMS = {
    "two regions, one shape": lambda x, w1, w2: checkpoint(
        block, checkpoint(block, x, w1, use_reentrant=False), w2, use_reentrant=False).sum(),
    "two regions, two shapes": lambda x, w1, w2: checkpoint(
        block, checkpoint(block, x, w1[:, :6], use_reentrant=False), w2[:6], use_reentrant=False).sum(),
    "one region": lambda x, w1, w2: (checkpoint(block, x, w1, use_reentrant=False) @ w2).sum(),
    "dropout outside and inside": lambda x, w1, w2: checkpoint(
        block, F.dropout(x, 0.3), w1, use_reentrant=False).sum() + F.dropout(w2, 0.2).sum(),
    "preserve_rng_state=False": lambda x, w1, w2: (
        checkpoint(block, x, w1, use_reentrant=False, preserve_rng_state=False) @ w2).sum(),
    "selective, policy function": lambda x, w1, w2: (
        checkpoint(block, x, w1, use_reentrant=False, context_fn=SAC_POLICY) @ w2).sum(),
    "selective, op list": lambda x, w1, w2: checkpoint(
        block, checkpoint(block, x, w1, use_reentrant=False, context_fn=SAC_LIST), w2,
        use_reentrant=False, context_fn=SAC_LIST).sum(),
    # The recomputed input is tanh(detach(mm)): SAC hands the saved mm back detached.
    "selective, fused dropout": lambda x, w1, w2: (
        checkpoint(fused_block, x, w1, use_reentrant=False, context_fn=SAC_POLICY) @ w2).sum(),
    "two regions, fused dropout": lambda x, w1, w2: checkpoint(
        fused_block, checkpoint(fused_block, x, w1, use_reentrant=False), w2, use_reentrant=False).sum(),
    "custom backward draws": lambda x, w1, w2: (RandomBackward.apply(F.dropout(x @ w1, 0.5)) @ w2).sum(),
    "fork_rng, then redrawn": lambda x, w1, w2: forked_then_redrawn(x, w1).sum() * w2.sum(),
    "fork_rng only": lambda x, w1, w2: forked_only(x, w1).sum() * w2.sum(),
}


def args():
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(*s, generator=g, requires_grad=True) for s in ((4, 8), (8, 8), (8, 8)))


def rng_after(fn, inputs, seed=0):
    """The global RNG after the forward and after the backward, from one seed."""
    torch.manual_seed(seed)
    out = fn(*inputs)
    after_forward = torch.get_rng_state()
    out.backward()
    return after_forward, torch.get_rng_state()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("program", PROGRAMS)
def test_matches_eager_with_eager_rng(program, entry):
    fn = PROGRAMS[program]
    check(fn, args(), compile=ENTRIES[entry])
    torch._dynamo.reset()
    eager = rng_after(fn, args())
    compiled = rng_after(ENTRIES[entry](fn, args(), {}), args())
    assert torch.equal(eager[0], compiled[0]), "RNG after the forward differs from eager's"
    assert torch.equal(eager[1], compiled[1]), "RNG after the backward differs from eager's"


@pytest.mark.parametrize("program", ["custom backward draws", "fork_rng, then redrawn", "fork_rng only"])
def test_compiled_autograd_rng(program):
    """The backward of a jit-compiled program, captured by compiled autograd."""
    from aotgrad.compiled_autograd import reset
    reset()
    fn = PROGRAMS[program]
    check(aotgrad.jit(fn), args(), compile=as_is, backward_context=lambda: aotgrad.compiled_autograd("eager"))


def test_one_region_draws_once_and_saves_no_recomputed_value():
    run = check(PROGRAMS["one region"], args())
    fw, bw = run.compiled.forward_graph.graph, run.compiled.backward_graph.graph
    assert sum(map(is_random, fw.nodes)) == 1, "the compiled forward draws the mask more than once"
    assert not any(map(is_random, bw.nodes)), "the backward draws a mask eager replays"
    recomputed = {n.name for n in bw.nodes if n.op == "call_function"}
    saved = [n.name for n in fw.output_node().args[0] if isinstance(n, torch.fx.Node)]
    assert not {"tanh", "mm"} & set(saved), f"the region is saved: {saved}"
    assert any(name.startswith("tanh") for name in recomputed), "the region is not recomputed"


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.lin(x).relu(), 0.3, True)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = Inner(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.inner, x, use_reentrant=False)).sum()


@pytest.mark.parametrize("entry", ENTRIES)
def test_checkpointed_submodule(entry):
    torch.manual_seed(0)
    check(Outer(), (torch.randn(4, 8, requires_grad=True),), compile=ENTRIES[entry])


def test_restoring_a_state_from_outside_is_refused():
    outside = torch.get_rng_state()

    def f(x):
        torch.set_rng_state(outside)
        return F.dropout(x, 0.5)
    with pytest.raises(UnsupportedError, match="set_rng_state") as e:
        aotgrad.capture(f, torch.randn(4, requires_grad=True))
    assert "test_checkpoint_rng.py" in str(e.value)


def test_redrawing_a_forked_state_differently_is_refused():
    def f(x):
        with torch.random.fork_rng():
            a = F.dropout(x, 0.5)
        return a + torch.rand(4)           # eager: the uniform numbers behind a's mask
    with pytest.raises(UnsupportedError, match="already drew") as e:
        aotgrad.capture(f, torch.randn(4, requires_grad=True))
    assert "torch.rand(4)" in str(e.value)


# --- a GPT whose blocks are checkpointed, trained next to eager ------------------------------

GPT_CKPT = dict(n_layer=2, n_head=2, d_model=32, vocab=64, block_size=16, dropout=0.1)


def make_checkpointed_gpt():
    from dataclasses import replace

    from examples import models

    class CheckpointedGPT(models.GPT):
        def forward(self, idx, targets):
            x = self.drop(self.tok_emb(idx) + self.pos_emb[:, :idx.size(1)])
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    cfg = replace(models.GPT_TINY, **GPT_CKPT)
    torch.manual_seed(0)
    return CheckpointedGPT(cfg).train(), models.gpt_batch(cfg, 2, seed=0)


def _jit_with_compiled_autograd_backward(model, args, kwargs, **opts):
    from aotgrad.compiled_autograd import reset
    reset()
    return aotgrad.jit(model)


GPT_ENTRIES = {**{k: ENTRIES[k] for k in ("capture", "jit", "torch.compile")},
               "compiled_autograd": _jit_with_compiled_autograd_backward}


@pytest.mark.parametrize("entry", GPT_ENTRIES)
def test_checkpointed_gpt_trains_like_eager(entry):
    """Five SGD steps, one seed per step: loss, every gradient and parameter exactly eager's,
    and the RNG after each forward and each backward where eager leaves it."""
    eager, batch = make_checkpointed_gpt()
    model, _ = make_checkpointed_gpt()
    compiled = GPT_ENTRIES[entry](model, batch, {})
    backward_context = (lambda: aotgrad.compiled_autograd("eager")) if entry == "compiled_autograd" else None
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(5):
        states = []
        for fn, opt, ctx in ((eager, opts[0], None), (compiled, opts[1], backward_context)):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = fn(*batch)
            after_forward = torch.get_rng_state()
            if ctx is None:
                loss.backward()
            else:
                with ctx():
                    loss.backward()
            states.append((loss.detach(), after_forward, torch.get_rng_state()))
        (le, fe, be), (lc, fc, bc) = states
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6, msg=f"loss at step {step}")
        assert torch.equal(fe, fc) and torch.equal(be, bc), f"RNG differs from eager's at step {step}"
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=f"grad of {name} at step {step}")
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("program", ["two regions, one shape", "fork_rng only"])
def test_inductor_backend_keeps_eager_rng(program):
    """Inductor compiles the checkpointed program; a graph that restores the RNG state runs eagerly."""
    fn = PROGRAMS[program]
    inductor = _capture(fw_compiler="inductor")
    check(fn, args(), compile=inductor)
    eager, compiled = rng_after(fn, args()), rng_after(inductor(fn, args(), {}), args())
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_eager_checkpoint_under_compiled_autograd_is_refused_by_name():
    """An eager forward's checkpoint recomputes through saved-tensor hooks at backward time,
    which compiled autograd does not capture: a typed error naming checkpoint and the line."""
    from aotgrad.compiled_autograd import reset
    reset()
    x, w1, w2 = args()
    loss = PROGRAMS["one region"](x, w1, w2)
    with pytest.raises(UnsupportedError, match="torch.utils.checkpoint") as e:
        with aotgrad.compiled_autograd("eager"):
            loss.backward()
    assert "test_checkpoint_rng.py" in str(e.value)


@pytest.mark.parametrize("entry", ["capture", "jit"])
@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_dropout_masks_fill_the_input_layout_like_eager(entry, layout):
    """Eager fills ``empty_like(x).bernoulli_(p)`` in x's memory order; the functional op the
    graph holds fills a contiguous tensor, so the graph must draw on x's layout."""
    if layout == "transposed":
        x = torch.randn(8, 6).t().requires_grad_()
    else:
        x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    fn = lambda x: checkpoint(lambda a: F.dropout(a.sin(), 0.4, True), x, use_reentrant=False) * 2
    check(fn, (x,), compile=ENTRIES[entry])


def test_recomputation_that_draws_differently_is_refused():
    """A region whose recomputation draws other numbers than its forward from the restored
    state (it branches on running inside the autograd engine) cannot be replayed."""
    def region(x):
        if torch._C._current_graph_task_id() != -1:     # recomputing, inside the autograd engine
            x = x + torch.rand_like(x)
        return F.dropout(x.sin(), 0.5)

    with pytest.raises(UnsupportedError, match="recomputes differently") as e:
        aotgrad.capture(lambda x: checkpoint(region, x, use_reentrant=False).sum(), torch.randn(4, requires_grad=True))
    assert "rand_like" in str(e.value)
