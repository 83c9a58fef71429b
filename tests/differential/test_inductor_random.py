"""Random ops under the Inductor backend draw eager's numbers from eager's stream: every op tagged
``nondeterministic_seeded`` in PyTorch's OpInfo database, dropout in its forms (SDPA's
``dropout_p``, ``nn.MultiheadAttention``, ``rrelu``, bf16 and float16 dropout, in-place fills of
views), compared with eager through ``tests.eager_check.check``: masks and values (a tolerance
only for Inductor's fused float arithmetic), gradients, and the RNG state after the forward and
after the backward exact. ``make test`` runs the hand-written family; the OpInfo sweep is slow."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.eager_check import check

TOL = dict(rtol=1e-4, atol=1e-4)


def _rg(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _fill_view(x):
    y = x * 1
    y[1:].normal_()
    y[:, :2].exponential_()
    return (y * x).sum(0)


def _low_precision_dropout(dtype):
    def f(x):
        y = F.dropout(x.to(dtype), 0.5)
        return y != 0, y.float() * x     # the mask exact; the values within the dtype's rounding
    return f


FAMILY = {
    "sdpa_dropout": (lambda q, k: F.scaled_dot_product_attention(q, k, k, dropout_p=0.3), (_rg(2, 2, 8, 4), _rg(2, 2, 8, 4))),
    "sdpa_dropout_causal": (lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.2, is_causal=True),
                            (_rg(1, 2, 6, 4),)),
    "rrelu": (lambda x: F.rrelu(x, training=True) * 2, (_rg(5, 6),)),
    "bf16_dropout": (_low_precision_dropout(torch.bfloat16), (_rg(8, 8),)),
    "fp16_dropout": (_low_precision_dropout(torch.float16), (_rg(8, 8),)),
    "fill_views": (_fill_view, (_rg(4, 5),)),
    "bernoulli_rand_like": (lambda x: torch.bernoulli(torch.sigmoid(x)) * x + torch.rand_like(x), (_rg(6, 3),)),
    "dropout_twice": (lambda x: F.dropout(F.dropout(x, 0.5) * x, 0.3), (_rg(7, 5),)),
}


@pytest.mark.parametrize("name", list(FAMILY))
def test_random_family_under_inductor(name):
    fn, args = FAMILY[name]
    low = name in ("bf16_dropout", "fp16_dropout")     # Inductor rounds its fused half math once
    check(fn, args, fw_compiler="inductor", **(dict(rtol=1e-2, atol=1e-2) if low else TOL))


def test_multihead_attention_dropout_under_inductor():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.25, batch_first=True)
    check(mha, (torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)), fw_compiler="inductor", **TOL)


def _seeded_opinfos():
    from torch.testing._internal.common_methods_invocations import op_db
    found = []
    for info in op_db:
        packet = getattr(torch.ops.aten, (info.aten_name or info.name).split(".")[0], None)
        if packet is None or not hasattr(packet, "overloads"):
            continue
        if any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()):
            found.append(info)
    return found


def _raw_op(info):
    """The op itself: OpInfo wraps random ops in ``wrapper_set_seed``, which seeds inside (refused)."""
    name = info.name
    if name.startswith("nn.functional."):
        return getattr(F, name[len("nn.functional."):], None)
    return getattr(torch, name, None) or getattr(torch.Tensor, name, None)


@pytest.mark.slow
@pytest.mark.parametrize("info", _seeded_opinfos(), ids=lambda i: f"{i.name}.{i.variant_test_name}".rstrip("."))
def test_every_seeded_opinfo_under_inductor(info):
    op = None if info.variant_test_name == "in_place" else _raw_op(info)   # in-place fills: FAMILY
    samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd))
    if op is None or not samples:
        pytest.skip("no plain op or no float32 sample")
    s = samples[0]
    leaves = [s.input, *s.args]
    at = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]

    def fn(*tensors):
        args = list(leaves)
        for i, t in zip(at, tensors):
            args[i] = t
        return op(*args, **s.kwargs)
    check(fn, tuple(leaves[i] for i in at), fw_compiler="inductor",
          backward=info.supports_autograd and any(leaves[i].requires_grad for i in at), **TOL)
