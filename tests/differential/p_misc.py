"""Module state, dtypes, strides, zero-size tensors, scalars, pytrees, and constructs that must
either work or be refused with a typed error."""
import collections
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from .programs import fn, offset_leaf, program, r, transposed_leaf

S = "module_state"


@program("batchnorm_train", S, must_match=True, calls=3)
def _(n=4):
    return fn(nn.BatchNorm1d(3), r(n, 3, rg=True))


@program("batchnorm2d_eval", S, must_match=True)
def _(n=4):
    return fn(nn.BatchNorm2d(3).eval(), r(n, 3, 2, 2, rg=True))


@program("batchnorm_momentum_none", S, calls=2)
def _(n=4):
    return fn(nn.BatchNorm1d(3, momentum=None), r(n, 3, rg=True))


class Counter(nn.Module):
    def __init__(self, in_place):
        super().__init__()
        self.in_place = in_place
        self.register_buffer("count", torch.zeros(()))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        if self.in_place:
            self.count.add_(1)
        else:
            self.count = self.count + 1
        return self.lin(x) * self.count


@program("buffer_reassigned_in_forward", S, calls=3)
def _(n=4):
    return fn(Counter(False), r(n, 3))


@program("buffer_in_place_in_forward", S, must_match=True, calls=3)
def _(n=4):
    return fn(Counter(True), r(n, 3))


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a

    def forward(self, x):
        return self.b(self.a(x))


@program("submodule_under_two_names", S)
def _(n=4):
    return fn(Shared(), r(n, 3))


@program("tied_parameters", S, must_match=True)
def _(n=4):
    m = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 3, bias=False))
    m[2].weight = m[0].weight
    return fn(m, r(n, 3))


@program("embedding_max_norm", S)
def _(n=4):
    return fn(nn.Embedding(10, 3, max_norm=1.0), torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]))


class PlainAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.acc = torch.zeros(3)

    def forward(self, x):
        self.acc.add_(x.detach().sum(0))
        return self.lin(x) + self.acc


@program("plain_tensor_attribute_mutated", S, calls=2)
def _(n=4):
    return fn(PlainAttr(), r(n, 3))


@program("dropout_module_train", S, "random", must_match=True)
def _(n=4):
    return fn(nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.4), nn.Linear(8, 2)), r(n, 3))


@program("lazy_linear", S)
def _(n=4):
    return fn(nn.LazyLinear(2), r(n, 3))


@program("transformer_encoder_eval", S, backward=False)
def _(n=4):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return fn(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval(), r(2, n, 8))


@program("module_returns_dict", S, "pytree", must_match=True)
def _(n=4):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return {"y": self.lin(x), "z": x.sum()}
    return fn(M(), r(n, 3, rg=True))


@program("conv_channels_last", S, "strides", tol=(1e-5, 1e-5))
def _(n=4):
    m = nn.Conv2d(3, 4, 3, padding=1).to(memory_format=torch.channels_last)
    return fn(m, r(2, 3, n, n).contiguous(memory_format=torch.channels_last))


@program("mlp_with_layernorm", S, must_match=True, tol=(1e-5, 1e-5))
def _(n=4):
    return fn(nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2)), r(n, 3))


# --- dtypes --------------------------------------------------------------------------

D = "dtype"


@program("float64", D, must_match=True)
def _(n=4):
    return fn(lambda x, w: (x @ w).tanh(), r(n, 3, dtype=torch.float64), r(3, 2, rg=True, dtype=torch.float64))


@program("bf16_inputs", D, must_match=True, tol=(1e-2, 1e-2))
def _(n=4):
    return fn(lambda x, w: (x @ w).relu(), r(n, 3, dtype=torch.bfloat16), r(3, 2, rg=True, dtype=torch.bfloat16))


@program("half_inputs", D, tol=(1e-3, 1e-3))
def _(n=4):
    return fn(lambda x: (x * 2).sin(), r(n, 3, rg=True, dtype=torch.float16))


