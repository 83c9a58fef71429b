"""A custom ``autograd.Function`` whose backward writes in place to what it was given: the incoming
gradient (``grad_output.mul_(2); return grad_output``), a tensor it saved that the program made, or one
of the program's inputs or outputs it saved or kept on ``ctx``.

The first two are values of the traced backward, functionalized like any write: exact, through every
entry point. A write to a program input or output (or a view of one) during the backward changes the
caller's tensor when eager's backward runs, not before; the compiled backward is functional and cannot
(refused naming the Function's line, before anything runs: PyTorch's AOTAutograd keeps such writes only
for inputs that do not require grad). The outputs are compared before the backward runs.
"""
import torch

from .programs import fn, program, r

C = "custom_function"
W = "backward_writes"


class _GradInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        g.mul_(2)
        return g


class _GradInPlaceThroughView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        g[0].add_(1)        # a view of the incoming gradient
        return g * 3


class _SavedTempInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x * 2
        ctx.save_for_backward(y)
        return y * 3

    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        y.mul_(2)
        return g * y


class _SavedInputInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        x.mul_(2)           # the program's input: eager's caller sees it doubled after the backward
        return g * x


class _SavedOutputInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        y.mul_(2)           # the program's output: eager's caller sees it doubled after the backward, not before
        return g * y


class _SavedBaseOfOutputInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y[1:]

    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        y.mul_(2)           # the base of the program's output, a view of it
        return torch.cat([g.new_zeros(1), g]) * y


class _CtxInputInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return x * w

    @staticmethod
    def backward(ctx, g):
        ctx.w.add_(1)       # an input kept on ctx (not saved): eager writes the caller's w
        return g * ctx.w, None



@program("backward_writes_grad_output", C, W, must_match=True)
def _(n=3):
    return fn(lambda x: _GradInPlace.apply(x) * torch.arange(1.0, n + 1), r(n, rg=True))


@program("backward_writes_grad_output_two_calls", C, W, must_match=True)
def _(n=3):
    w = torch.arange(1.0, n + 1)
    return fn(lambda x: (_GradInPlace.apply(x) * w, _GradInPlace.apply(x.sin()) * w), r(n, rg=True))


@program("backward_writes_grad_output_through_view", C, W, must_match=True)
def _(n=3):
    return fn(lambda x: _GradInPlaceThroughView.apply(x) * torch.arange(1.0, n + 1), r(n, rg=True))


@program("backward_writes_saved_intermediate", C, W, must_match=True)
def _(n=3):
    return fn(lambda x: _SavedTempInPlace.apply(x), r(n, rg=True))


@program("backward_writes_saved_input", C, W)
def _(n=3):
    return fn(lambda x: _SavedInputInPlace.apply(x), r(n, rg=True).mul(1))


@program("backward_writes_input_on_ctx", C, W)
def _(n=3):
    return fn(lambda x, w: _CtxInputInPlace.apply(x, w), r(n, rg=True), r(n))


@program("backward_writes_saved_output", C, W)
def _(n=3):
    return fn(lambda x: _SavedOutputInPlace.apply(x), r(n, rg=True))


@program("backward_writes_saved_base_of_output", C, W)
def _(n=3):
    return fn(lambda x: _SavedBaseOfOutputInPlace.apply(x), r(n, rg=True))
