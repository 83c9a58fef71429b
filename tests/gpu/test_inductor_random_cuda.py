"""Random ops under the Inductor backend on CUDA draw eager's numbers at eager's Philox offsets.

The CUDA generator is Philox ``(seed, offset)``: each eager kernel advances the offset by what it
reserves, and Inductor's own random lowering (``rand_like`` decompositions, its seeds buffer)
would draw other numbers and advance it differently. ``tests.eager_check.check`` compares the
CUDA generator state (seed and offset) after the forward and after the backward exactly, as well
as masks, values and gradients. CUDA picks other kernels than the CPU does: ``aten::dropout``
becomes the fused ``native_dropout``, SDPA the flash / memory-efficient kernels that return their
Philox seed and offset for the backward. Skipped without CUDA."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.differential.test_inductor_random import FAMILY, TOL
from tests.eager_check import check

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("error:aotgrad inductor backend:UserWarning")]


def _cuda(args, dtype=None):
    return tuple(a.detach().to("cuda", dtype or a.dtype).requires_grad_(a.requires_grad) for a in args)


@pytest.mark.parametrize("name", list(FAMILY))
def test_random_family_on_cuda(name):
    fn, args = FAMILY[name]
    low = name in ("bf16_dropout", "fp16_dropout")
    check(fn, _cuda(args), fw_compiler="inductor", **(dict(rtol=1e-2, atol=1e-2) if low else TOL))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_sdpa_dropout_on_cuda(dtype, causal):
    """Half-precision SDPA takes the flash / memory-efficient kernel, whose backward reads the
    Philox seed and offset the forward returned."""
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=causal)
    args = _cuda(tuple(torch.randn(2, 4, 16, 64, requires_grad=True) for _ in range(3)), dtype)
    check(f, args, fw_compiler="inductor", rtol=2e-2, atol=2e-2)


def test_multihead_attention_dropout_on_cuda():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, dropout=0.25, batch_first=True).cuda()
    x = torch.randn(2, 6, 16, device="cuda")
    check(mha, (x, x.clone(), x.clone()), fw_compiler="inductor", **TOL)


def test_offsets_follow_eager_across_calls_and_backwards():
    """Three calls and backwards in a row: each one starts at the offset the previous one left,
    so a drift in any kernel's Philox reservation shows on the later calls."""
    def f(x):
        y = F.dropout(x, 0.5) + torch.rand_like(x)
        return F.dropout(y.relu(), 0.2).sum(0) + torch.randn(x.shape[1], device=x.device)
    check(f, _cuda((torch.randn(64, 33, requires_grad=True),)), fw_compiler="inductor", calls=3, **TOL)


@pytest.mark.slow
def test_every_seeded_opinfo_on_cuda():
    """OpInfo's drawing ops (the CPU sweep's selection), their samples moved to CUDA."""
    import tests.differential.test_inductor_random as sweep
    found, failed = sweep.seeded_opinfos(), []
    assert found
    for info, index in found:
        try:
            with sweep._unseeded():
                sweep.check_sample(info, sweep._samples(info)[index], device="cuda")
        except Exception as e:  # noqa: BLE001 - collected: every failing op is reported at once
            failed.append(f"{info.name}.{info.variant_test_name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    assert not failed, "\n".join(failed)