@program("int_ops", D, must_match=True)
def _(n=4):
    return fn(lambda x, y: (x * y + 3, x // 2, x % 3), r(n, 3, dtype=torch.long), r(n, 3, dtype=torch.long))


@program("bool_mask", D, must_match=True)
def _(n=4):
    return fn(lambda x: (x > 0, torch.where(x > 0, x, x * 0.1), (x > 0).any()), r(n, 3, rg=True))


@program("complex_mul_abs", D, "complex")
def _(n=4):
    return fn(lambda z, w: ((z * w).abs(), z * 2), r(n, 3, dtype=torch.complex64, rg=True),
              r(n, 3, dtype=torch.complex64))


@program("type_promotion", D, must_match=True)
def _(n=4):
    return fn(lambda x, y, i: (x * y, x + i, i / 2), r(n, dtype=torch.float64, rg=True), r(n, rg=True),
              r(n, dtype=torch.int32))


@program("argmax_int_output", D, must_match=True)
def _(n=4):
    return fn(lambda x: (x.argmax(1), x.max(1).values), r(n, 3, rg=True))


@program("to_dtype_roundtrip", D, must_match=True, tol=(1e-2, 1e-2))
def _(n=4):
    return fn(lambda x: x.to(torch.bfloat16).float() * 2, r(n, 3, rg=True))


# --- strides -------------------------------------------------------------------------

T = "strides"


@program("transposed_input_elementwise", T, must_match=True)
def _(n=4):
    return fn(lambda x: x.sin() * 2, transposed_leaf(n, 3, rg=True))


@program("offset_input", T, must_match=True)
def _(n=4):
    return fn(lambda x: x.cos() + x[0], offset_leaf(n, 3, rg=True))


@program("offset_input_view_output", T)
def _(n=4):
    return fn(lambda x: (x[1], x.t()), offset_leaf(n, 3, rg=True))


@program("sliced_view_input", T)
def _(n=4):
    return fn(lambda x: (x * 2, x[1:]), torch.arange(100., 100 + 4 * (n + 2)).view(n + 2, 4)[2:5])


@program("expanded_input", T)
def _(n=4):
    return fn(lambda x: x * 2 + x.sum(0), r(3).expand(n, 3))


@program("permuted_input_output_strides", T, must_match=True)
def _(n=4):
    return fn(lambda x: (x + 1, torch.empty_like(x).fill_(2)), r(n, 3, 2, rg=True).detach().permute(2, 0, 1))


@program("channels_last_elementwise", T, must_match=True)
def _(n=4):
    return fn(lambda x: x.relu() * 2, r(2, 3, n, n).contiguous(memory_format=torch.channels_last))


# --- zero-size and scalars ------------------------------------------------------------

Z = "zero_size"


@program("zero_size_ops", Z, must_match=True)
def _(n=4):
    return fn(lambda x, w: (x @ w, x.sum(0), x.t()), r(0, 3, rg=True), r(3, n, rg=True))


@program("zero_size_input_sized_by_call", Z, must_match=True)
def _(n=4):
    # The call's size lives on an empty input (and on w): the gradient of x is empty of that size, which
    # a backward compiled for the sizes of one call would give every later call.
    return fn(lambda x, w: (x * w).sum(0) * 3, r(0, n, rg=True), r(n, rg=True))


@program("zero_size_input_alone", Z, must_match=True)
def _(n=4):
    # The call's size lives on an empty input alone: a compiler that reads sizes off non-empty inputs
    # binds it from none.
    return fn(lambda x: (x.t().contiguous() * 2, x + 1), r(0, n))


@program("zero_size_matmul_grad", Z, must_match=True)
def _(n=4):
    return fn(lambda x, w: (x @ w).sum(0) + w.sum(0), r(0, n, rg=True), r(n, n + 1, rg=True))


@program("cat_with_empty", Z, must_match=True)
def _(n=4):
    return fn(lambda x, e: torch.cat([x, e]) * 2, r(n, 3, rg=True), r(0, 3, rg=True))


@program("scalar_0dim_input", "scalar", must_match=True)
def _(n=4):
    return fn(lambda s, x: (s * x, s.exp()), r(rg=True), r(n, rg=True))


@program("python_number_output", "scalar", "pytree")
def _(n=4):
    return fn(lambda x: (x * 2, x.shape[0], 1.5, x.dim()), r(n, 3, rg=True))


@program("item_data_dependent", "scalar")
def _(n=4):
    return fn(lambda x: x * 2 if x.sum().item() > 0 else x * 3, r(n, 3, rg=True))


@program("nonzero_data_dependent_shape", "scalar")
def _(n=4):
    return fn(lambda x: x[x > 0].sum() * x, r(n, 3, rg=True))


@program("python_scalar_arg", "scalar", must_match=True)
def _(n=4):
    return fn(lambda x, k, flag: x * k if flag else x, r(n, rg=True), 2.5, True)


# An int argument that follows the size: jit bakes it (a constant of the call), Dynamo recompiles it as
# a SymInt graph input, so outputs computed from it are symbolic (it used to be left unbound: "Cannot
# convert symbols to int" at the size call).
@program("int_arg_number_output", "scalar", must_match=True)
def _(n=4):
    return fn(lambda x, k: (x * k, k + 1, k * 2.5), r(n, 3, rg=True), n)


@program("int_arg_sizes_a_view", "scalar", must_match=True)
def _(n=4):
    return fn(lambda x, k: (x.view(k, -1), x.reshape(-1, k).sum(1)), r(n, 3, rg=True), n)


@program("int_arg_in_backward", "scalar", must_match=True)
def _(n=4):
    return fn(lambda x, k: (x.repeat(2, 1)[: k + 1] * k).sin(), r(n, 3, rg=True), n)


@program("int_arg_as_offset", "scalar", must_match=True)
def _(n=4):
    return fn(lambda x, k: x.narrow(0, k - 2, 2) * x.shape[0], r(n, 3, rg=True), n)


# --- pytrees --------------------------------------------------------------------------

P = "pytree"
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    x: torch.Tensor


@program("dict_in_dict_out", P, must_match=True)
def _(n=4):
    return fn(lambda d: {"s": d["a"] + d["b"], "p": d["a"] * d["b"]}, {"a": r(n, rg=True), "b": r(n)})


@program("nested_in_out", P, must_match=True)
def _(n=4):
    def f(t):
        (a, [b, c]) = t
        return [a * b, (b + c, {"k": c.sin()})]
    return fn(f, (r(n, rg=True), [r(n), r(n, rg=True)]))


@program("none_in_out", P, must_match=True)
def _(n=4):
    return fn(lambda x, y: (x * 2, None, y), r(n, rg=True), None)


@program("kwargs", P, must_match=True)
def _(n=4):
    return fn(lambda x, *, scale, bias=None: x * scale + bias, r(n, rg=True), scale=r(n), bias=r(n, rg=True))


@program("namedtuple_out", P, must_match=True)
def _(n=4):
    return fn(lambda x: Pair(x * 2, x.sum()), r(n, rg=True))


@program("unregistered_class_output", P)
def _(n=4):
    return fn(lambda x: Box(x * 2), r(n, rg=True))


@program("unregistered_dataclass_argument", P)
def _(n=4):
    return fn(lambda b: b.x * 2, Box(r(n, rg=True)))


@program("numpy_argument", P)
def _(n=4):
    import numpy as np
    return fn(lambda x, a: x * torch.from_numpy(a), r(n), np.arange(n, dtype=np.float32))


@program("list_of_tensors_out", P, must_match=True)
def _(n=4):
    return fn(lambda xs: [x * i for i, x in enumerate(xs)], [r(n, rg=True) for _ in range(3)])


@program("size_output", P)
def _(n=4):
    return fn(lambda x: (x.shape, x.sum()), r(n, 3, rg=True))


@program("string_argument", P, must_match=True)
def _(n=4):
    return fn(lambda x, mode: x.relu() if mode == "relu" else x.sigmoid(), r(n, rg=True), "relu")


# --- ported from PyTorch's test_aotdispatch.py (the programs, not the harness) ---------

X = "aotdispatch"


@program("aot_input_mutation_simple", X, "mutation", must_match=True)
def _(n=4):
    def f(a):
        a.mul_(2)
        return a * 3
    return fn(f, *[r(3, n, rg=True).add(1)])


@program("aot_view_detach", X, "alias")
def _(n=4):
    def f(a):
        tmp = a.detach()
        a.mul_(2)
        return a, tmp
    return fn(f, r(3, n))


@program("aot_input_mutation_output_view_multiple", X, "alias")
def _(n=4):
    def f(a, b, c, d):
        b.transpose_(1, 0)
        c.add_(1)
        return d + 1, b.diagonal(), a + c
    return fn(f, r(4, 4, rg=True), r(4, 4), r(4, 4), r(4, 4, rg=True))


@program("aot_output_aliases_intermediate_inplace_view", X, "alias")
def _(n=4):
    def f(a):
        out = torch.mul(a, 3)
        out.t_()
        return out
    return fn(f, r(1, n, rg=True))


@program("aot_output_aliases_intermediate_multiple_mixed", X, "alias")
def _(n=4):
    def f(a):
        out1 = torch.mul(a, 3)
        out2 = torch.mul(a, 4)
        return out1.view(-1), out2.transpose(1, 0), out1.transpose(1, 0)
    return fn(f, r(3, n, rg=True))


@program("aot_input_data_and_metadata_mutation", X, "mutation")
def _(n=4):
    def f(a):
        a.t_()
        a[0].mul_(2)
        return a.view(a.shape)
    return fn(f, r(3, n))


@program("aot_input_mutation_and_output_view", X, "mutation")
def _(n=4):
    def f(a):
        a.add_(1)
        return a.view(-1)
    return fn(f, r(n, 3, rg=True).add(0))


@program("aot_input_mutation_resize_smaller", X, "mutation")
def _(n=4):
    def f(a, b):
        a.resize_(2, 2)
        return a + b
    return fn(f, r(3, 3), r(2, 2, rg=True))


@program("aot_output_op_depending_on_symint", X, must_match=True)
def _(n=4):
    return fn(lambda x: x.new_zeros(x.shape[0], 2) + x.sum(), r(n, 3, rg=True))


@program("aot_batchnorm_inference_mutation", X, S)
def _(n=4):
    def f(a, rm, rv):
        return F.batch_norm(a, rm, rv, training=False)
    return fn(f, r(n, 3, rg=True), torch.zeros(3), torch.ones(3))


@program("aot_batchnorm_functional_train", X, S, must_match=True)
def _(n=4):
    def f(a, w, b, rm, rv):
        return F.batch_norm(a, rm, rv, w, b, training=True, momentum=0.1)
    return fn(f, r(n, 3, 2, rg=True), r(3, rg=True), r(3, rg=True), torch.zeros(3), torch.ones(3))


@program("aot_composite_impl_mutation", X)
def _(n=4):
    def f(x):
        y = x.clone()
        y.unsqueeze_(0).mul_(2)
        return y * x
    return fn(f, r(n, 3, rg=True))


@program("aot_multi_output_view_unbind_mutated_intermediate", X, "alias")
def _(n=4):
    def f(a):
        out = a.mul(2)
        out1, out2 = out.unbind(0)[:2]
        return out1, out2, out
    return fn(f, r(n, 3, rg=True))


@program("aot_some_outputs_dont_require_grad_view", X, "alias")
def _(n=4):
    def f(a, b):
        return a.detach(), b
    return fn(f, r(2, n, rg=True), r(2, n, rg=True))


@program("aot_some_outputs_dont_require_grad_non_view", X, must_match=True)
def _(n=4):
    def f(a, b):
        return a.add(1).detach(), b
    return fn(f, r(2, n, rg=True), r(2, n, rg=True))


@program("aot_inner_grad", X, "hooks", backward=False)
def _(n=4):
    def f(x):
        y = torch.exp(x)
        z = torch.autograd.grad(y, x, torch.ones_like(y))
        return z
    return fn(f, r(n, rg=True))


@program("aot_input_mutation_requires_grad_detach", X, "mutation")
def _(n=4):
    def f(a):
        a.detach().mul_(2)
        return a + 3
    return fn(f, r(n, rg=True).add(0))


@program("aot_input_mutation_hidden_from_autograd_aliasing", X, "mutation")
def _(n=4):
    def f(a):
        a_alias = a.view(-1)
        with torch.no_grad():
            a_alias.mul_(2)
        return a + 1
    return fn(f, r(n, rg=True).add(0))


@program("aot_output_aliases_input_view_meta_replay", X, "alias")
def _(n=4):
    def f(a):
        a.add_(1)
        b = a.view(a.shape)
        return b.view(-1)[0], a.t()
    return fn(f, r(2, n))


@program("aot_input_mutation_alias_everything", X, "mutation")
def _(n=4):
    def f(a):
        c = a.view(-1)
        c.add_(1)
        d = c.view(2, -1)
        e = c.view(-1)
        return d, e
    return fn(f, r(2, n))


@program("aot_output_dict", X, P, must_match=True)
def _(n=4):
    def f(x):
        return {"a": x, "b": x * 2}
    return fn(f, r(2, n, rg=True))


@program("aot_input_mutation_metadata2", X, "metadata")
def _(n=4):
    def f(a):
        a.transpose_(1, 0)
        a.mul_(2)
        return a + 1
    return fn(f, r(2, n, rg=True).add(0))


@program("aot_input_mutation_batchnorm", X, S)
def _(n=4):
    def f(inpt, weight, bias, running_mean, running_var):
        return torch._native_batch_norm_legit(inpt, weight, bias, running_mean, running_var, True, 0.5, 1e-5)
    return fn(f, r(n, 5, 5, 5, rg=True), r(5, rg=True), r(5, rg=True), torch.ones(5), torch.ones(5))


@program("aot_real_weights_in_symbolic_mode", X, S, must_match=True)
def _(n=4):
    m = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.0))
    return fn(m, r(n, 5))


