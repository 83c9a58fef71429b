"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``; issue #60) as inputs and made
inside, compared with eager through ``tests.eager_check`` under every entry point, and a model
trained on variable-length batches for several SGD steps next to eager, bitwise.

A jagged nested tensor is a traceable wrapper subclass whose inner tensors are its values and
offsets (and cached min/max sequence lengths held as the shapes of empty tensors); its ragged size
is a nested int, the identity of its offsets tensor (``inputs/subclasses.py``: ``Meta.ties``).
"""
import pytest
import torch
from torch import nn

import aotgrad
from tests.differential.entries import ENTRIES
from aotgrad.errors import UnsupportedError
from tests.eager_check import assert_refused, check

ENTRY_NAMES = ["capture", "jit", "dynamo"]


def _jagged(lengths=(2, 3), dim=4, requires_grad=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, dim, dtype=dtype) for n in lengths], layout=torch.jagged,
                                      requires_grad=requires_grad)


class _Linear(nn.Module):
    """Linear + relu + sum over a variable-length batch."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = nn.Linear(4, 3, dtype=dtype)

    def forward(self, nt):
        return torch.relu(self.lin(nt)).sum()


class _Values(nn.Module):
    """Attention-ish: the values and offsets of a projected batch used directly."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, nt):
        q, k = self.q(nt), self.k(nt)
        scores = (q * k).softmax(-1)
        return (scores.values() * nt.offsets()[1:].sum()).tanh(), scores


class _Pooled(nn.Module):
    """Sum pooling over the ragged dimension (padded: a dense result) and a head."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, nt):
        return self.head(torch.tanh(self.lin(nt)).to_padded_tensor(0.0).sum(dim=1))


def _made_inside(values, offsets):
    return torch.nested.nested_tensor_from_jagged(values, offsets).sin().values()


def _made_inside_nested_out(values, offsets):
    nt = torch.nested.nested_tensor_from_jagged(values, offsets)
    return nt * 2, nt.cos().amax(dim=1)


def _sharing_offsets():
    torch.manual_seed(0)
    v, o = torch.randn(5, 4), torch.tensor([0, 2, 5])
    a, b = (torch.nested.nested_tensor_from_jagged(v * k, o).requires_grad_() for k in (1, 2))
    return (lambda a, b: (a * b).sin()), (a, b), {}


def _with_lengths():       # offsets with holes: a non-contiguous nested tensor
    torch.manual_seed(0)
    nt = torch.nested.nested_tensor_from_jagged(torch.randn(8, 4), torch.tensor([0, 3, 8]), torch.tensor([2, 4]))
    return (lambda nt: (nt.sin() * 2).values().sum()), (nt,), {}


def _written_under_no_grad(nt):
    with torch.no_grad():
        nt.values().mul_(2)
    return nt.values().sum()


PROGRAMS = {
    "returned as is": lambda: (lambda nt: nt, (_jagged(),), {}),
    "returned beside an op on it": lambda: (lambda nt: (nt, nt.cos()), (_jagged(),), {}),
    "two inputs sharing offsets": _sharing_offsets,
    "with lengths": _with_lengths,
    "values written under no_grad": lambda: (_written_under_no_grad, (_jagged(requires_grad=False),), {}),
    "unbind": lambda: ((lambda nt: torch.stack([t.sum(0) for t in nt.unbind()])), (_jagged(),), {}),
    "offsets in arithmetic": lambda: ((lambda nt: nt.values() * nt.offsets().diff().repeat_interleave(
        nt.offsets().diff()).unsqueeze(1)), (_jagged(),), {}),
    "input op, nested output": lambda: (lambda nt: nt.sin() * 2, (_jagged(),), {}),
    "input not requiring grad": lambda: (_Linear(), (_jagged(requires_grad=False),), {}),
    "linear relu sum": lambda: (_Linear(), (_jagged(),), {}),
    "linear relu sum, float64": lambda: (_Linear(torch.float64), (_jagged(dtype=torch.float64),), {}),
    "values and offsets": lambda: (_Values(), (_jagged(),), {}),
    "padded sum over the ragged dim": lambda: (_Pooled(), (_jagged((3, 1, 2)),), {}),
    "beside a plain input": lambda: (lambda a, b: (a * 2).values().sum() + b.sum(),
                                     (_jagged(requires_grad=False), torch.randn(3, requires_grad=True)), {}),
    "made inside, values out": lambda: (_made_inside, (torch.randn(5, 4, requires_grad=True),
                                                       torch.tensor([0, 2, 5])), {}),
    "made inside, nested out": lambda: (_made_inside_nested_out, (torch.randn(6, 4, requires_grad=True),
                                                                  torch.tensor([0, 1, 6])), {}),
}


FAST = {"input op, nested output", "linear relu sum", "values and offsets", "made inside, values out",
        "returned beside an op on it"}       # in make test; the others are slow rows


@pytest.mark.parametrize("entry", ENTRY_NAMES)
@pytest.mark.parametrize("program", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in PROGRAMS])
def test_jagged_program_is_eager(program, entry):
    torch._dynamo.reset()
    check(None, make=PROGRAMS[program], compile=ENTRIES[entry].compile)


