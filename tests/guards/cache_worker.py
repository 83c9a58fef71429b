"""Run by test_cache_processes in fresh processes: compile a few programs with
``aotgrad.jit`` next to eager and print which entries came from the disk cache."""
import json
import sys

import torch
import torch.nn as nn

import aotgrad
from tests.eager_check import check


def jit_compile(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


def half_sum(x):
    return x[: x.shape[0] // 2].sum()


def loss(x, w):
    return ((x @ w).relu() ** 2).mean()


class SdpaBlock(nn.Module):
    """nanoGPT's attention: a generator expression over (q, k, v) (code whose marshalled bytes differ
    between processes) and F.scaled_dot_product_attention."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.h, self.qkv, self.ln = h, nn.Linear(d, 3 * d), nn.LayerNorm(d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln(x)).split(C, dim=2)
        q, k, v = tuple(t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return nn.functional.gelu(x + y.transpose(1, 2).reshape(B, T, C))


STALE_CASES = ("library_function", "library_method", "enum_member", "deque_subclass", "array", "bytearray",
               "numpy_array", "numpy_scalar", "getattribute")


def stale():
    """``python -m tests.guards.cache_worker stale``: each of ``stale_cases``'s functions (a module the
    test writes, with the library it imports, between processes) compiled next to eager."""
    import stale_cases
    loaded = {}
    for name in STALE_CASES:
        x = torch.randn(3, requires_grad=True)
        loaded[name] = check(getattr(stale_cases, name), (x,), compile=jit_compile).compiled.entries[0].loaded
    print(json.dumps(loaded))


def main():
    if sys.argv[1:] == ["stale"]:
        return stale()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    loaded = {}
    run = check(model, (torch.randn(6, 4),), compile=jit_compile)
    loaded["module"] = [e.loaded for e in run.compiled.entries]
    run = check(loss, (torch.randn(5, 3), torch.randn(3, 2, requires_grad=True)), compile=jit_compile)
    loaded["function"] = [e.loaded for e in run.compiled.entries]
    f = aotgrad.jit(half_sum)
    values = [f(torch.ones(n)).item() for n in (4, 8, 6)]
    assert values == [2.0, 4.0, 3.0], values
    loaded["dynamic"] = [e.loaded for e in f.entries]
    run = check(nn.Sequential(SdpaBlock(), SdpaBlock()), (torch.randn(2, 5, 16),), compile=jit_compile)
    loaded["sdpa_gpt"] = [e.loaded for e in run.compiled.entries]
    from examples import models
    gpt, args = models.make_gpt_tiny(batch=2)
    run = check(gpt, args, compile=jit_compile)
    loaded["examples_gpt"] = [e.loaded for e in run.compiled.entries]
    print(json.dumps(loaded))


if __name__ == "__main__":
    sys.exit(main())
