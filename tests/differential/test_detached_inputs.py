"""An input the program reads only without autograd (``.detach()``, ``.data``, under ``no_grad``) has no
edge from the compiled node: eager's backward never runs its history, so neither may the compiled one (a hook
on it, or a backward that raises, shows the difference). One read with autograd too keeps its edge. Compared with
eager through capture, jit and torch.compile: the hook calls, the history's backward runs, the gradients."""
import pytest
import torch

from tests.differential.entries import ENTRIES


class _Counted(torch.autograd.Function):
    """The input's history: counts its backward runs (or raises, where ``RAISE`` holds True)."""
    RUNS = []
    RAISE = [False]

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        if _Counted.RAISE[0]:
            raise RuntimeError("the history of an input read only without autograd ran its backward")
        _Counted.RUNS.append(1)
        return g


def _no_grad_read(x, w):
    with torch.no_grad():
        y = x * 2
    return y * w


READS = {
    "detach": lambda x, w: x.detach() * w,
    "data": lambda x, w: x.data.sin() * w,
    "no_grad": _no_grad_read,
    "detach_and_used": lambda x, w: x.detach() * w + x,     # (read with autograd too: its edge stays)
    "detach_of_view": lambda x, w: x[1:].detach().sum() * w,
}


def _run(fn, compile, raising):
    torch.manual_seed(0)
    base, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    hooked = []
    base.register_hook(lambda g: hooked.append(g is None))
    _Counted.RUNS.clear()
    _Counted.RAISE[0] = raising
    try:
        x = _Counted.apply(base)
        out = (compile(fn, (x, w), {}) if compile else fn)(x, w)
        out.sum().backward()
    finally:
        _Counted.RAISE[0] = False
    return hooked, len(_Counted.RUNS), base.grad, w.grad


@pytest.mark.parametrize("entry", ["capture", "jit", "dynamo"])
@pytest.mark.parametrize("read", list(READS))
def test_an_input_read_without_autograd_has_no_edge(read, entry):
    ENTRIES[entry].reset()
    fn = READS[read]
    raising = read != "detach_and_used"
    eager = _run(fn, None, raising)
    compiled = _run(fn, ENTRIES[entry].compile, raising)
    assert eager[:2] == compiled[:2], (eager, compiled)
    for e, c in zip(eager[2:], compiled[2:]):
        assert (e is None) == (c is None) and (e is None or torch.allclose(e, c)), (e, c)
    ENTRIES[entry].reset()
