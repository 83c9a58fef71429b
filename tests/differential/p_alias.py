"""Outputs that alias: inputs themselves, views of inputs, views of intermediates, each other."""
import torch

from .programs import fn, program, r, transposed_leaf, views_of

A = "alias"


@program("out_is_input", A, must_match=True)
def _(n=4):
    return fn(lambda x, y: (x, x * y), r(n, 3, rg=True), r(n, 3))


@program("out_is_input_no_grad", A, must_match=True)
def _(n=4):
    return fn(lambda x: x, r(n, 3))


@program("view_select", A, must_match=True)
def _(n=4):
    return fn(lambda x: x[1], r(n, 3, rg=True))


@program("view_select_no_grad", A, must_match=True)
def _(n=4):
    return fn(lambda x: x[1], torch.arange(n * 3.).view(n, 3).clone())


@program("view_slice", A, must_match=True)
def _(n=4):
    return fn(lambda x: x[1:3], r(n, 3, rg=True))


@program("view_slice_step", A)
def _(n=6):
    return fn(lambda x: x[::2, 1:], r(n, 4, rg=True))


@program("view_t", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.t(), r(n, 3, rg=True))


@program("view_view", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.view(-1), r(n, 3, rg=True))


@program("view_reshape_contiguous", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.reshape(3, n), r(n, 3, rg=True))


@program("reshape_of_transposed_input", A)
def _(n=4):
    return fn(lambda x: x.reshape(-1), transposed_leaf(n, 3, rg=True))


@program("view_flatten", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.flatten(), r(n, 2, 3, rg=True))


@program("view_as_strided", A)
def _(n=4):
    return fn(lambda x: x.as_strided((2, 2), (1, 2), 1), r(n, 3, rg=True))


@program("view_unsqueeze", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.unsqueeze(1), r(n, 3, rg=True))


@program("view_expand", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.expand(2, n, 3), r(n, 3, rg=True))


@program("view_diagonal", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.diagonal(), r(n, n, rg=True))


@program("view_unbind", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.unbind(0), r(n, 3, rg=True))


@program("view_split", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.split(2), r(n, 3, rg=True))


@program("view_split_with_sizes", A)
def _(n=4):
    return fn(lambda x: x.split([1, n - 1]), r(n, 3, rg=True))


@program("view_chunk", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.chunk(2, dim=1), r(3, n, rg=True))


@program("view_as_real", A, "complex")
def _(n=4):
    return fn(lambda x: torch.view_as_real(x), r(n, 3, dtype=torch.complex64, rg=True))


@program("view_as_complex", A, "complex")
def _(n=4):
    return fn(lambda x: torch.view_as_complex(x), r(n, 3, 2, rg=True))


@program("view_conj", A, "complex")
def _(n=4):
    return fn(lambda x: x.conj(), r(n, 3, dtype=torch.complex64, rg=True))


@program("view_real_imag", A, "complex")
def _(n=4):
    return fn(lambda x: (x.real, x.imag), r(n, 3, dtype=torch.complex64, rg=True))


@program("view_detach_input", A)
def _(n=4):
    return fn(lambda x: (x.detach(), x * 2), r(n, 3, rg=True))


@program("view_permute_movedim", A)
def _(n=4):
    return fn(lambda x: (x.permute(2, 0, 1), x.movedim(0, -1)), r(n, 2, 3, rg=True))


@program("view_narrow_unfold", A)
def _(n=6):
    return fn(lambda x: (x.narrow(0, 1, 2), x.unfold(0, 2, 2)), r(n, 3, rg=True))


@program("view_squeeze_view_as", A)
def _(n=4):
    return fn(lambda x, y: (x.squeeze(1), x.view_as(y)), r(n, 1, 3, rg=True), r(n, 3))


@program("view_chain", A)
def _(n=4):
    return fn(lambda x: x.view(2, -1).t()[1:].unsqueeze(0), r(n, 3, rg=True))


@program("view_of_intermediate", A, must_match=True)
def _(n=4):
    return fn(lambda x: (x + 1).view(-1), r(n, 3, rg=True))


@program("intermediate_and_its_view", A, must_match=True)
def _(n=4):
    def f(x):
        a = x.sin()
        return a, a[0]
    return fn(f, r(n, 3, rg=True))


@program("two_views_of_intermediate", A, must_match=True)
def _(n=4):
    def f(x):
        a = x * 2
        return a[0], a[1]
    return fn(f, r(n, 3, rg=True))


@program("view_of_intermediate_returned_twice", A)
def _(n=4):
    def f(x):
        a = x * 2
        return a, a, a.view(-1)
    return fn(f, r(n, 3, rg=True))


@program("outputs_alias_each_other_no_grad", A)
def _(n=4):
    def f(x):
        a = x * 2
        return a.t(), a.view(-1)
    return fn(f, r(n, 3))


@program("view_of_input_and_of_intermediate", A)
def _(n=4):
    return fn(lambda x: (x.view(-1), (x * 2).view(-1), x), r(n, 3, rg=True))


@program("contiguous_of_contiguous_input", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.contiguous(), r(n, 3, rg=True))


@program("contiguous_of_transposed_input", A, must_match=True)
def _(n=4):
    return fn(lambda x: x.contiguous(), transposed_leaf(n, 3, rg=True))


@program("contiguous_of_view_of_input", A)
def _(n=4):
    return fn(lambda x: x.t().contiguous(), r(n, 3, rg=True))


@program("detach_next_to_views", A, "leafness")
def _(n=4):
    def f(x):
        y = x + 1
        return y.t(), y.t().detach()
    return fn(f, r(n, 3, rg=True))


