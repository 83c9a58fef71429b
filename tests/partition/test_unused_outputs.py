"""An output no gradient reaches (a language model's logits, returned beside its loss): autograd hands
the compiled backward no zeros for it, and the backward makes them only where it reads them
(``passes.zero_tangents``). Gradients stay eager's, and a step's peak is no higher than eager's:
before, the zeros (logits-sized) lived through the whole backward, its peak included."""
import contextlib

import pytest
import torch

import aotgrad
from aotgrad.partition import measure_peak
from tests.eager_check import check_usage
from tests.models import zoo


class LossAndLogits(torch.nn.Module):
    """A causal LM returning what a training loop gets: the loss, and the logits beside it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        out = self.model(input_ids=ids, labels=ids)
        return out.loss, out.logits


def _llama(vocab=zoo.VOCAB, seq=zoo.SEQ):
    import transformers
    zoo.import_torchvision()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=seq, tie_word_embeddings=True,
                                      attn_implementation="sdpa")
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    return LossAndLogits(transformers.LlamaForCausalLM(config)), ids


def _saved_bytes(step, model, ids) -> int:
    """Bytes the step saves for its backward (saved_tensors_hooks), each storage once, inputs excluded."""
    external = {t.untyped_storage().data_ptr() for t in [*model.parameters(), ids]}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in external:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def test_llama_step_with_unused_logits_peaks_no_higher_than_eager():
    model, ids = _llama(vocab=2048, seq=64)      # logits: 1 MiB, most of the step's memory
    compiled = aotgrad.capture(model, ids).compile()
    measured = {}
    for name, f in (("eager", model), ("aotgrad", compiled)):
        def step():
            loss, _ = f(ids)
            loss.backward()
            for p in model.parameters():
                p.grad = None
        step()          # warm up: first-call allocations are not the step's
        measured[name] = _saved_bytes(step, model, ids), measure_peak(step)
    (eager_saved, eager_peak), (saved, peak) = measured["eager"], measured["aotgrad"]
    assert saved <= eager_saved and peak <= eager_peak, measured


def _loss(out):
    out[0].backward()


def _logits(out):
    out[1].float().square().mean().backward()


def _both(out):
    (out[0] + out[1].float().mean()).backward()


@pytest.mark.parametrize("backward", [_loss, _logits, _both])
def test_llama_gradients_whichever_outputs_are_differentiated(backward):
    def usage(call, fn, args, kwargs):
        kept = []
        for _ in range(2):      # the second call runs the backward made for the first's missing tangents
            out = call(*args)
            backward(out)
            kept += [t.detach() for t in out]
        return kept
    def make():
        model, ids = _llama()
        return model, (ids,), {}
    check_usage(make, usage)


def _two_outputs(x, w):
    y = (x @ w).tanh()
    return y.log_softmax(-1).sum(), y * 2


def _small():
    return _two_outputs, (torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)), {}


@pytest.mark.parametrize("where", ["inductor", "compiled_autograd"])
def test_missing_tangent_through_inductor_and_compiled_autograd(where):
    """Inductor compiles the backward without the tangent on first need; compiled autograd, which
    traces the backward graph itself, makes the zeros in its own graph."""
    def usage(call, fn, args, kwargs):
        out = call(*args)
        with aotgrad.compiled_autograd() if where == "compiled_autograd" and call is not fn else contextlib.nullcontext():
            out[0].backward()
        return out[0].detach()
    opts = {"fw_compiler": "inductor"} if where == "inductor" else {}
    check_usage(_small, usage, **opts)


# ---------------------------------------------------------------- gradients no used output reaches
# An input whose every path to the loss goes through outputs the loss does not use: eager's backward never
# reaches it, so its .grad stays None (not zeros) and an optimizer skips it (AdamW's weight decay and moments
# would move it otherwise). The compiled backward makes those gradients None.

class Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)
        self.c = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.trunk(x).tanh()
        # a: the trunk and a; b: the trunk, b and c; the zero term keeps c on a's path (eager: zeros)
        return self.a(h) + 0 * self.c, self.b(h) * self.c[:2].sum()


ENTRIES = {"capture": lambda m, x: aotgrad.capture(m, x).compile(),
           "jit": lambda m, x: aotgrad.jit(m),
           "torch.compile": lambda m, x: torch.compile(m, backend="aotgrad"),
           "inductor": lambda m, x: aotgrad.capture(m, x).compile(fw_compiler="inductor")}
# Which outputs each step's loss uses: one head, the other, both, then one again (a backward per pattern).
USES = ((0,), (1,), (0, 1), (0,))


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_unreached_gradients_are_none_and_adamw_skips_them(entry):
    torch._dynamo.reset()
    eager, model = Heads(), Heads()
    compiled = ENTRIES[entry](model, torch.randn(5, 4))
    hooked = {"eager": [], "compiled": []}
    eager.b.weight.register_hook(lambda g: hooked["eager"].append(g is not None))
    model.b.weight.register_hook(lambda g: hooked["compiled"].append(g is not None))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (eager, model)]
    for step, uses in enumerate(USES):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for f, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            outs = f(x)
            sum(outs[i].sum() for i in uses).backward()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert (p.grad is None) == (q.grad is None), (entry, step, name, p.grad, q.grad)
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
        for opt in opts:
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=f"{entry} step {step} {name}")
    # Eager runs the hook on the steps whose loss uses head b; the compiled node, which has an edge to b
    # whatever the loss uses, runs it on every step, with None where eager's does not run (as for a custom
    # Function whose backward returns None for an input)
    assert hooked["eager"] == [True, True]
    assert [g for g in hooked["compiled"] if g] == hooked["eager"] and len(hooked["compiled"]) == len(USES)
    torch._dynamo.reset()
