"""``t.data = v`` and ``torch.utils.swap_tensors`` inside a captured function (not a training step:
``test_step_attacks`` has those). Eager points ``t`` at ``v``'s storage and layout, keeping ``t``'s
autograd identity; the trace records it as ``set_()`` under ``no_grad`` (the caller's tensor then lies
in the new storage, other views of its old one keep their values), or refuses what the graph cannot
repeat, leaving everything as it was. Both were silently dropped: the graph never saw the write."""
from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad import errors
from tests.eager_check import assert_refused, check

ENTRIES = {"capture": None, "jit": lambda fn, a, k, **o: aotgrad.jit(fn)}
G = torch.ones(3)


def _inputs():
    return (torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)), {}


def _doubled(x, y):
    x.data = x.data * 2
    return x * y


def _other_input(x, y):
    x.data = y.detach()
    return x + 1, x.sum()


def _intermediate(x, y):
    z = x * y
    z.data = torch.ones(4, 4)
    return z * 3


def _rows_of(x, y):
    x.data = x.data[:2]
    return x.sum() + y.sum(), x.shape[0] * y


def _read_after(x, y):
    x.data = torch.zeros(2, 8)
    return x.view(-1) + y.view(-1)


def _view_of_input(base, y):
    x = base[1:]        # a view of the caller's tensor: the caller's keeps its values
    x.data = x.data + 1
    return x.sum() * y, base * 1


MATCH = {"doubled": _doubled, "other_input": _other_input, "intermediate": _intermediate, "rows_of": _rows_of,
         "read_after": _read_after, "view_of_input": _view_of_input}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", MATCH)
def test_data_assignment_is_eagers(name, entry):
    kw = {} if ENTRIES[entry] is None else {"compile": ENTRIES[entry]}
    check(MATCH[name], make=_inputs, calls=2 if entry == "jit" else 1, **kw)


def _other_dtype(x, y):
    x.data = x.data.double()
    return x * 2


def _global(x, y):
    G.data = x[0, :3] * 1
    return x + y


def _requires_grad(x, y):
    y.data = torch.zeros(4, 4)
    return (x * 2).sum()


def _swap(x, y):
    torch.utils.swap_tensors(x, y)
    return x + 1


REFUSED = {"other_dtype": (_other_dtype, errors.UnsupportedError, "another dtype"),
           "global": (_global, errors.UnsupportedError, "one it does not hold"),
           "requires_grad": (_requires_grad, errors.MutationError, "set_"),
           "swap_tensors": (_swap, errors.UnsupportedError, "swap_tensors")}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", REFUSED)
def test_data_assignment_refused_untouched(name, entry):
    fn, kind, words = REFUSED[name]
    before = G.clone()
    kw = {} if ENTRIES[entry] is None else {"compile": ENTRIES[entry]}
    e = assert_refused(fn, make=_inputs, **kw)
    assert isinstance(e, kind) and words in str(e) and "test_data_writes.py" in str(e), e
    assert torch.equal(G, before)


def test_parameter_data_assignment_is_refused_by_its_line():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            self.w.data = self.w.data * 2
            return self.w * x
    e = assert_refused(M(), (torch.ones(3),))
    assert isinstance(e, errors.MutationError) and "self.w.data = self.w.data * 2" in str(e)


def test_data_assignment_outside_a_capture_is_torchs():
    """The setter is patched process-wide while a capture traces; another thread's (here: after the
    capture, and of a tensor the capture never saw) is torch's own."""
    x = torch.zeros(3)
    aotgrad.capture(_doubled, torch.randn(4, 4), torch.randn(4, 4)).compile()
    x.data = torch.ones(2)
    assert x.tolist() == [1.0, 1.0]
