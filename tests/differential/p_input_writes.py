"""Inference graphs that write their inputs, for the Inductor backend's in-graph writes
(``aotgrad/passes/input_writes.py``: ``copy_(input, new)`` at the graph's end, no epilogue copy).

The twins differ in what would make a write moved into the graph wrong: the input read again after
the write (inside the function and by the output), written twice, written with its metadata changed
too (``t_()``: must keep the epilogue), transposed or at a storage offset, broadcast into, of another
dtype than the value, an integer counter, a half-precision tensor, and an output that is a view of
the written input. No input requires grad: each is an inference graph (``backward=False``)."""
import torch

from .programs import fn, offset_leaf, program, r, transposed_leaf

W = "input_writes"


def _p(name, **options):
    return program(f"writes_{name}", W, must_match=True, backward=False, **options)


@_p("read_after")
def _(n=4):
    def f(x, y):
        x.mul_(2)
        return x + y, x.sum()
    return fn(f, r(n, 3), r(n, 3))


@_p("twice")
def _(n=4):
    def f(x):
        x.add_(1)
        x.mul_(3)
        return x * 1
    return fn(f, r(n, 3))


@_p("metadata_too")
def _(n=4):
    def f(x):           # square: the transposed new value has the input's shape
        x.t_()
        x.add_(torch.arange(float(x.numel())).view(x.shape))
        return x.sum(0)
    return fn(f, r(n, n))


@_p("transposed")
def _(n=4):
    def f(x, y):
        x.addcmul_(y, y, value=0.5)
        return x.sum()
    return fn(f, transposed_leaf(n, 3), r(n, 3))


@_p("offset")
def _(n=4):
    def f(x):
        x.lerp_(torch.ones_like(x), 0.1)
        return x.mean()
    return fn(f, offset_leaf(n, 3))


@_p("broadcast_into")
def _(n=4):
    def f(x, row):
        x.copy_(row)
        return x.clone()
    return fn(f, r(n, 3), r(3))


@_p("other_dtype_value")
def _(n=4):
    def f(x, y):
        x.copy_(y * 2)
        return x + 1
    return fn(f, r(n, 3, dtype=torch.float64), r(n, 3))


@_p("int_counter", calls=3)
def _(n=4):
    def f(step, x):
        step.add_(1)
        return x * step
    return fn(f, torch.zeros((), dtype=torch.int64), r(n, 3))


@_p("half", tol=(1e-3, 1e-3))
def _(n=4):
    def f(x, y):
        x.mul_(0.9).add_(y, alpha=0.1)
        return x.float().sum()
    return fn(f, r(n, 3, dtype=torch.bfloat16), r(n, 3, dtype=torch.bfloat16))


@_p("output_views_written")
def _(n=4):
    def f(x, g):
        x.sub_(g, alpha=0.1)
        return x[0], x.t()
    return fn(f, r(n, 3), r(n, 3))


