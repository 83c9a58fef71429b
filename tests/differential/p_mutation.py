"""Every way a program can mutate its inputs: data, metadata, storage, through views and aliases."""
import torch

from .programs import fn, program, r, transposed_leaf, views_of

M = "mutation"


@program("add_", M, must_match=True)
def _(n=4):
    def f(x, w):
        x.add_(1)
        return x * w
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("add__returns_input", M, must_match=True)
def _(n=4):
    def f(x):
        x.add_(1)
        return x
    return fn(f, r(n, 3))


@program("copy_", M, must_match=True)
def _(n=4):
    def f(x, y):
        x.copy_(y * 2)
        return x.sum(0)
    return fn(f, r(n, 3), r(n, 3))


@program("copy__other_dtype", M)
def _(n=4):
    def f(x, y):
        x.copy_(y)
        return x + 1
    return fn(f, r(n, 3, dtype=torch.float64), r(n, 3))


@program("zero_", M, must_match=True)
def _(n=4):
    def f(x, w):
        y = x + w
        x.zero_()
        return y
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("index_put_", M, must_match=True)
def _(n=4):
    def f(x, v):
        x[torch.tensor([0, 2])] = v
        return x.sum()
    return fn(f, r(n, 3), r(3))


@program("index_add_scatter_", M)
def _(n=4):
    def f(x, y):
        x.index_add_(0, torch.tensor([0, 1, 0]), y)
        x.scatter_(1, torch.zeros(n, 1, dtype=torch.long), 7.0)
        return x * 2
    return fn(f, r(n, 3), r(3, 3))


@program("mutation_under_no_grad_of_leaf", M, must_match=True)
def _(n=4):
    def f(w, x):
        y = x @ w
        with torch.no_grad():
            w.mul_(0.9)
        return y
    return fn(f, r(3, 3, rg=True), r(n, 3))


@program("mutation_through_view", M, must_match=True)
def _(n=4):
    def f(x):
        x[0].add_(1)
        x[:, 1].mul_(2)
        return x + 1
    return fn(f, r(n, 3))


@program("mutation_through_as_strided", M)
def _(n=4):
    def f(x):
        x.as_strided((2,), (3,), 1).add_(5)
        return x * 1
    return fn(f, r(n, 3))


@program("mutation_through_as_strided_own_offset", M)
def _(n=4):
    def f(x):           # an offset inside x wherever x starts in its storage (Inductor: relative to x)
        x.as_strided((2,), (3,), x.storage_offset() + 1).add_(5)
        return x * 1
    return fn(f, r(n, 3))


@program("as_strided_of_a_view_reads", M)
def _(n=4):
    def f(x, w):
        v = x[1:]
        return v.as_strided((2, 2), (1, 3), x.storage_offset() + 4) * w
    return fn(f, r(n, 3), r(2, 2, rg=True))


@program("mutation_through_data", M, "leafness")
def _(n=4):
    def f(x):
        x.data.mul_(2)
        return x * 3
    return fn(f, r(n, 3, rg=True))


@program("mutation_through_detach", M, "leafness")
def _(n=4):
    def f(x):
        x.detach().mul_(2)
        return x * 3
    return fn(f, r(n, 3, rg=True))


@program("set_", M)
def _(n=4):
    def f(x, y):
        x.set_(y)
        return x * 2
    return fn(f, r(n, 3), r(2, n))


@program("set__then_mutate", M, "aotdispatch")
def _(n=4):
    def f(a, b):
        a.set_(b)
        a.mul_(2)
        return a + 1
    return fn(f, r(n, 3), r(n, 3))


@program("resize__smaller", M)
def _(n=4):
    def f(x):
        x.resize_(2)
        return x * 2
    return fn(f, r(n))


@program("resize__from_empty", M, "isolate")
def _(n=4):
    def f(x):
        x.resize_(n)
        x.fill_(1.5)
        return x * 2
    return fn(f, torch.empty(0))


