"""Programs of PyTorch's own AOTAutograd tests (test/functorch/test_aotdispatch.py: ``TestAOTAutograd``,
``TestAOTDispatch`` and the subclass, storage-resize and nested-tensor programs), as eager programs.

Programs that took the process down (growing or freeing an input's storage: reading it kills the
process; nested tensors under Dynamo) are tagged ``isolate``: they run in a child process, so a
crash is a FAIL, not a dead suite. Tensor-subclass programs (TwoTensor...) raised untyped errors.
Programs already ported under their behaviour class (p_alias, p_mutation...) carry the
``aotdispatch`` tag there and are not repeated here.
"""
import torch
from torch import nn

from .programs import fn, program, r

D = "aotdispatch"
ISO = "isolate"


def _two(*shape, rg=False):
    from torch.testing._internal.two_tensor import TwoTensor
    return TwoTensor(r(*shape), r(*shape)).requires_grad_(rg)


# --- TestAOTAutograd: plain programs ------------------------------------------------------------

@program("aotd_non_tensor_and_none_inputs", D, must_match=True)
def _(n=3):
    def f(a, b, c):
        return a * c
    return fn(f, 2, None, r(n, 3, rg=True))


@program("aotd_single_output", D, must_match=True)
def _(n=3):
    return fn(lambda a, b: a + b, r(n, 3, rg=True), r(n, 3))


@program("aotd_multi_output_list", D, must_match=True)
def _(n=3):
    return fn(lambda a, b: [a + b, a - b], r(n, 3, rg=True), r(n, 3))


@program("aotd_squeeze_mutation", D, must_match=True)
def _(n=3):
    def f(a):
        b = a.clone().squeeze(-1)
        b.add_(1.)
        return a + b
    return fn(f, r(n, 1, rg=True))


