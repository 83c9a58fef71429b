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


def main():
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
    print(json.dumps(loaded))


if __name__ == "__main__":
    sys.exit(main())