@program("t__on_input", M, "metadata")
def _(n=4):
    def f(x):
        x.t_()
        return x + 1
    return fn(f, r(n, 3))


@program("t__on_input_backward_needs_it", M, "metadata")
def _(n=4):
    def f(x, w):
        x.t_()
        return x @ w
    return fn(f, r(3, n), r(3, 2, rg=True))


@program("squeeze__transpose__on_input", M, "metadata")
def _(n=4):
    def f(x):
        x.squeeze_(1)
        x.transpose_(0, 1)
        return x * 2
    return fn(f, r(n, 1, 3))


@program("aliased_inputs_data_and_metadata", M, "aotdispatch")
def _(n=4):
    def f(a, b):
        a.mul_(2)
        b.t_()
        return a.mul(b)
    return fn(f, *views_of((2, 2), True, lambda x: x[0], lambda x: x[0]))


@program("aliased_inputs_overlapping_views_t_", M)
def _(n=4):
    def f(a, b):
        a.mul_(2)
        b.t_()
        return a + 1, b + 1
    return fn(f, *views_of((4, 4), False, lambda x: x[:2], lambda x: x[1:3]))


@program("aliased_inputs_false_aliasing", M, "aotdispatch")
def _(n=4):
    def f(a, b):
        a.mul_(3)
        b.mul_(2)
        return a.clone().view(-1) + b.clone().view(-1)
    return fn(f, *views_of((4, 4), True, lambda x: x[0:2], lambda x: x[2:4]))


@program("aliased_inputs_interleaved", M, "aotdispatch")
def _(n=4):
    def f(a, b):
        a.mul_(3)
        b.mul_(2)
        return a * b
    return fn(f, *views_of((4, 4), False, lambda x: x[:, 0:2], lambda x: x[:, 2:4]))


@program("aliased_inputs_overlap_as_strided", M, "aotdispatch")
def _(n=4):
    def f(a, b):
        a.mul_(3)
        b.mul_(2)
        return a.clone().view(-1) + b.clone().view(-1)
    return fn(f, *views_of((256,), True, lambda x: x.as_strided((4, 4), (9, 1), 0),
                           lambda x: x.as_strided((4, 4), (9, 1), 24)))


@program("same_tensor_twice_mutated", M, "aotdispatch")
def _(n=4):
    x = r(n, 3)

    def f(a, b):
        a.add_(1)
        return a * b
    return fn(f, x, x)


@program("mutation_of_noncontiguous_view_input", M, "aotdispatch")
def _(n=4):
    def f(a):
        a.mul_(2)
        return a + 1
    return fn(f, *views_of((2, 2), True, lambda x: x[:, 0]))


@program("mutation_of_transposed_input", M, "strides")
def _(n=4):
    def f(x, w):
        x.add_(w.detach())
        return x * w
    return fn(f, transposed_leaf(n, 3), r(n, 3, rg=True))


@program("mutation_of_nonleaf_input_requiring_grad", M)
def _(n=4):
    def f(x, w):
        x.mul_(w)
        return x.sum(1)
    return fn(f, *views_of((n, 3), True, lambda b: b[:]), r(n, 3, rg=True))


@program("mutation_of_input_not_requiring_grad_by_one_that_does", M)
def _(n=4):
    def f(x, w):    # w's gradient needs x's old values: the forward must save a copy, not x itself
        x.mul_(w)
        return x.sum(1)
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("mutation_of_input_view_not_requiring_grad_by_one_that_does", M)
def _(n=4):
    def f(x, w):
        x.t()[1:].mul_(w)
        return x.sin()
    return fn(f, r(n, 3), r(2, n, rg=True))


@program("mutation_of_input_not_requiring_grad_returned", M)
def _(n=4):
    def f(x, w):
        y = x.mul_(w.exp())     # returned: the input itself, its history the write's
        return y, (y * w).sum()
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("detach__on_input", M)
def _(n=4):
    def f(x):
        x.detach_()
        return x * 2
    return fn(f, r(n, 3))