@program("aotd_complex_linear", D)
def _():
    class F(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(10, 10, dtype=torch.complex64)

        def forward(self, x):
            return self.linear(x).sum().abs()
    return fn(F(), torch.randn(1, 10, 10, dtype=torch.complex64))


@program("aotd_input_mutation_simple_with_none_and_nontensor", D)
def _(n=3):
    def f(a, b, c):
        return a * c
    return fn(f, r(n, 3, rg=True).add(1), None, 3)


@program("aotd_input_mutation_is_output", D, must_match=True)
def _(n=3):
    def f(a):
        a.mul_(2)
        return a
    return fn(f, r(n, 3, rg=True).add(1))


@program("aotd_input_mutation_multiple", D, must_match=True)
def _(n=3):
    def f(a, b, c):
        a.mul_(2)
        c.mul_(2)
        return a + b + c
    return fn(f, r(n, 3, rg=True).add(1), r(n, 3, rg=True).add(1), r(n, 3, rg=True).add(1))


@program("aotd_input_mutation_metadata", D)
def _(n=3):
    def f(a, b):
        a.transpose_(1, 0)
        return a + b
    return fn(f, r(n, 1, rg=True).add(1), r(1, n, rg=True))


@program("aotd_input_mutation_metadata2", D)
def _(n=3):
    def f(a):
        a.transpose_(1, 0)
        a.mul_(2)
        return a + 1
    return fn(f, r(n, 2, rg=True).add(1))


@program("aotd_input_mutation_resize_smaller", D)
def _(n=3):
    def f(a, b):
        a.resize_(2, 2)
        return a + b
    return fn(f, r(n, 3), torch.ones(2, 2, requires_grad=True))


@program("aotd_input_mutation_requires_grad_no_grad_detach_mixed", D)
def _(n=3):
    def f(a, b, c, d):
        a.detach().mul_(2)
        b.mul_(3)
        c.detach().mul_(4)
        with torch.no_grad():
            d.mul_(5)
        return a + b + c + d
    return fn(f, r(n, rg=True).add(1), r(n), r(n, rg=True).add(1), r(n, rg=True).add(1))


@program("aotd_input_mutation_noncontiguous", D, must_match=True)
def _(n=3):
    def f(a):
        a.mul_(2)
        return a + 1
    return fn(f, r(n, 4, rg=True).add(1)[:, 1:])


@program("aotd_input_mutation_and_output_view", D)
def _(n=3):
    def f(a):
        a.add_(1)
        return a.view(-1)
    return fn(f, r(4, 2, rg=True).add(1))


@program("aotd_input_mutation_output_view_multiple", D)
def _(n=4):
    def f(a, b, c, d):
        b.transpose_(1, 0)
        c.add_(1)
        return d + 1, b.diagonal(), a + c
    return fn(f, r(n, 2, rg=True), r(n, n), r(n, 2).add(0), r(n, 2, rg=True))


@program("aotd_output_aliases_intermediate_single", D, must_match=True)
def _(n=3):
    def f(a):
        out = torch.mul(a, 3)
        return out.view(-1)
    return fn(f, r(n, 3, rg=True))


@program("aotd_output_aliases_intermediate_multiple_mixed", D)
def _(n=3):
    def f(a):
        out1 = torch.mul(a, 3)
        out2 = torch.mul(a, 4)
        return out1.view(-1), out2.transpose(1, 0), out1.transpose(1, 0)
    return fn(f, r(n, 3, rg=True))


@program("aotd_output_aliases_intermediate_and_returned_flipped", D)
def _(n=3):
    def f(a):
        out = torch.mul(a, 3)
        return out, out.view(-1)
    return fn(f, r(n, 3, rg=True))


@program("aotd_output_aliases_intermediate_inplace_view", D)
def _(n=3):
    def f(a):
        out = torch.mul(a, 3)
        out.t_()
        return out
    return fn(f, r(n, 2, rg=True))


@program("aotd_output_aliases_intermediate_inplace_view_and_view", D)
def _(n=3):
    def f(a):
        out = torch.mul(a, 3)
        out_view = out.unsqueeze(0)
        out.t_()
        out_view2 = out.unsqueeze(0)
        return out_view, out, out_view2
    return fn(f, r(n, 2, rg=True))


@program("aotd_view_and_inplace_view", D)
def _(n=3):
    def f(a, b):
        a.t_()
        return b.view(b.shape), a.view(a.shape)
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("aotd_view_detach", D, must_match=True)
def _(n=3):
    def f(a):
        tmp = a.detach()
        a.mul_(2)
        return a, tmp
    return fn(f, r(n, 3, rg=True).add(1))


@program("aotd_input_inplace_requires_grad_true", D)
def _(n=3):
    def f(a, b):
        a.requires_grad_(True)
        return a.mul(3), b.mul(4)
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("aotd_no_grad_input_output", D, must_match=True)
def _(n=3):
    def f(a, b):
        return a.cos(), b.cos(), a * b
    return fn(f, r(n, 3, rg=True), r(n, 3))


@program("aotd_some_outputs_dont_require_grad_view", D)
def _(n=3):
    def f(a, b):
        return a.detach(), b
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_some_outputs_dont_require_grad_non_view", D)
def _(n=3):
    def f(a, b):
        return a.add(1).detach(), b
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_inner_grad", D)
def _(n=3):
    def f(x):
        y = torch.exp(x)
        z = torch.autograd.grad(y, x, create_graph=True)
        return z[0] * 2
    return fn(f, r(rg=True))


@program("aotd_grad_context", D)
def _(n=3):
    def f(x):
        with torch.no_grad():
            y = x * 2
        return y * x
    return fn(f, r(n, rg=True))


@program("aotd_output_dict", D, must_match=True)
def _(n=3):
    def f(x):
        return {"a": x, "b": x * 2}
    return fn(f, r(n, rg=True))


@program("aotd_module", D, must_match=True)
def _():
    return fn(nn.Sequential(nn.Linear(32, 32), nn.ReLU()), r(32, 32))


@program("aotd_batchnorm", D, must_match=True)
def _():
    return fn(nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), r(2, 4, 6, 6))


@program("aotd_list_codegen", D, must_match=True)
def _(n=3):
    def list_nop(f, _):
        def g(inps):
            return f(*inps)
        return g

    def f(a, b, c):
        return a.sin() * b.cos() * c.sin()
    return fn(list_nop(f, None), [r(n, rg=True), r(n, rg=True), r(n, rg=True)])


@program("aotd_dupe_arg", D)
def _(n=3):
    def f(x, y):
        return x + y
    x = r(n, 3, rg=True)
    return fn(f, x, x)


@program("aotd_buffer_copied_in_graph", D)
def _():
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.buf = nn.Buffer(torch.zeros(1))
            self.w1 = nn.Parameter(torch.zeros(1))
            self.w2 = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            self.buf.add_(1)
            return (self.w1 * x * self.w2).sum() + self.buf.sum()
    return fn(MyModel(), torch.ones(1, requires_grad=True))


