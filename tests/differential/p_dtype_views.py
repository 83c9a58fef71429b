"""Dtype views (``x.view(torch.int32)``, ``.view(torch.complex64)``): they change the element size, so
an output's shape and strides are not its base's, and no ``as_strided`` of the base regenerates it.
Each twin varies what could make a regeneration or a write-back wrong: the base (input, intermediate,
parameter, a view), the element size (smaller, larger, equal), grad, writes through the view before or
after it is taken, and what else is returned from the same storage."""
import torch

from .programs import fn, program, r, transposed_leaf

D = "dtype_view"


@program("dtype_view_wider_and_narrower", D, must_match=True)
def _(n=4):
    # float32 -> float64 halves the last dimension, -> float16 doubles it; eager: neither requires grad
    return fn(lambda x: (x.view(torch.float64), x.view(torch.float16), x.view(torch.float32) * 1),
              r(n, 4, rg=True))


@program("dtype_view_same_size_keeps_grad", D, must_match=True)
def _(n=4):
    # a view to the tensor's own dtype is a plain differentiable view
    return fn(lambda x: (x.view(torch.float32), x.view(torch.int32)), r(n, 4, rg=True))


@program("dtype_view_of_sliced_input", D, must_match=True)
def _(n=4):
    return fn(lambda x: (x[1:, 2:].view(torch.float16), x[:, 1].view(torch.int32)), r(n, 4))


@program("dtype_view_of_transposed_input", D)
def _(n=4):
    # the last dimension must be contiguous for a size change: only the same-size view applies here
    return fn(lambda x: (x.view(torch.int32), x.t().contiguous().view(torch.int16)), transposed_leaf(n, 4))


@program("dtype_view_then_input_written", D, must_match=True)
def _(n=4):
    def f(x):
        bits = x.view(torch.int32)      # shares x's storage: the write below shows through it
        x.mul_(2)
        return bits, x.view(torch.uint8)[:, :4]
    return fn(f, r(n, 4))


@program("dtype_view_written_through", D, must_match=True, backward=False)
def _(n=4):
    def f(x):
        x.view(torch.int32).bitwise_xor_(1)      # flips the low mantissa bit of every input element
        return x * 1
    return fn(f, r(n, 4))


@program("dtype_view_written_through_grad_input", D)
def _(n=4):
    def f(x):
        y = x * 2
        with torch.no_grad():
            y.view(torch.int32).bitwise_and_(-256)      # truncate mantissas of an intermediate
        return y, y.view(torch.int32)
    return fn(f, r(n, 4, rg=True))


@program("dtype_view_complex_of_param_and_back", D)
def _(n=4):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            c = self.w.view(torch.complex64)                  # (3, 2) complex
            return c, c.view(torch.float32)[1], x @ self.w.t()
    return fn(M(), r(n, 4))


@program("dtype_view_chain_with_reshapes", D, must_match=True)
def _(n=4):
    def f(x):
        h = x.view(torch.uint8).view(n, 2, 8)[:, 1].view(torch.int32)
        return h, h.view(torch.float32).t()
    return fn(f, r(n, 4))


@program("dtype_view_bool_and_int8", D, must_match=True, backward=False)
def _(n=4):
    def f(x):
        b = x.view(torch.uint8) > 0
        return b.view(torch.int8), b.view(torch.uint8).view(torch.bool)
    return fn(f, r(n, 4))


@program("dtype_view_of_bf16_intermediate", D, tol=(1e-2, 1e-2))
def _(n=4):
    def f(x):
        h = (x * 3).to(torch.bfloat16)
        return h.view(torch.int16), h.view(torch.float16), h.float().sum()
    return fn(f, r(n, 4, rg=True))
