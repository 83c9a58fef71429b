"""aotgrad.jit: guards, recompiles with reasons, automatic dynamic, the recompile limit."""
import warnings

import pytest
import torch
import torch.nn as nn

import aotgrad
from tests.eager_check import check


def jit_compile(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


def test_jit_matches_eager_on_module():
    check(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(3, 4),),
          compile=jit_compile, calls=2)


def test_shape_change_recompiles_never_stale():
    # PyTorch's aot_function returned 2.0 instead of 4.0 here after the shape changed.
    f = aotgrad.jit(lambda x: x[: x.shape[0] // 2].sum())
    assert f(torch.ones(4)).item() == 2.0
    assert f(torch.ones(8)).item() == 4.0
    assert f(torch.ones(4)).item() == 2.0
    assert "size(0) was 4 when captured, now 8" in aotgrad.explain(f)


def test_automatic_dynamic_reuses_one_entry():
    fn = lambda x: (x * 2).sum(0)
    f = aotgrad.jit(fn)
    for n in (3, 5, 7, 9):
        x = torch.randn(n, 4)
        torch.testing.assert_close(f(x), fn(x))
    assert len(f.entries) == 2                       # static, then symbolic in dim 0
    assert f.dynamic_dims == {0: {0}}


@pytest.mark.parametrize("change, reason", [
    (lambda x: x.double(), "dtype was torch.float32"),
    (lambda x: x.requires_grad_(), "requires_grad was False"),
])
def test_recompile_reasons(change, reason):
    f = aotgrad.jit(lambda x: x.sin())
    f(torch.randn(3))
    f(change(torch.randn(3)))
    assert reason in aotgrad.explain(f)


def test_baked_python_value_is_guarded():
    f = aotgrad.jit(lambda x, k: x * k)
    assert f(torch.ones(2), 2)[0] == 2
    assert f(torch.ones(2), 3)[0] == 3
    assert "was 2 when captured, now 3" in aotgrad.explain(f)


def test_grad_mode_is_guarded():
    m = nn.Linear(3, 3)
    f = aotgrad.jit(m)
    f(torch.randn(2, 3)).sum().backward()
    with torch.no_grad():
        out = f(torch.randn(2, 3))
    assert not out.requires_grad
    assert "grad mode was on, now off" in aotgrad.explain(f)


def test_aliasing_is_guarded():
    def f(a, b):
        a.add_(1)
        return a * b
    g = aotgrad.jit(f)
    x, y = torch.zeros(2), torch.ones(2)
    g(x, y)
    z = torch.zeros(2)
    out = g(z, z)                       # now aliased: must not reuse the first entry
    torch.testing.assert_close(out, torch.ones(2))
    assert len(g.entries) == 2


def test_recompile_limit_falls_back_to_eager_and_warns_once():
    f = aotgrad.jit(lambda x, k: x + k, recompile_limit=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [f(torch.zeros(1), k).item() for k in range(5)]
    assert outs == [0, 1, 2, 3, 4]
    assert len(f.entries) == 2 and f.fallbacks == 3
    assert sum("recompile limit" in str(x.message) for x in w) == 1
