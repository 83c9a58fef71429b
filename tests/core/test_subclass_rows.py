"""Subclass rows of the adversarial family (issue #60): symbolic sizes of a subclass's inner tensors
(one ``capture(dynamic=True)`` called at several sizes, every call compared with eager: outputs, their
inner tensors, and gradients), through every entry point; and what stays refused, naming the subclass.
"""
import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.testing._internal.subclasses import WrapperSubclass
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.errors import InputMismatchError, UnsupportedError
from tests.eager_check import assert_close, assert_refused

SIZES = (3, 5, 7)
CLASSES = {"TwoTensor": lambda a: TwoTensor(a, a * 2), "WrapperSubclass": WrapperSubclass}


def _input(cls, n, rg=True, dtype=torch.float32):
    torch.manual_seed(n)
    return CLASSES[cls](torch.randn(n, 4, dtype=dtype)).requires_grad_(rg)


def _elementwise(x):
    return (x.sin() * 2).cos()


def _reduced(x):
    return x.tanh().sum(dim=1)


class _Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).relu()


PROGRAMS = {"elementwise": lambda: _elementwise, "reduced": lambda: _reduced, "linear": _Weighted}

DYNAMIC = {
    "capture": lambda fn, *xs: aotgrad.capture(fn, *xs, dynamic=True).compile(),
    "jit": lambda fn, *xs: aotgrad.jit(fn, dynamic=True),
    "dynamo": lambda fn, *xs: torch.compile(fn, backend="aotgrad", dynamic=True),
}


def _grads(fn, x, out):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward() if type(out) is torch.Tensor else (out * CLASSES[type(out).__name__](w)).sum().backward()
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    return [x.grad, *(p.grad for p in params)]


def _rows():     # TwoTensor's elementwise and linear rows in make test, the rest slow
    return [pytest.param(c, p, marks=() if c == "TwoTensor" and p != "reduced" else pytest.mark.slow)
            for c in CLASSES for p in PROGRAMS]


@pytest.mark.parametrize("entry", list(DYNAMIC))
@pytest.mark.parametrize("cls, program", _rows())
def test_subclass_input_with_symbolic_sizes_is_eager_at_every_size(cls, program, entry):
    """One compiled function, called at several sizes: the subclass's outer size is its first inner
    tensor's (``Meta.size`` None), symbolic in the trace, read from the inputs at run time."""
    torch._dynamo.reset()
    fn_e, fn_c = PROGRAMS[program](), PROGRAMS[program]()
    compiled = DYNAMIC[entry](fn_c, _input(cls, SIZES[0]))
    for n in SIZES:
        x_e, x_c = _input(cls, n), _input(cls, n)
        out_e, out_c = fn_e(x_e), compiled(x_c)
        assert_close(out_e, out_c, f"output at size {n}", 0, 0)
        for k, (a, b) in enumerate(zip(_grads(fn_e, x_e, out_e), _grads(fn_c, x_c, out_c))):
            assert_close(a, b, f"gradient {k} at size {n}", 0, 0)
        for p in (fn_e.parameters() if isinstance(fn_e, nn.Module) else ()):
            p.grad = None
        for p in (fn_c.parameters() if isinstance(fn_c, nn.Module) else ()):
            p.grad = None


# --- a plain input whose gradient is a subclass, with symbolic sizes: its carriers take the input's
# symbols in the trace and its size at run time (Promoted.like None)

def _plain(n, rg=True, cols=4):
    torch.manual_seed(100 + n)
    return torch.randn(n, cols).requires_grad_(rg) if n else torch.randn(cols).requires_grad_(rg)


PROMOTED = {     # (function, inputs at size n): the plain inputs' eager .grad is a subclass
    "beside": (lambda x, y: (x * y).sin(), lambda c, n: (_input(c, n), _plain(n))),
    "also used plainly": (lambda x, y: (x * y).sin() + y.exp(), lambda c, n: (_input(c, n), _plain(n))),
    "broadcast bias": (lambda x, b: (x + b).tanh(), lambda c, n: (_input(c, n), _plain(0))),
    "subclass without grad": (lambda x, y: (x * y).cos(), lambda c, n: (_input(c, n, rg=False), _plain(n))),
    "nested subclass": (lambda x, y: (x * y).cos(),
                        lambda c, n: (TwoTensor(_input(c, n, False), _input(c, n, False)).requires_grad_(), _plain(n))),
    "two promoted": (lambda x, y, z: x * y + z * x, lambda c, n: (_input(c, n, rg=False), _plain(n), _plain(n))),
}
FAST = ("beside",)     # in make test (~1.3 s each: three sizes); the rest slow


