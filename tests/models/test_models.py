"""Real models (tiny HuggingFace and timm configs, random init) trained 3 SGD steps with dropout on
next to eager under each entry point: losses, gradients and parameters after every step match.
``make test`` runs GPT-2 and ResNet-18 under the entry points that compile quickly (compiled
autograd takes ~40 s a model on a loaded two-core machine); ``make test-models`` runs all."""
import pytest
import torch

import aotgrad
from tests.eager_check import check, check_training
from tests.models import zoo
from tests.models.entries import ENTRIES

QUICK = {("gpt2", "capture"), ("gpt2", "jit"), ("gpt2", "torch.compile"), ("resnet18", "capture"),
         ("resnet18", "jit")}
# Refused with a typed error today; strict, so a fix shows up. (torch 2.15's GroupedMmBackward0 runs on them.)
REFUSED = {("mixtral", "compiled_autograd"): "compiled autograd cannot run GroupedMmBackward0 (torch._grouped_mm's "
                                              "backward) on fake float32 CPU tensors: it asks for bf16"
           } if torch.torch_version.TorchVersion(torch.__version__) < "2.15" else {}


def _marks(model, entry):
    marks = [] if (model, entry) in QUICK else [pytest.mark.slow]
    if (model, entry) in REFUSED:
        marks.append(pytest.mark.xfail(raises=aotgrad.errors.UnsupportedError, strict=True,
                                       reason=REFUSED[model, entry]))
    return marks


CASES = [pytest.param(model, entry, id=f"{model}-{entry}", marks=_marks(model, entry))
         for model in zoo.MODELS for entry in ENTRIES]


@pytest.mark.parametrize("model,entry", CASES)
def test_trains_like_eager(model, entry):
    make, batches = zoo.MODELS[model]
    losses = check_training(make, steps=3, batches=batches, **ENTRIES[entry])
    assert len(losses) == 3 and losses[0][0] != losses[-1][0]     # the model did train


# Decoder layers reused whole in their default config (a KV cache made in training, updated by
# ``layer_idx``): the layer index is a per-call value of one template (capture/per_call.py).
WHOLE = {"gpt2": 2, "llama": 2, "bert": 2, "t5": 7}


def _flat_or_reused(model: str, reuse: bool, wrap=None):
    import torch
    make, _ = zoo.MODELS[model]
    module, args = make()
    module = wrap(module) if wrap is not None else module
    captured = aotgrad.capture(module, *args, reuse_blocks=reuse)
    info = next(s.info for s in captured.history if s.name == "trace joint")
    torch.manual_seed(2)
    loss = captured.compile()(*args)
    loss.backward()
    return (info["reused blocks"], info["reused whole blocks"]), loss.detach(), \
        {n: p.grad for n, p in module.named_parameters()}


def _same_grads(grads, flat_grads) -> list:
    import torch
    return [n for n, g in grads.items() if (g is None) != (flat_grads[n] is None)
            or g is not None and not torch.equal(g, flat_grads[n])]


@pytest.mark.parametrize("model", [pytest.param(m, marks=[] if m == "gpt2" else [pytest.mark.slow])
                                   for m in zoo.MODELS])
def test_reused_blocks_are_bitwise_the_flat_capture(model):
    """Block reuse (and each backend's block compiled once) changes no bit of the loss or of any
    gradient: a call a template cannot stand for bit for bit runs flat."""
    import torch
    (used, whole), loss, grads = _flat_or_reused(model, True)
    (flat_used, _), flat_loss, flat_grads = _flat_or_reused(model, False)
    assert flat_used == 0 and (used > 0 or model == "resnet18"), used
    assert whole >= WHOLE.get(model, 0), whole
    assert torch.equal(loss, flat_loss)
    differ = _same_grads(grads, flat_grads)
    assert not differ, differ


class ReadsCache:
    """An HF causal LM whose loss also reads every layer's cached keys and values after the model:
    the cache a reused layer updated must hold eager's tensors, gradients flowing through them."""

    def __new__(cls, loss_of):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = loss_of.model

            def forward(self, ids, labels):
                out = self.inner(input_ids=ids, labels=labels)
                held = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
                return out.loss + 0.1 * sum(k.pow(2).mean() + v.pow(2).mean() for k, v in held)
        return Wrapped()


@pytest.mark.parametrize("model", [pytest.param("gpt2"), pytest.param("llama", marks=pytest.mark.slow)])
def test_a_reused_decoder_leaves_eagers_kv_cache(model):
    import torch
    (used, whole), loss, grads = _flat_or_reused(model, True, ReadsCache)
    _, flat_loss, flat_grads = _flat_or_reused(model, False, ReadsCache)
    assert whole == WHOLE[model]
    assert torch.equal(loss, flat_loss) and not _same_grads(grads, flat_grads)
    make, _ = zoo.MODELS[model]
    module, args = make()
    check(ReadsCache(module), args, calls=2)      # eager's loss, gradients and RNG, twice


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_a_kv_cache_passed_in_is_refused_by_name_and_left_as_it_was(entry):
    # HF's DynamicCache as past_key_values: library code fills it (not watched frame by frame); the
    # compiled graph would never fill it again, so the capture is refused naming the argument's path
    # and the caller's cache stays empty.
    import torch
    from transformers import DynamicCache
    make, _ = zoo.MODELS["gpt2"]
    wrapped, (ids, _) = make()
    module, cache = wrapped.model.eval(), DynamicCache()
    with pytest.raises(aotgrad.errors.UnsupportedError, match=r"`input\['past_key_values'\]\.layers` \(a list\)"):
        with torch.no_grad():
            if entry == "jit":
                aotgrad.jit(module)(ids, past_key_values=cache, use_cache=True)
            else:
                aotgrad.capture(module, ids, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0
