"""Inputs that share a storage without sharing a byte, one of them written: each is an input of its
own (as in PyTorch's AOTAutograd), no synthetic base. Captured so, then called with the views moved:
apart as captured, elsewhere in the base, swapped, in separate storages, touching the written
bytes, the very same bytes. Each call on fresh inputs must equal eager (outputs, the base, gradients)
or be a typed error that leaves the inputs untouched; ``jit`` recompiles and so always equals eager.
A graph that took the two for independent inputs would return wrong values for the overlapping ones
(eager's read sees the write)."""
import pytest
import torch

import aotgrad
from aotgrad import errors

from .test_aliased_placement import _compile, _run

# (name, offset of the written view, offset of the read view; None: a storage of its own)
PLACES = {"as_captured": (0, 3), "gap": (0, 5), "swapped": (4, 0), "separate": (0, None),
          "overlapping": (0, 2), "same_bytes": (1, 1), "read_inside": (0, 1)}


def _inputs(w_off, r_off, rg):
    base = torch.arange(10.0).requires_grad_(rg)
    b = base * 1 if rg else base            # a non-leaf base: views of it may be written
    other = torch.arange(10.0, 20.0).requires_grad_(rg)
    written = b[w_off:w_off + 3]
    read = (other * 1 if rg else other)[:3] if r_off is None else b[r_off:r_off + 3]
    return b, written, read


def _program():
    def f(v, x, w):
        v.mul_(w)
        return (x * w).sin(), v.sum(), x.clone()
    return f


@pytest.mark.parametrize("rg", [False, True], ids=["no_grad_inputs", "grad_inputs"])
@pytest.mark.parametrize("entry", ["capture", "jit", pytest.param("jit_inductor", marks=pytest.mark.slow),
                                   "dynamo"])
def test_disjoint_views_equal_eager_or_are_refused(entry, rg):
    if entry == "capture" and rg:
        pytest.skip("capture is called under the grad mode of its capture: the no_grad_inputs column covers it")
    f = _program()
    compiled = _compile(entry, f, _inputs(*PLACES["as_captured"], False))
    refused = []
    for place in PLACES:
        got, want = _run(compiled, _inputs(*PLACES[place], rg), rg), _run(f, _inputs(*PLACES[place], rg), rg)
        if isinstance(got, errors.AotgradError):
            refused.append(place)
            continue
        (outs, base, grads), (outs_e, base_e, grads_e) = got, want
        for o, e in zip((*outs, base, *grads), (*outs_e, base_e, *grads_e)):
            torch.testing.assert_close(o, e, msg=lambda m: f"{place}: {m}")
    if entry.startswith("jit"):
        assert not refused, f"jit refused instead of recompiling: {refused}"
    elif entry == "capture":     # any shared byte is a mismatch (other places: the inputs' layout guards)
        assert {"overlapping", "same_bytes", "read_inside"} <= set(refused) and "as_captured" not in refused, refused
    torch._dynamo.reset()


def test_disjoint_views_are_inputs_of_their_own():
    """No synthetic base where the inputs sharing a storage share no byte; one where they do."""
    f = _program()
    b, v, x = _inputs(*PLACES["as_captured"], False)
    assert aotgrad.capture(f, v, x, torch.tensor(2.0)).setup.rebase is None
    b, v, x = _inputs(*PLACES["overlapping"], False)
    assert aotgrad.capture(f, v, x, torch.tensor(2.0)).setup.rebase is not None
    b, v, x = _inputs(*PLACES["as_captured"], True)     # a backward: views share a version counter
    assert aotgrad.capture(f, v, x, torch.tensor(2.0, requires_grad=True)).setup.rebase is not None


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_written_input_moved_into_a_synthetic_bases_storage(entry):
    """Captured: ``a`` and ``b`` overlap in one base (a synthetic base, written back whole) and ``c``,
    also written, has a storage of its own. Called with ``c`` in the base's storage, apart from both
    at the offset it was captured at: the graph would write the base back over ``c``'s new values.
    Before the argument match looked at the bases' storages, the staged step lost ``c``'s write."""
    def f(a, b, c):
        a.mul_(2)
        c.add_(1)
        return b.sum() + c.sum()

    def inputs(c_in_base):
        base = torch.arange(12.0)
        return base, base[4:8], base[6:10], base[0:3] if c_in_base else torch.arange(3.0)
    compiled = aotgrad.jit(f) if entry == "jit" else aotgrad.capture(f, *inputs(False)[1:]).compile()
    for c_in_base in (False, True):
        (base, *args), (base_e, *args_e) = inputs(c_in_base), inputs(c_in_base)
        want = f(*args_e)
        try:
            got = compiled(*args)
        except errors.InputMismatchError:
            assert entry == "capture" and c_in_base
            assert torch.equal(base, inputs(c_in_base)[0]), "a refused call changed its inputs"
            continue
        assert torch.equal(got, want) and torch.equal(base, base_e) and torch.equal(args[2], args_e[2])
