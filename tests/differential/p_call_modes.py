"""The outer mode a program is compiled and called under (``no_grad``, ``inference_mode``,
``set_grad_enabled(False)``, CPU autocast in bf16 and fp16, autocast with ``enabled=False``) and
autocast regions entered, nested and left inside it. Twins vary what the mode changes: which outputs
require grad (a view of a parameter, an ``enable_grad`` region), buffers written in place (BatchNorm
statistics must still be updated), the casts chosen (matmul in the autocast dtype, BatchNorm and sums
kept in float32), and the region the backward's casts come from."""
import torch
import torch.nn as nn

from .programs import fn, program, r

M = "call_modes"
LOW = (1e-2, 1e-2)


def _autocast(dtype=torch.bfloat16, enabled=True):
    return lambda: torch.autocast("cpu", dtype=dtype, enabled=enabled)


def _no_grad_off():
    return torch.set_grad_enabled(False)


def _bn(n):
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), (r(n, 3),)


class _ParamView(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return self.w.view(-1), self.w.t(), (x @ self.w).relu()


class _ParamViewChains(nn.Module):
    """Views through a detach (``.data``, ``detach()``), a detach alone, a slice, and views of the
    inputs (one requires grad, one does not): under inference mode eager's view of a tensor that
    requires grad is a leaf that requires grad, one through a detach is not."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x, y):
        w = self.w
        return w.detach().view(-1), w.data.t(), w.detach(), w[1:], w.unsqueeze(0)[0], x.view(-1), y.t(), \
            (x @ w + y).sum()


class _ParamViewTwice(nn.Module):
    """One view of a parameter returned twice: the same object twice, as in eager."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        rows = self.w[1:]
        return rows, (x @ self.w).sum(), rows


class _ParamWritten(nn.Module):
    """Writes its own weight in place where autograd does not see it (an update by hand, as an
    optimizer or a weight EMA does), then uses it: the written parameter stays the leaf it was."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.mul_(0.5).add_(0.1)
        return self.fc(x).tanh()


for _name, _outer in {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                      "grad_disabled": _no_grad_off}.items():
    program(f"batchnorm_train_under_{_name}", M, outer=_outer, must_match=True)(
        lambda n=4: fn(*(lambda m, a: (m, *a))(*_bn(n))))
    program(f"param_views_under_{_name}", M, outer=_outer)(lambda n=4: fn(_ParamView(), r(n, 3)))
    program(f"param_view_chains_under_{_name}", M, outer=_outer, must_match=True)(
        lambda n=4: fn(_ParamViewChains(), r(n, 3), r(n, 3, rg=True)))
    program(f"param_view_twice_under_{_name}", M, outer=_outer)(lambda n=4: fn(_ParamViewTwice(), r(n, 3)))
    program(f"param_written_without_grad_under_{_name}", M, outer=_outer, must_match=True)(
        lambda n=4: fn(_ParamWritten(), r(n, 3)))
    program(f"input_written_under_{_name}", M, outer=_outer, must_match=True)(
        lambda n=4: fn(lambda x, w: (x.mul_(2), (x @ w).sum()), r(n, 3), r(3, 2, rg=True)))

for _name, _outer in {"bf16": _autocast(), "fp16": _autocast(torch.float16),
                      "disabled": _autocast(enabled=False)}.items():
    program(f"batchnorm_under_autocast_{_name}", M, "dtype", outer=_outer, tol=LOW)(
        lambda n=4: fn(*(lambda m, a: (m, *a))(*_bn(n))))
    program(f"nested_regions_under_autocast_{_name}", M, "dtype", outer=_outer, tol=LOW)(
        lambda n=4: fn(lambda x, w: _nested(x, w), r(n, 3), r(3, 3, rg=True)))


def _nested(x, w):
    """fp16 inside bf16, a disabled region inside that, and a region left before the last matmul.
    (``w * 1`` in the fp16 region: eager's autocast caches a leaf's cast per region stack, and reuses
    the bf16 copy of ``w`` there, which fails in eager itself.)"""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x @ w
        with torch.autocast("cpu", dtype=torch.float16):
            b = x @ (w * 1)
            with torch.autocast("cpu", enabled=False):
                c = x.float() @ w
    return a, b, c, (a.float() + b.float() + c) @ (w * 1)


@program("nested_regions_inside", M, "dtype", tol=LOW)
def _(n=4):
    return fn(_nested, r(n, 3), r(3, 3, rg=True))


@program("autocast_fp16_inside_with_softmax", M, "dtype", tol=LOW)
def _(n=4):
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.float16):
            h = x @ w                       # fp16
            p = torch.softmax(h, -1)        # autocast runs softmax in float32
        return h, p, (p * h.float()).sum()
    return fn(f, r(n, 3), r(3, 3, rg=True))