@program("aotd_buffer_batch_norm", D)
def _():
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.BatchNorm1d(100)

        def forward(self, x):
            return self.m(x)
    return fn(MyModel(), r(20, 100, rg=True))


@program("aotd_real_weights_in_symbolic_mode", D, must_match=True)
def _():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 5)

        def forward(self, x):
            return self.linear(x)
    return fn(M(), r(10, 5))


@program("aotd_custom_autograd_fn_output_aliases_input", D)
def _(n=3):
    class CustomFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view(-1)

        @staticmethod
        def backward(ctx, g):
            return g.view(n, 3) * 2

    def f(a):
        return CustomFn.apply(a) + 1
    return fn(f, r(n, 3, rg=True))


# --- storage resizing: FSDP-style and resize_ on inputs ------------------------------------------

@program("aotd_input_resize_bigger", D, ISO)
def _(n=4):
    def f(x):
        x.resize_(2 * n)
        x.fill_(2.0)
        return x * 3
    return fn(f, r(n))


@program("aotd_input_resize_bigger_2d", D, ISO)
def _(n=3):
    def f(a, b):
        a.resize_(4, 4)
        a.copy_(b)
        return a + b
    return fn(f, r(n, 3), r(4, 4, rg=True))


@program("aotd_storage_resize_up", D, ISO)
def _(n=8):
    def f(a):
        a.untyped_storage().resize_(4 * n)
        with torch.no_grad():
            a.copy_(torch.ones(n))
        return a + 1
    inp = torch.zeros(n)
    inp.untyped_storage().resize_(0)
    return fn(f, inp)


@program("aotd_storage_resize_down", D, ISO)
def _(n=8):
    def f(a):
        out = a.sin()
        a.untyped_storage().resize_(0)
        return out
    return fn(f, r(n))


@program("aotd_storage_resize_up_down", D, ISO)
def _(n=8):
    def f(a):
        a.untyped_storage().resize_(4 * n)
        with torch.no_grad():
            a.copy_(torch.ones(n))
        out = a.sin()
        a.untyped_storage().resize_(0)
        return out
    inp = torch.zeros(n)
    inp.untyped_storage().resize_(0)
    return fn(f, inp)


@program("aotd_resize_storage_bytes_up", D, ISO)
def _(n=8):
    def f(a):
        torch.ops.inductor.resize_storage_bytes_(a, 4 * n)
        with torch.no_grad():
            a.copy_(torch.ones(n))
        return a + 1
    inp = torch.zeros(n)
    inp.untyped_storage().resize_(0)
    return fn(f, inp)


@program("aotd_input_empty_storage_unused", D, ISO)
def _(n=8):
    def f(a, b):
        return b * 2
    inp = torch.zeros(n)
    inp.untyped_storage().resize_(0)
    return fn(f, inp, r(n, rg=True))


@program("aotd_parameter_storage_freed", D, ISO)
def _(n=4):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(n))
            self.w.untyped_storage().resize_(0)

        def forward(self, x):
            return x * 2
    return fn(M(), r(n, rg=True))


# --- nested (jagged) tensors ---------------------------------------------------------------------

def _jagged(rg=False):
    return torch.nested.nested_tensor([r(2, 3), r(4, 3)], layout=torch.jagged, requires_grad=rg)


@program("aotd_nested_jagged_input", D, ISO)
def _():
    return fn(lambda x: (x.sin() * 2).values(), _jagged(rg=True))


@program("aotd_nested_jagged_input_plain_out", D, ISO)
def _():
    return fn(lambda x, w: x.values() * w, _jagged(rg=True), r(3, rg=True))


@program("aotd_nested_jagged_made_inside", D, ISO)
def _():
    def f(a, b):
        nt = torch.nested.as_nested_tensor([a, b], layout=torch.jagged)
        return (nt * 2).values().sum(0)
    return fn(f, r(2, 3, rg=True), r(4, 3, rg=True))


@program("aotd_nested_strided_input", D, ISO)
def _():
    return fn(lambda x: torch.nested.to_padded_tensor(x * 2, 0.0),
              torch.nested.nested_tensor([r(2, 3), r(4, 3)], requires_grad=True))


# --- TestAOTDispatch: tensor subclasses ----------------------------------------------------------