@pytest.mark.parametrize("entry", list(DYNAMIC))
@pytest.mark.parametrize("cls, case", [pytest.param(c, p, marks=() if c == "TwoTensor" and p in FAST else pytest.mark.slow)
                                       for c in CLASSES for p in PROMOTED])
def test_plain_input_with_subclass_grad_and_symbolic_sizes_is_eager_at_every_size(cls, case, entry):
    if case == "nested subclass" and cls != "TwoTensor":
        pytest.skip("a TwoTensor of the class")
    torch._dynamo.reset()
    fn, inputs = PROMOTED[case]
    compiled = DYNAMIC[entry](fn, *inputs(cls, SIZES[0]))
    for n in SIZES:
        ins_e, ins_c = inputs(cls, n), inputs(cls, n)
        out_e, out_c = fn(*ins_e), compiled(*ins_c)
        assert_close(out_e, out_c, f"output at size {n}", 0, 0)
        w = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(n))
        (out_e * w).sum().backward(), (out_c * w).sum().backward()
        for k, (a, b) in enumerate(zip(ins_e, ins_c)):
            assert type(a.grad) is type(b.grad), f"gradient {k} at size {n}: {type(a.grad)} vs {type(b.grad)}"
            assert_close(a.grad, b.grad, f"gradient {k} at size {n}", 0, 0)


def test_promoted_input_with_symbolic_sizes_checks_the_gradient_it_carries():
    """A later call's subclass gradient is checked against the trace's structure and the carriers' sizes
    (``Promoted.carried``, the subclass input's unflatten): another class is refused as the backward runs."""
    fn = PROMOTED["beside"][0]
    compiled = aotgrad.capture(fn, _input("TwoTensor", 3), _plain(3), dynamic=True).compile()
    x, y = _input("TwoTensor", 5), _plain(5)
    out = compiled(x, y)
    with pytest.raises(UnsupportedError, match="is a WrapperSubclass"):
        out.backward(WrapperSubclass(torch.ones(5, 4)))
    assert y.grad is None


# --- jagged nested tensors with symbolic sizes: total length and sequence lengths vary

def _jagged(lengths, rg=True):
    torch.manual_seed(sum(lengths))
    return torch.nested.nested_tensor([torch.randn(n, 4) for n in lengths], layout=torch.jagged, requires_grad=rg)


def _pooled(nt):
    return nt.sin().to_padded_tensor(0.0).sum(dim=1)


def test_jagged_capture_with_symbolic_sizes_serves_other_lengths():
    compiled = aotgrad.capture(_pooled, _jagged((2, 3)), dynamic=True).compile()
    for lengths in [(2, 3), (3, 5), (6, 2), (4, 4)]:
        a, b = _jagged(lengths), _jagged(lengths)
        out_e, out_c = _pooled(a), compiled(b)
        assert_close(out_e, out_c, f"output for {lengths}", 0, 0)
        out_e.sum().backward(), out_c.sum().backward()
        assert_close(a.grad, b.grad, f"gradient for {lengths}", 0, 0)
        assert b.grad._offsets is b._offsets
    with pytest.raises(InputMismatchError):      # the batch size is the outer size's, static
        compiled(_jagged((2, 3, 4)))


# --- a subclass input returned as it is: the caller's very tensor (identity, is_leaf, history)

@pytest.mark.parametrize("entry", ["capture", "jit", "dynamo"])
@pytest.mark.parametrize("cls", list(CLASSES))
def test_subclass_input_returned_as_is_is_the_callers_tensor(cls, entry):
    from tests.differential.entries import ENTRIES
    from tests.eager_check import check
    torch._dynamo.reset()
    run = check(None, make=lambda: ((lambda x, y: (x, x * y)), (_input(cls, 3), torch.randn(3, 4)), {}),
                compile=ENTRIES[entry].compile)
    assert run.out[0] is run.args[0]


# --- a returned view of a subclass input with symbolic sizes: its layout as expressions over the input's
# own size and stride, evaluated on the caller's input (InputOut.binds)

