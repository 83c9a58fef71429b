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

from .test_aliased_placement import _run

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


def _compile(entry, f):
    if entry in ("jit", "jit_inductor"):
        return aotgrad.jit(f, fw_compiler="inductor" if entry == "jit_inductor" else "eager")
    if entry == "dynamo":
        torch._dynamo.reset()
        return torch.compile(f, backend="aotgrad")
    first = _inputs(*PLACES["as_captured"], False)
    return aotgrad.capture(f, first[1], first[2], torch.tensor(2.0)).compile()


@pytest.mark.parametrize("rg", [False, True], ids=["no_grad_inputs", "grad_inputs"])
@pytest.mark.parametrize("entry", ["capture", "jit", pytest.param("jit_inductor", marks=pytest.mark.slow),
                                   "dynamo"])
def test_disjoint_views_equal_eager_or_are_refused(entry, rg):
    if entry == "capture" and rg:
        pytest.skip("capture is called under the grad mode of its capture: the no_grad_inputs column covers it")
    f = _program()
    compiled = _compile(entry, f)
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