@program("aot_list_codegen", X, P, must_match=True)
def _(n=4):
    def f(a, b, c):
        return a.sin() * b.cos() * c.sin()
    return fn(f, r(n, rg=True), r(n, rg=True), r(n))


class _Memo:
    """An object the forward builds and writes; its methods call their instance ``me``, not ``self``."""

    def __init__(me, scale):
        me.scale, me.seen = scale, []

    def add(me, t):
        me.seen.append(t * me.scale)
        me.count = len(me.seen)
        return t


@program("object_built_in_the_call_without_self", S, must_match=True)
def _(n=4):
    # Writes to an object the call built are no state from before it, whatever its
    # constructor names its first argument (refused as "assigns `seen` of _Memo" before).
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            memo = _Memo(2.0)
            h = memo.add(self.fc(x))
            return h * memo.count + sum(memo.seen)
    return fn(Net(), r(n, 3, rg=True))


# Input sizes that are expressions of another input's size: under symbolic sizes each input's guard
# checks its size against the symbol another input binds, whichever input comes first.
@program("size_one_more_than_a_later_inputs")
def _(n=4):
    return fn(lambda x, w: x[1:] * w, r(n + 1, 3, rg=True), r(n, 3, rg=True))


@program("size_twice_a_later_inputs")
def _(n=4):
    return fn(lambda x, y: x.view(2, n, 3) * y, r(2 * n, 3, rg=True), r(n, 3, rg=True))
