"""Tiny randomly initialised real models (HuggingFace transformers, timm), built from configs in
code: nothing is downloaded. Each ``make_*`` returns ``(model, args)`` with ``model(*args)`` the
training loss, dropout on; ``batch_*(step)`` gives each step's fresh batch."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 64, 8, 2
_TORCHVISION_SCHEMAS = []


def import_torchvision():
    """Import torchvision (timm and transformers need it), even where its wheel is a CUDA build
    next to a CPU torch: its C++ ops cannot load there, and its fake registrations of ``nms`` and
    ``qnms`` fail on the missing operators. Defining those two schemas (no kernels: calling them
    raises) lets its Python part import; the models here never call them."""
    try:
        import torchvision
        return torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS.append(lib)        # the definitions live as long as the library object
    import torchvision
    return torchvision


class LossOf(torch.nn.Module):
    """A HuggingFace model called with keyword arguments, returning its ``.loss``."""

    def __init__(self, model, *keys):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *tensors):
        return self.model(**dict(zip(self.keys, tensors))).loss


class Classify(torch.nn.Module):
    """An image classifier trained with cross entropy."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


def _tokens(step, *shape):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, shape or (BATCH, SEQ), generator=g)


def batch_lm(step):
    ids = _tokens(step)
    return ids, ids.clone()


def batch_seq2seq(step):
    return _tokens(step), _tokens(step + 50, BATCH, SEQ // 2)


def batch_image(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _hf(config_cls, model_cls, keys, batch, **config):
    import transformers
    import_torchvision()
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    return LossOf(model.train(), *keys), batch(0)


def make_gpt2():
    return _hf("GPT2Config", "GPT2LMHeadModel", ("input_ids", "labels"), batch_lm, n_layer=2, n_embd=32,
               n_head=2, vocab_size=VOCAB, n_positions=16)


def make_llama():
    """Grouped-query attention (4 query heads, 2 key/value heads) and rotary embeddings."""
    return _hf("LlamaConfig", "LlamaForCausalLM", ("input_ids", "labels"), batch_lm, num_hidden_layers=2,
               hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=VOCAB, max_position_embeddings=16, attention_dropout=0.1)


def make_bert():
    return _hf("BertConfig", "BertForMaskedLM", ("input_ids", "labels"), batch_lm, num_hidden_layers=2,
               hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
               max_position_embeddings=16)


def make_t5():
    """An encoder-decoder: labels feed the decoder (shifted right inside the model)."""
    return _hf("T5Config", "T5ForConditionalGeneration", ("input_ids", "labels"), batch_seq2seq,
               num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=4,
               vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.1)


def make_mixtral():
    """Mixture of experts: each token is routed to 2 of 4 experts (data-dependent)."""
    return _hf("MixtralConfig", "MixtralForCausalLM", ("input_ids", "labels"), batch_lm, num_hidden_layers=2,
               hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=16,
               attention_dropout=0.1)


def _timm(name, **kw):
    import_torchvision()
    import timm
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, drop_rate=0.1, **kw)
    return Classify(model.train()), batch_image(0)


def make_resnet18():
    return _timm("resnet18")


def make_vit_tiny():
    return _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, drop_path_rate=0.1)


def make_convnext_atto():
    return _timm("convnext_atto", drop_path_rate=0.1)


def make_efficientnet_b0():
    return _timm("efficientnet_b0", drop_path_rate=0.1)


def make_mobilenetv3_small():
    return _timm("mobilenetv3_small_100")


TEXT = {"gpt2": (make_gpt2, batch_lm), "llama": (make_llama, batch_lm), "bert": (make_bert, batch_lm),
        "t5": (make_t5, batch_seq2seq), "mixtral": (make_mixtral, batch_lm)}
VISION = {"resnet18": (make_resnet18, batch_image), "vit_tiny": (make_vit_tiny, batch_image),
          "convnext_atto": (make_convnext_atto, batch_image),
          "efficientnet_b0": (make_efficientnet_b0, batch_image),
          "mobilenetv3_small": (make_mobilenetv3_small, batch_image)}
MODELS = {**TEXT, **VISION}
