"""Outputs whose layout a decomposition changes, for the Inductor backend's layout restoration
(``aotgrad/backends/inductor._eager_strides``: a fresh output is laid out as the graph before
decomposition says, which is eager's layout).

``cat`` with an empty operand keeps the other operand's layout in eager and decomposes to a
contiguous result. The twins differ in what would make the restoration wrong: the output returned
twice (one tensor, not two copies), returned and saved for backward (written in place before the
backward it must still raise eager's version-counter error: ``usage.py``'s kind
``saved_exp_laid_out_by_a_decomposition`` under Inductor), a view of it returned (its base is
not an output), a channels-last 4-d operand, half precision, an integer result, and one output
restored next to one left alone."""
import torch

from .programs import fn, program, r, transposed_leaf

L = "layouts"


def _p(name, **options):
    return program(f"layout_{name}", L, must_match=True, **options)


def _t(*shape, rg=True, dtype=torch.float32):
    return transposed_leaf(*shape, rg=rg, dtype=dtype)


@_p("cat_empty_twice")
def _(n=4):
    def f(x, e):
        y = torch.cat([x, e]) * 2
        return y, y
    return fn(f, _t(n, 3), r(0, 3, rg=True))


@_p("cat_empty_saved")
def _(n=4):
    def f(x, e):
        y = torch.cat([x, e]) * 2
        return y, (y * y).sum()
    return fn(f, _t(n, 3), r(0, 3, rg=True))


@_p("cat_empty_view_out")
def _(n=4):
    return fn(lambda x, e: (torch.cat([x, e]) * 2).t(), _t(n, 3), r(0, 3, rg=True))


@_p("cat_empty_channels_last")
def _(n=2):
    x = r(n, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    return fn(lambda x, e: torch.cat([x, e]).sigmoid(), x, r(0, 3, 4, 5, rg=True))


@_p("cat_empty_bf16")
def _(n=4):
    return fn(lambda x, e: torch.cat([x, e]) * 2, _t(n, 3, dtype=torch.bfloat16), r(0, 3, rg=True,
                                                                                     dtype=torch.bfloat16))


@_p("cat_empty_int", backward=False)
def _(n=4):
    return fn(lambda x, e: torch.cat([x, e]) + 1, _t(n, 3, rg=False, dtype=torch.int64), r(0, 3, dtype=torch.int64))


@_p("one_of_two_restored")
def _(n=4):
    def f(x, e):
        return torch.cat([x, e]) * 2, x.t() * 3
    return fn(f, _t(n, 3), r(0, 3, rg=True))


# Batch norm's fake kernel keeps a non-contiguous input's layout; its real kernels lay the result out
# as ``empty_like(input, input.suggest_memory_format())`` (contiguous for a transposed 3-d sequence,
# channels-last kept), forward and backward. The trace follows the real kernels, so what is traced
# after the norm sees eager's layout: the twins differ in what would read the wrong one (a linear's
# backward viewing the gradient, a reshape, an as_strided, a user's view eager refuses, the output
# itself, channels-last, eval mode, a norm inside a repeated block).
class _SeqNorm(torch.nn.Module):
    """Linear -> BatchNorm1d over channels of a (batch, time, channels) sequence -> Linear."""

    def __init__(self, tail="linear", d=8):
        super().__init__()
        self.tail, self.fc, self.bn, self.out = tail, torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d), torch.nn.Linear(d, 3)

    def forward(self, x):
        h = self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2)
        if self.tail == "reshape":
            return (h * 2).reshape(-1, h.shape[-1]).sum(0)
        if self.tail == "as_strided":
            return h.as_strided((2, 4), (h.shape[1] * h.shape[2], 1)) * 3 + h.sum()
        if self.tail == "view":      # eager: the view refuses a transposed result
            return (h * 2).view(-1, h.shape[-1])
        if self.tail == "output":
            return h
        return self.out(h)


for _tail in ("linear", "reshape", "as_strided", "output"):
    _p(f"batchnorm_sequence_{_tail}", calls=2)(lambda n=4, t=_tail: fn(_SeqNorm(t), r(n, 5, 8, rg=True)))
_p("batchnorm_sequence_eval")(lambda n=4: fn(_SeqNorm().eval(), r(n, 5, 8, rg=True)))
program("layout_batchnorm_sequence_view", L, eager_raises=True)(lambda n=4: fn(_SeqNorm("view"), r(n, 5, 8, rg=True)))
_p("batchnorm_channels_last")(lambda n=4: fn(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)),
                                             r(n, 3, 5, 6, rg=True).to(memory_format=torch.channels_last)))


class _NormBlocks(torch.nn.Module):
    """Three repeated blocks, each a sequence norm with a residual (reused as one template)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SeqNorm("output") for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.sum(1)


_p("batchnorm_sequence_blocks", calls=2)(lambda n=4: fn(_NormBlocks(), r(n, 5, 8, rg=True)))