@program("detach_of_output_element", A, "leafness")
def _(n=4):
    def f(x):
        out = x * 3
        return out, out[0].detach(), out[1]
    return fn(f, r(n, 3, rg=True))


@program("view_of_mutated_input", A, "mutation")
def _(n=4):
    def f(x):
        x.mul_(2)
        return x.view(-1)
    return fn(f, r(n, 3))


@program("view_taken_before_mutation", A, "mutation")
def _(n=4):
    def f(x):
        v = x.view(-1)
        x.add_(1)
        return v
    return fn(f, r(n, 3))


@program("view_of_mutated_nonleaf_input", A, "mutation")
def _(n=4):
    def f(x):
        x.mul_(2)
        return x.t(), x + 1
    return fn(f, *views_of((n, 3), True, lambda b: b[:]))


@program("t__then_return_input", A, "metadata")
def _(n=4):
    def f(x):
        x.t_()
        return x
    return fn(f, r(n, 3))


@program("unsqueeze__then_return_view", A, "metadata")
def _(n=4):
    def f(x):
        x.unsqueeze_(0)
        return x[0], x * 2
    return fn(f, r(n, 3))


@program("intermediate_t__returned", A, "metadata")
def _(n=4):
    def f(x):
        out = x * 2
        out.t_()
        return out
    return fn(f, r(n, 3, rg=True))


@program("outputs_view_distinct_aliased_inputs", A, "aotdispatch")
def _(n=4):
    a, b = views_of((2, 2), True, lambda x: x.view(-1), lambda x: x.view(-1))
    return fn(lambda a, b: (a.view(a.shape), b.view(b.shape)), a, b)


@program("same_tensor_twice", A, "aotdispatch", must_match=True)
def _(n=4):
    x = r(n, 3, rg=True)
    return fn(lambda a, b: a * b + a, x, x)


@program("all_alias_types", A, "aotdispatch")
def _(n=4):
    def f(a):
        a.transpose_(1, 0)
        tmp = a.mul(2)
        return tmp.squeeze(), tmp.transpose(1, 0), a.unsqueeze(0)
    return fn(f, r(1, n))


@program("input_output_view_simple", A, "aotdispatch", must_match=True)
def _(n=4):
    return fn(lambda a: a.view(-1), r(2, n, rg=True))


@program("output_view_requires_grad_only_one", A, "aotdispatch")
def _(n=4):
    def f(a, b):
        return a.view(-1), b.t(), (a + b).view(-1)
    return fn(f, r(2, n, rg=True), r(2, n))


# Dtype views (``x.view(torch.int32)``) change the element size: not an as_strided of the base.
@program("dtype_view_of_input", A, must_match=True)
def _(n=4):
    return fn(lambda x: (x.view(torch.int32), x.view(torch.uint8), x * 2), r(n, 4, rg=True))


@program("dtype_view_of_input_no_grad", A, must_match=True)
def _(n=4):
    return fn(lambda x: (x.view(torch.int16).t(), x[1:].view(torch.uint8)), r(n, 4))


@program("dtype_view_of_intermediate", A, must_match=True)
def _(n=4):
    return fn(lambda x: ((x * 2).view(torch.int32), (x + 1).view(torch.bfloat16)), r(n, 4, rg=True))


@program("dtype_view_chained", A)
def _(n=4):
    return fn(lambda x: x.view(torch.int32)[1:].view(torch.float32), r(n, 4))


@program("dtype_view_complex", A)
def _(n=4):
    return fn(lambda x: (x * 1).view(torch.complex64), r(n, 4, rg=True))


@program("dtype_view_of_parameter", A, must_match=True)
def _(n=4):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return self.w.view(torch.int32), x @ self.w.t()
    return fn(M(), r(n, 4))


# --- one tensor object passed in two places: eager's callee sees one object (``x is y``, a dict or set
# keyed by it); the trace must give it one stand-in, and a call passing two objects must not run that graph.

class _Identity(torch.nn.Module):
    """``x is self.w``: an argument that is the module's own parameter."""
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x, v):
        return x * v * (2.0 if v is self.w else 3.0)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q, k, v):     # nn.MultiheadAttention packs one projection where query is key is value
        return self.a(q, k, v, need_weights=False)[0]


@program("one_object_twice_is", A, must_match=True)
def _(n=4):
    x = r(n, 3, rg=True)
    return fn(lambda x, y: x * (2.0 if x is y else 3.0), x, x)


@program("one_object_twice_written", A, must_match=True, may_refuse=("export",))
def _(n=4):
    def f(a, b, w):
        a.mul_(2)
        return (b * w).sum() + (1.0 if a is b else 0.0)
    x = r(n, 3)
    return fn(f, x, x, r(n, 3, rg=True))


@program("one_object_in_a_list_and_an_argument", A, must_match=True)
def _(n=4):
    x = r(n, 3, rg=True)
    return fn(lambda xs, y: sum(t * (2.0 if t is y else 1.0) for t in xs), [x, r(n, 3, rg=True)], x)


@program("one_object_twice_dict_key", A, must_match=True)
def _(n=4):
    def f(a, b):
        memo = {a: 1.0}
        return a * memo.get(b, 5.0)
    x = r(n, 3, rg=True)
    return fn(f, x, x)


@program("parameter_passed_as_argument", A, must_match=True)
def _(n=4):
    m = _Identity()
    return fn(m, r(n, 3, rg=True), m.w)


@program("self_attention_one_object", A, must_match=True)
def _(n=4):
    x = r(2, n, 8, rg=True)
    return fn(_Attention(), x, x, x)


@program("distinct_objects_equal_values", A, must_match=True)
def _(n=4):
    x = r(n, 3, rg=True)
    return fn(lambda x, y: x * (2.0 if x is y else 3.0), x, x.detach().clone().requires_grad_())