def _sdpa(q):
    return torch.nn.functional.scaled_dot_product_attention(q, q, q).values().sum()


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_jagged_sdpa_on_cpu_is_refused_naming_the_op(entry):
    """SDPA on a jagged tensor on CPU builds a nested tensor from a list of tensors (the math path),
    an operation aotgrad's graphs do not hold; torch.compile runs it (test above covers Dynamo's split)."""
    def make():
        torch.manual_seed(0)
        q = torch.nested.nested_tensor([torch.randn(2, 2, 4), torch.randn(3, 2, 4)], layout=torch.jagged,
                                       requires_grad=True).transpose(1, 2)
        return _sdpa, (q,), {}
    e = assert_refused(None, make=make, compile=ENTRIES[entry].compile)
    assert isinstance(e, UnsupportedError) and "_nested_tensor_from_tensor_list" in str(e) and e.user_line, e


def test_jagged_gradient_shares_the_inputs_offsets():
    """Eager's ``.grad`` of a nested tensor holds the input's own offsets (its nested int is the
    input's); the compiled one must too, or ``nt.grad + nt`` would fail."""
    nt = _jagged()
    aotgrad.capture(lambda t: t.sin().values().sum(), nt).compile()(nt).backward()
    assert nt.grad._offsets is nt._offsets and (nt.grad + nt).shape[1] == nt.shape[1]


def test_jagged_capture_is_not_specialised_to_the_offsets():
    """Two batches of the same total length but other sequence lengths: one graph, the offsets are data."""
    f = _Pooled()
    captured = aotgrad.capture(f, _jagged((2, 3), requires_grad=False)).compile()
    for lengths in [(3, 2), (2, 3)]:
        nt = _jagged(lengths, requires_grad=False, seed=7)
        torch.testing.assert_close(captured(nt), f(nt), rtol=0, atol=0)


def test_jagged_capture_refuses_another_total_length():
    captured = aotgrad.capture(_Pooled(), _jagged((2, 3), requires_grad=False)).compile()
    with pytest.raises(aotgrad.errors.InputMismatchError):
        captured(_jagged((2, 4), requires_grad=False))


# --- training on variable-length batches, bitwise next to eager

STEPS = 3


def _model():
    torch.manual_seed(0)
    return _Pooled()


def _batch(i, varying):
    """Batch ``i``: under ``varying`` its total length and lengths change per step; otherwise only the
    lengths (a staged capture was made for one total length and min/max sequence length)."""
    lengths = [(2, 3, 1), (1, 4, 3), (5, 2, 2), (3, 3, 3)][i] if varying else [(2, 3, 1), (3, 1, 2), (1, 2, 3)][i % 3]
    torch.manual_seed(200 + i)
    return torch.nested.nested_tensor([torch.randn(n, 4) for n in lengths], layout=torch.jagged)


def _target(i):
    torch.manual_seed(300 + i)
    return torch.randn(3, 2)


def _stepper(model, opt):
    def step(x, y):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _train(entry, varying):
    torch._dynamo.reset()
    eager, model = _model(), _model()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want, got = _stepper(eager, opt_e), _stepper(model, opt_m)
    if entry == "step jit":
        fn = aotgrad.jit(got)
    elif entry == "step capture":      # after one eager step: the optimizer's state exists
        want(_batch(-1, varying), _target(-1)), got(_batch(-1, varying), _target(-1))
        fn = aotgrad.capture(got, _batch(-1, varying), _target(-1)).compile()
    else:
        fwd = {"capture": lambda: aotgrad.capture(model, _batch(0, varying)).compile(),
               "jit": lambda: aotgrad.jit(model), "dynamo": lambda: torch.compile(model, backend="aotgrad")}[entry]()
        fn = _stepper(fwd, opt_m)
    same = []
    for i in range(STEPS):
        a, b = want(_batch(i, varying), _target(i)), fn(_batch(i, varying), _target(i))
        same.append(torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(eager.parameters(),
                                                                                 model.parameters())))
    return same


@pytest.mark.parametrize("entry", ["capture", "jit", "dynamo", "step jit", "step capture"])
def test_jagged_batches_train_bitwise(entry):
    assert _train(entry, varying=False) == [True] * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["jit", "dynamo", "step jit"])
def test_jagged_batches_of_varying_total_length_train_bitwise(entry):
    assert _train(entry, varying=True) == [True] * STEPS


@pytest.mark.parametrize("entry", ENTRY_NAMES)
@pytest.mark.parametrize("program", ["linear relu sum", "input op, nested output"])
def test_jagged_program_called_under_no_grad_is_eager(program, entry):
    torch._dynamo.reset()
    check(None, make=PROGRAMS[program], compile=ENTRIES[entry].compile, call_context=torch.no_grad)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["inductor", "jit_inductor", "dynamo_inductor", "min_cut"])
@pytest.mark.parametrize("program", ["linear relu sum", "values and offsets", "made inside, values out",
                                     "input op, nested output"])
def test_jagged_program_through_other_backends_is_eager(program, entry):
    torch._dynamo.reset()
    e = ENTRIES[entry]
    check(None, make=PROGRAMS[program], compile=e.compile, rtol=max(e.tol[0], 1.3e-6), atol=max(e.tol[1], 1e-5))
