"""A non-leaf input the program writes in place, called again on the same tensor (its history grows by
one write per call) and backwarded after each call: every backward goes through the earlier calls'
autograd nodes too, as eager's does through its earlier ``add_`` nodes.

Eager's nodes on the written input's path that saved nothing run again; the compiled call's node does
too when they did and it saved nothing itself (``Analysis.eager_reruns``, found by the joint trace).

A compiled node that saved nothing runs again, like eager's nodes that save nothing (it used to read
``ctx.saved_tensors`` of a released node: "backward through the graph a second time"); where eager's
write saves a tensor (``a.mul_(a)``), both raise that error at the second backward. Each program x
entry point x backend (and the exported step loaded back), compared with eager through
``tests.eager_check.check_usage``."""
import pytest
import torch

import aotgrad
from tests.eager_check import check_usage


def _nonleaf(*shape):
    return torch.randn(*shape, requires_grad=True).add(1)


# name -> the program, written on its first argument (a non-leaf that requires grad)
PROGRAMS = {
    "add_view": lambda a: (a.add_(1), a.view(-1))[1],
    "mul_scalar_input_returned": lambda a: a.mul_(2),
    "add_plain_output": lambda a: a.add_(1) * 3,
    "copy_from_other": lambda a, b: (a.copy_(b * 2), a.t())[1],
    "add_then_view_of_view": lambda a: a.add_(1)[1:].view(-1),
    "mul_saves_itself": lambda a: a.mul_(a.detach() + 1).view(-1),     # eager saves the factor: none of a
    "mul_by_other": lambda a, b: a.mul_(b).view(-1),     # eager saves a and b: its second backward raises
    "add_then_sin": lambda a: a.add_(1).sin(),      # the compiled node saves a for cos: eager's add_ saves nothing
}
_TWO = lambda: (_nonleaf(4, 2), torch.randn(4, 2, requires_grad=True))     # noqa: E731
ARGS = {"copy_from_other": _TWO, "mul_by_other": _TWO}
# The compiled call is one autograd node: where it saves a tensor for an output's backward, a later call's
# backward reaching it through the written input raises, where eager's separate nodes (add_, then sin) do not.
KNOWN = {"add_then_sin": "one node per call: its saved tensors are released with the first backward"}


def _make(name):
    def make():
        args = ARGS.get(name, lambda: (_nonleaf(4, 2),))()
        return PROGRAMS[name], args, {}
    return make


def _export(tmp):
    def compile(fn, args, kwargs):
        path = str(tmp / "step.aotgrad")
        aotgrad.capture(fn, *args, **kwargs).export(path)
        return aotgrad.load(path)
    return compile


def _dynamo(fw_compiler):
    def compile(fn, args, kwargs):
        torch._dynamo.reset()
        return torch.compile(fn, backend=aotgrad.backend(fw_compiler=fw_compiler))
    return compile


ENTRIES = {
    "capture": lambda fn, a, k: aotgrad.capture(fn, *a, **k).compile(),
    "capture_inductor": lambda fn, a, k: aotgrad.capture(fn, *a, **k).compile(fw_compiler="inductor"),
    "capture_dynamic": lambda fn, a, k: aotgrad.capture(fn, *a, dynamic=True, **k).compile(),
    "jit": lambda fn, a, k: aotgrad.jit(fn),
    "dynamo": _dynamo("eager"),
}


def _calls_and_backwards(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        out = call(*args, **kwargs)
        (out * torch.arange(float(out.numel())).view(out.shape)).sum().backward()
        kept.append(out)
    return kept


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN[n], strict=True))
                                  if n in KNOWN else n for n in PROGRAMS])
def test_rewritten_input_backwarded_per_call(name, entry):
    check_usage(_make(name), _calls_and_backwards, compile=ENTRIES[entry])


@pytest.mark.parametrize("name", ["add_view", "mul_by_other"])
def test_rewritten_input_exported(name, tmp_path):
    check_usage(_make(name), _calls_and_backwards, compile=_export(tmp_path))
