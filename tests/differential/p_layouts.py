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