VIEWS = {
    "same shape": lambda x, y: (x.view(x.shape), x * y),
    "transposed beside the input": lambda x, y: (x.t(), x),
    "half": lambda x, y: x[: x.shape[0] // 2],      # a floor division of the symbol
    "narrowed, transposed": lambda x, y: x.narrow(0, 1, x.shape[0] - 1).t(),
    "flattened beside a value": lambda x, y: (x.view(-1), x.sin()),   # (two gradients: their sum is exact)
    "row of a view": lambda x, y: x.t()[1],
}


@pytest.mark.parametrize("entry", list(DYNAMIC))
@pytest.mark.parametrize("case", list(VIEWS))
def test_returned_view_of_subclass_input_with_symbolic_sizes_is_eager_at_every_size(case, entry):
    torch._dynamo.reset()
    fn = VIEWS[case]
    compiled = DYNAMIC[entry](fn, _input("TwoTensor", 5), _plain(5, rg=False))
    for n in (5, 7, 9):
        x_e, x_c, y = _input("TwoTensor", n), _input("TwoTensor", n), _plain(n, rg=False)
        out_e, out_c = fn(x_e, y), compiled(x_c, y)
        for k, (a, b) in enumerate(zip(pytree.tree_leaves(out_e), pytree.tree_leaves(out_c))):
            assert_close(a, b, f"output {k} at size {n}", 0, 0)
            assert (a.stride(), a.storage_offset(), a._base is x_e, a is x_e) == \
                (b.stride(), b.storage_offset(), b._base is x_c, b is x_c), f"output {k} at size {n}"
        weights = [CLASSES["TwoTensor"](torch.randn(a.shape, generator=torch.Generator().manual_seed(k)))
                   for k, a in enumerate(pytree.tree_leaves(out_e))]
        sum((a * w).sum() for a, w in zip(pytree.tree_leaves(out_e), weights)).backward()
        sum((b * w).sum() for b, w in zip(pytree.tree_leaves(out_c), weights)).backward()
        assert_close(x_e.grad, x_c.grad, f"gradient at size {n}", 0, 0)


# --- a subclass input changed in place with symbolic sizes: its new layout as expressions over its old
# one, replayed by as_strided_; a write autograd records put back by copy_ under grad (PutBack)

IN_PLACE = {
    "written under grad": lambda x, y: x.mul_(y).sin(),
    "transposed": lambda x, y: x.t_() * 2,
    "unsqueezed, then written": lambda x, y: x.unsqueeze_(0).add_(y).cos(),
    "row written": lambda x, y: x[1].mul_(3).sum() + x.sum(),
}


def _in_place_rows():     # the written and transposed rows under capture in make test, the rest slow
    return [pytest.param(c, e, marks=() if e == "capture" and c in ("written under grad", "transposed") else
                         pytest.mark.slow) for c in IN_PLACE for e in DYNAMIC]


@pytest.mark.parametrize("case, entry", _in_place_rows())
def test_subclass_input_changed_in_place_with_symbolic_sizes_is_eager_at_every_size(case, entry):
    torch._dynamo.reset()
    fn = IN_PLACE[case]
    compiled = DYNAMIC[entry](fn, _input("TwoTensor", 5) * 1, _plain(5, rg=False))
    for n in (5, 7, 9):
        leaf_e, leaf_c, y = _input("TwoTensor", n), _input("TwoTensor", n), _plain(n, rg=False)
        x_e, x_c = leaf_e * 1, leaf_c * 1
        out_e, out_c = fn(x_e, y), compiled(x_c, y)
        assert_close(out_e, out_c, f"output at size {n}", 0, 0)
        assert_close(x_e, x_c, f"input after the call at size {n}", 0, 0)
        assert (x_e.shape, x_e.stride(), x_e.requires_grad) == (x_c.shape, x_c.stride(), x_c.requires_grad)
        w = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(n))
        ((out_e * w).sum() + x_e.sum()).backward(), ((out_c * w).sum() + x_c.sum()).backward()
        assert_close(leaf_e.grad, leaf_c.grad, f"gradient at size {n}", 0, 0)


# --- still refused, naming the subclass and the user's line

def _returns_view(x, y):
    return x[: y.shape[0]]


@pytest.mark.parametrize("entry", ["capture", "jit"])
@pytest.mark.parametrize("case", ["returned view made inside", "returned view with symbolic sizes not its own"])
def test_still_refused_rows(case, entry):
    compile = (lambda fn, a, k: aotgrad.capture(fn, *a, **k).compile()) if entry == "capture" else \
        (lambda fn, a, k: aotgrad.jit(fn))
    if case == "returned view with symbolic sizes not its own":      # another input's size: no expression of its own
        compile = (lambda fn, a, k: aotgrad.capture(fn, *a, dynamic=True, **k).compile()) if entry == "capture" \
            else (lambda fn, a, k: aotgrad.jit(fn, dynamic=True))
    make = {"returned view with symbolic sizes not its own": lambda: (_returns_view, (_input("TwoTensor", 5),
                                                                                       torch.randn(3)), {}),
            "returned view made inside": lambda: ((lambda x: (x * 2)[0]), (_input("TwoTensor", 3),), {}),
            }[case]
    e = assert_refused(None, make=make, compile=compile)
    assert isinstance(e, UnsupportedError) and "TwoTensor" in str(e) and e.user_line, e
    assert entry == "jit" or "test_subclass_rows.py" in str(e), e      # (jit: the call's line)