@program("aotd_dispatch_simple", D)
def _(n=3):
    def f(a, b):
        aa = torch.mul(a, 6)
        bb = torch.div(b, 2)
        return aa + bb
    return fn(f, _two(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_dispatch_inference", D)
def _(n=3):
    def f(a, b):
        return torch.mul(a, 6) + torch.div(b, 2)
    return fn(f, _two(n, 3), r(n, 3))


@program("aotd_dispatch_two_subclasses", D)
def _(n=3):
    return fn(lambda a, b: (a * b).sin(), _two(n, 3, rg=True), _two(n, 3, rg=True))


@program("aotd_dispatch_incorrect_backward", D)
def _(n=3):
    def f(a, b):
        aa = torch.mul(a, 2)
        bb = torch.add(b, 3)
        return torch.div(aa, bb), torch.add(b, b)
    return fn(f, _two(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_dispatch_output_alias", D)
def _(n=3):
    def f(a, b):
        return b.view(b.shape), a * b
    return fn(f, r(n, 3, rg=True), _two(n, 3, rg=True))


@program("aotd_dispatch_input_mutation", D)
def _(n=3):
    def f(a, b):
        a.mul_(2)
        b.mul_(3)
        return a + b
    return fn(f, r(n, 3, rg=True).add(1), _two(n, 3, rg=True).add(1))


@program("aotd_dispatch_input_metadata_mutation", D)
def _(n=3):
    def f(a, b):
        a.t_()
        b.unsqueeze_(0)
        return a + b
    return fn(f, r(n, n, rg=True).add(1), _two(n, n, rg=True).add(1))


@program("aotd_dispatch_subclass_parameter", D)
def _(n=3):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(_two(n, 3))

        def forward(self, x):
            return (x * self.w).sum()
    return fn(M(), r(n, 3))


@program("aotd_dispatch_subclass_made_inside", D)
def _(n=3):
    from torch.testing._internal.two_tensor import TwoTensor

    def f(x, y):
        t = TwoTensor(x, y).sin()
        return t.a + t.b
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_dispatch_wrapper_subclass", D)
def _(n=3):
    from torch.testing._internal.subclasses import WrapperSubclass
    return fn(lambda a, b: (a * b).cos(), WrapperSubclass(r(n, 3, rg=True)), r(n, 3, rg=True))


@program("aotd_dispatch_constant_metadata_tensor", D)
def _(n=3):
    from torch.testing._internal.custom_tensor import ConstantExtraMetadataTensor
    t = ConstantExtraMetadataTensor(r(n, 3))
    t.constant_attribute = 4
    return fn(lambda a, b: a * b + 1, t, r(n, 3, rg=True))


@program("aotd_dispatch_logging_tensor", D)
def _(n=3):
    from torch.testing._internal.logging_tensor import LoggingTensor
    return fn(lambda a, b: a.mul(b).sum(), LoggingTensor(r(n, 3)), r(n, 3, rg=True))


class Tagged(torch.Tensor):
    """A ``__torch_function__`` subclass: every op's result is a Tagged again."""


@program("aotd_dispatch_torch_function_subclass", D)
def _(n=3):
    return fn(lambda a, b: (a * b).sin(), r(n, 3, rg=True).as_subclass(Tagged), r(n, 3, rg=True))


@program("aotd_dispatch_subclass_output_made_inside", D)
def _(n=3):
    from torch.testing._internal.two_tensor import TwoTensor

    def f(x, y):
        return TwoTensor(x, y) * 2
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_dispatch_subclass_grad_made_inside", D)
def _(n=3):
    from torch.testing._internal.two_tensor import TwoTensor

    def f(x, w):
        t = TwoTensor(x * w, x + w)
        return (t.sin() * 2).sum()
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("aotd_input_view_then_inplace_view", D)
def _(n=3):
    def f(a):
        v = a.unsqueeze(0)
        a.t_()
        return v, a.unsqueeze(0)
    return fn(f, r(n, 2))


@program("aotd_intermediate_view_then_inplace_view", D)
def _(n=3):
    def f(a):
        out = a * 3
        v = out[1:]
        out.unsqueeze_(0)
        return v * 1, v, out.sum()
    return fn(f, r(n, 2, rg=True))


@program("aotd_resize_storage_bytes_up_down", D, ISO)
def _(n=8):
    def f(a):
        torch.ops.inductor.resize_storage_bytes_(a, 4 * n)
        with torch.no_grad():
            a.copy_(torch.ones(n))
        out = a.sin()
        torch.ops.inductor.resize_storage_bytes_(a, 0)
        return out
    inp = torch.zeros(n)
    inp.untyped_storage().resize_(0)
    return fn(f, inp)
