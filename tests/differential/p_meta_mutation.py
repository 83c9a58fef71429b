"""In-place metadata mutations of inputs (``t_()``, ``transpose_()``, ``unsqueeze_()``, ``squeeze_()``,
``as_strided_()``), as PyTorch's AOTAutograd tests make them (test_aotdispatch.py's
``test_input_mutation_metadata*``, ``test_input_data_and_metadata_mutation*``, the aliased-input
metadata programs): each op x what requires grad (nothing, a non-leaf, a leaf changed under
``no_grad``, a leaf changed with grad: eager raises) x what follows (nothing, a data write, the input
returned with a view of it) x aliasing (the input alone, two views of one base, the changed view next
to a written one, one tensor passed twice).

The compiled program replays the change on the caller's tensor after the graph ran: ``as_strided_``
under grad where autograd recorded it (eager's ``TBackward`` becomes an ``AsStridedBackward`` with the
same gradient), the storage re-set without autograd otherwise.
"""
import torch

from .programs import fn, program, r, views_of

D = "aotdispatch"
META = "metadata_mutation"

# op name -> (input shape for size n, the op)
OPS = {
    "t_": (lambda n: (n, 3), lambda a: a.t_()),
    "transpose_": (lambda n: (n, 1, 3), lambda a: a.transpose_(0, 2)),
    "unsqueeze_": (lambda n: (n, 3), lambda a: a.unsqueeze_(1)),
    "squeeze_": (lambda n: (n, 1, 3), lambda a: a.squeeze_(1)),
    "as_strided_": (lambda n: (n, 3), lambda a: a.as_strided_((a.shape[1], a.shape[0]), (1, a.shape[1]))),
}


def _input(shape, grad):
    """``grad``: ``none``, ``nonleaf`` (a non-leaf that requires grad), ``leaf`` (a leaf that does)."""
    if grad == "none":
        return r(*shape)
    x = r(*shape, rg=True)
    return x.mul(1) if grad == "nonleaf" else x


def _body(op, then, no_grad=False):
    def f(a, w):
        if no_grad:
            with torch.no_grad():
                op(a)
        else:
            op(a)
        if then == "write":
            a.mul_(2)
        out = a * 2 + w.sum()
        if then == "return":
            return out, a, a.unsqueeze(0)
        return out
    return f


def _register(name, grad, then):
    shape, op = OPS[name]
    no_grad = grad == "leaf_no_grad"
    # A leaf that requires grad changed in place with grad on: eager raises (and so does a write to it).
    raises = grad == "leaf" or (grad == "leaf_no_grad" and then == "write")
    # A leaf's layout changed under no_grad: eager's gradient follows the new layout, the graph's input
    # the old one (refused; Dynamo runs the change itself and hands the backend the changed leaf).

    @program(f"meta_{name}_{grad}_{then}", META, D, eager_raises=raises, must_match=grad in ("none", "nonleaf"))
    def _(n=3):
        return fn(_body(op, then, no_grad), _input(shape(n), "leaf" if no_grad else grad), r(3, rg=True))


for _name in OPS:
    for _grad in ("none", "nonleaf", "leaf_no_grad", "leaf"):
        for _then in ("none", "write", "return"):
            _register(_name, _grad, _then)


# --- aliased inputs ------------------------------------------------------------------------------

def _aliased(op, write_other):
    def f(a, b):
        op(a)
        if write_other:
            b.mul_(2)
        return a * 2, b + 1
    return f


for _name in ("t_", "unsqueeze_", "as_strided_"):
    for _rg in (False, True):
        _op = OPS[_name][1]

        @program(f"meta_{_name}_aliased_views{'_rg' if _rg else ''}", META, D, must_match=True)
        def _(n=4, _op=_op, _rg=_rg):
            a, b = views_of((n, 4), _rg, lambda x: x[:, 1:], lambda x: x[1:, :2])
            return fn(_aliased(_op, False), a, b)

        # The changed view shares storage with one the function writes: a synthetic base would lose the
        # layout change (torch replays it from an extra output; refused here, naming the line).
        @program(f"meta_{_name}_aliased_other_written{'_rg' if _rg else ''}", META, D)
        def _(n=4, _op=_op, _rg=_rg):
            a, b = views_of((n, 4), _rg, lambda x: x[:, 1:], lambda x: x[1:, :2])
            return fn(_aliased(_op, True), a, b)


@program("meta_t__same_tensor_twice", META, D)
def _(n=3):
    def f(a, b):
        a.t_()
        return a + 1, b * 2        # b is a: eager's b is transposed too
    x = r(n, n)
    return fn(f, x, x)


@program("meta_t__input_view_of_module_state", META, D, must_match=True)
def _(n=3):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, n))

        def forward(self, x):
            x.t_()
            return x @ self.w.t()
    return fn(M(), r(3, n).mul(1))