@_p("adam_like_update", calls=3)
def _(n=4):
    def f(p, m, v, g):
        m.lerp_(g, 0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        p.addcdiv_(m, v.sqrt().add_(1e-8), value=-0.01)
        return p.norm()
    return fn(f, r(n, 3), torch.zeros(n, 3), torch.zeros(n, 3), r(n, 3))


# The eager backend brings each write forward (``early``): right after its value and the last read of
# the input's storage. These twins read the old value late, or through a view, or through the other
# written input, or make the written value feed an output and a random op too.


@_p("old_value_read_late")
def _(n=4):
    def f(x, y):
        old = x * 1             # a new tensor: x's old value, read again at the end
        x.add_(y)
        h = (y * 3).tanh()
        return h + x.sum() * 0 + old.sum(), (h * x).sum()
    return fn(f, r(n, 3), r(n, 3))


@_p("view_read_after_new_value")
def _(n=4):
    def f(x, y):
        v = x.t()               # a view of the input, read after x's new value is known
        new = x * 0.5 + y
        s = (v @ y).sum()
        x.copy_(new)
        return s, x.sum()
    return fn(f, r(n, n), r(n, n))


@_p("two_inputs_swapped")
def _(n=4):
    def f(x, y):
        nx, ny = y * 2, x + 1   # each new value reads the other input's old value
        x.copy_(nx)
        y.copy_(ny)
        return x.sum() + y.sum()
    return fn(f, r(n, 3), r(n, 3))


@_p("written_value_also_returned")
def _(n=4):
    def f(m, g):
        m.lerp_(g, 0.1)
        return m * 2, g.sum()
    return fn(f, r(n, 3), r(n, 3))


@_p("update_then_random", calls=2)
def _(n=4):
    def f(x, g):
        x.sub_(g, alpha=0.1)
        noise = torch.rand_like(x)          # eager's stream: its position must not move
        return (x * noise).sum(), torch.rand(2)
    return fn(f, r(n, 3), r(n, 3))


@_p("per_parameter_updates_between_reads", calls=3)
def _(n=4):
    def f(w1, w2, m1, m2, x):
        h = torch.tanh(x @ w1)
        out = h @ w2
        g2 = h.t() @ torch.ones_like(out)    # w2's "gradient", ready before w1 is last read
        m2.mul_(0.9).add_(g2)
        w2.sub_(m2, alpha=0.01)
        g1 = x.t() @ ((torch.ones_like(out) @ (w2 * 1).t()) * (1 - h * h))   # reads w2's new value
        m1.mul_(0.9).add_(g1)
        w1.sub_(m1, alpha=0.01)
        return out.sum()
    return fn(f, r(3, 4), r(4, 2), torch.zeros(3, 4), torch.zeros(4, 2), r(n, 3))


@_p("update_ready_before_old_value_reads", calls=2)
def _(n=4):
    def f(x, g, y):
        h = (y @ x).tanh()                  # reads x's old value
        s = (h @ x.t()).sum()               # and through a view of it
        x.sub_(g, alpha=0.1)                # needs only inputs: brought to the top, its write must wait
        return s
    return fn(f, r(3, 3), r(3, 3), r(n, 3))


@_p("copies_of_values_then_written_again")
def _(n=6):
    def f(buf, x):      # a whole step's momentum_buffer = clone(grad) of .grad views of a flat buffer
        buf.as_strided((4,), (1,), 0).add_(x)
        buf.as_strided((2,), (1,), 4).add_(1)
        kept = buf.as_strided((2,), (1,), 4).clone(), buf.as_strided((4,), (1,), 0).clone()
        buf.zero_()     # Inductor dropped the clones and wrote the values in buf: these zeroed them
        return kept
    return fn(f, r(n), r(4))


# The eager backend runs a functional ``_foreach_*`` op in place on the written inputs of its first
# list (an optimizer's foreach update) where nothing needs their values any more: these twins need
# them (another index reads one, an intermediate of the chain is written or returned).


@_p("foreach_chain", calls=3)
def _(n=4):
    def f(a, b, ga, gb):
        ys = torch._foreach_mul([a, b], 0.9)
        zs = torch._foreach_add(ys, [ga, gb], alpha=0.1)
        torch._foreach_copy_([a, b], zs)
        return a.sum() + b.sum()
    return fn(f, r(n, 3), r(3), r(n, 3), r(3))


@program("writes_foreach_in_place_reads_another_index", W, backward=False)      # refused, with the user's line
def _(n=4):
    def f(a, b, c):
        torch._foreach_add_([a, b], [c, a])          # eager: b gets a's new value (element by element)
        return a.sum() + b.sum()
    return fn(f, r(n, 3), r(n, 3), r(n, 3))


@_p("foreach_intermediate_written", calls=2)
def _(n=4):
    def f(v, w, g):
        nv = torch._foreach_addcmul(torch._foreach_mul([v, w], 0.9), [g, g], [g, g], value=0.1)
        d = torch._foreach_sqrt(nv)                  # nv is what is written: sqrt must not overwrite it
        v.copy_(nv[0])
        w.copy_(nv[1])
        return d[0].sum() + d[1].sum()
    return fn(f, r(n, 3).abs(), r(n, 3).abs(), r(n, 3))


@_p("foreach_intermediate_returned", calls=2)
def _(n=4):
    def f(x0, x1, g0, g1):
        ys = torch._foreach_mul([x0, x1], 2.0)
        zs = torch._foreach_add(ys, [g0, g1])
        x0.copy_(zs[0])
        x1.copy_(zs[1])
        return ys[0].sum(), ys[1] * 1
    return fn(f, r(n, 3), r(n, 3), r(n, 3), r(n, 3))


@_p("foreach_same_input_twice")
def _(n=4):
    def f(a, b):
        ys = torch._foreach_mul([a, a, b], 2.0)
        a.copy_(ys[1] + 1)
        b.copy_(ys[2])
        return ys[0].sum()
    return fn(f, r(n, 3), r(n, 3))