@program("copy__grad_into_no_grad_input", M, "leafness")
def _(n=4):
    def f(x, w):
        x.copy_(w)
        return x * 2
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("add__grad_into_no_grad_input", M, "leafness")
def _(n=4):
    def f(x, y):
        x.add_(y)
        return x.sum()
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("requires_grad__on_input", M, "leafness", "aotdispatch")
def _(n=4):
    def f(a, b):
        a.requires_grad_(True)
        return a.mul(3), b.mul(4)
    return fn(f, r(3, n), r(3, n, rg=True))


@program("int_counter_input", M, "dtype", must_match=True)
def _(n=4):
    def f(step, x):
        step.add_(1)
        return x * step
    return fn(f, torch.zeros((), dtype=torch.long), r(n, rg=True))


@program("mutation_of_0dim_input", M, "scalar", must_match=True)
def _(n=4):
    def f(s, x):
        s.mul_(2)
        return x * s
    return fn(f, torch.tensor(1.5), r(n, rg=True))


@program("mutated_twice_and_read_between", M)
def _(n=4):
    def f(x):
        x.add_(1)
        a = x * 2
        x.mul_(3)
        return a, x.sum()
    return fn(f, r(n, 3))


@program("view_mutated_base_returned", M)
def _(n=4):
    def f(x):
        y = x.view(-1)
        y.mul_(2)
        return x
    return fn(f, r(n, 3))


@program("mutation_of_closure_tensor", M, "module_state")
def _(n=4):
    g = torch.zeros(3)

    def f(x):
        g.add_(1)
        return x * g
    return fn(f, r(n, 3, rg=True))


@program("inplace_on_unbind_output", M, eager_raises=True)
def _(n=4):
    def f(x):
        a, b = x.unbind(0)[:2]
        a.mul_(2)
        return a + b
    return fn(f, r(n, 3, rg=True).mul(1))


@program("fill_clamp_sigmoid_inplace_intermediate", M, must_match=True)
def _(n=4):
    def f(x):
        y = x * 2
        y.clamp_(-1, 1)
        y.sigmoid_()
        return y
    return fn(f, r(n, 3, rg=True))


@program("normal__on_input", M, "random")
def _(n=4):
    def f(x):
        x.normal_()
        return x * 2
    return fn(f, r(n, 3))


@program("mutation_of_zero_size_input", M, "zero_size")
def _(n=4):
    def f(x):
        x.add_(1)
        return x * 2
    return fn(f, r(0, n))


# --- a written input read through another reference than the one the capture lifts (a plain attribute,
# a global): the trace holds that reference's tensor as a constant, as it was before the call, where
# eager's read sees the call's writes. Refused (typed), never the old values.

_HELD_ELSEWHERE: dict = {}


class _WrittenAndHeld(torch.nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.register_buffer("b", torch.ones(3))
        self.where = where
        if where == "attribute":
            self.alias = self.b[1:]
        else:
            _HELD_ELSEWHERE[id(self)] = self.b

    def forward(self, x):
        self.b.mul_(2)
        held = self.alias if self.where == "attribute" else _HELD_ELSEWHERE[id(self)][1:]
        return x * self.w * torch.cat([self.b[:1], held])


@program("buffer_written_read_through_a_plain_attribute", M, calls=2)
def _(n=4):
    return fn(_WrittenAndHeld("attribute"), r(n, 3, rg=True))


@program("buffer_written_read_through_a_global", M, calls=2)
def _(n=4):
    return fn(_WrittenAndHeld("global"), r(n, 3, rg=True))


@program("input_written_read_through_a_closure", M, calls=2)
def _(n=4):
    x = r(n, 3)
    def f(a, w):
        a.add_(1)
        return x * w        # x is the argument a: eager reads the written values
    return fn(f, x, r(n, 3, rg=True))
