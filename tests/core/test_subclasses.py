"""Traceable wrapper subclasses end to end (``aotgrad/inputs/subclasses.py``): TwoTensor as an input,
a parameter, a buffer, made inside, returned, nested in a TwoTensor, viewed and written in place,
requiring grad or not, through every entry point, each compared with eager (outputs, in-place effects
and ``.grad`` as the subclass eager gives); what cannot be traced is a typed refusal naming the
subclass. The guards: a change of class, flatten context or inner layout recompiles under ``jit`` and
is ``InputMismatchError`` for a staged step."""
import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.errors import InputMismatchError, UnsupportedError
from tests.differential.entries import ENTRIES
from tests.eager_check import assert_close, assert_refused, check

ENTRY_NAMES = ["capture", "jit", "dynamo"]


def two(*size, rg=False):
    return TwoTensor(torch.randn(*size), torch.randn(*size)).requires_grad_(rg)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(two(4, 3))

    def forward(self, x):
        return nn.functional.linear(x, self.weight).relu()


class CountingBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", two(3))
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        self.buf.add_(1)
        return (x * self.w).sum() + (self.buf * 2).a.sum()


def made_returned(x, y):
    return (TwoTensor(x, y) * 2).sin()


def made_used(x, y):
    u = TwoTensor(x * 2, y + 1).cos() * 3
    return u.a + u.b


def viewed(x):
    return (x.t() * 2).sum(0)


def viewed_in_place(x, y):
    x[0].mul_(2)
    return x + y


def written(x, y):
    x.mul_(2)
    return x + y


def written_no_grad(x, y):
    with torch.no_grad():
        x.mul_(2)
    return x * y


def transposed_no_grad(x, y):
    with torch.no_grad():
        x.t_()
    return x * y


def plain(*size):
    return torch.randn(*size, requires_grad=True)


def plain_and_two(x, y):
    return (x * y).sin() + y.exp()      # the TwoTensor gradient plus a plain one: eager's sum is a TwoTensor


class TwoLinearBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(two(4, 3))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias).tanh()


def made_meets(x, y):
    return (x * TwoTensor(y, y * 2)).sin()


def squared(x):
    return (x * x).sin()


PROGRAMS = {
    "input, requires grad": lambda: (lambda x, y: (x * y).sin(), (two(3, rg=True), torch.randn(3)), {}),
    "input, no grad": lambda: (lambda x, y: (x * y).sin(), (two(3), torch.randn(3)), {}),
    "input, returned whole": lambda: (lambda x: x * 1, (two(2, 3, rg=True),), {}),
    "parameter": lambda: (Linear(), (torch.randn(2, 3),), {}),
    "buffer written in place": lambda: (CountingBuffer(), (torch.randn(3, requires_grad=True),), {}),
    "made inside, returned": lambda: (made_returned, (torch.randn(3), torch.randn(3)), {}),
    # its wrapper is a leaf requiring grad (its flag from x), x and y get no gradient: the output requires
    # grad only through that leaf (Inner's traced flag), not through the graph's inputs
    "made inside from inputs requiring grad, returned": lambda: (made_returned, (plain(3), plain(3)), {}),
    "made inside, used": lambda: (made_used, (torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)), {}),
    "input viewed": lambda: (viewed, (two(3, 4, rg=True),), {}),
    # eager returns a view of the input TwoTensor: replayed on the caller's input (InputView)
    "returned view of the input": lambda: (lambda x: x.t(), (two(3, 4, rg=True),), {}),
    "returned views of the input beside a value": lambda: (lambda x: (x[1], x.view(-1), x.sin()),
                                                           (two(3, 4, rg=True),), {}),
    "input viewed, written in place": lambda: (viewed_in_place, (two(2, 3), torch.randn(2, 3)), {}),
    "input written in place": lambda: (written, (two(3), torch.randn(3)), {}),
    "parameter-like input written under no_grad": lambda: (written_no_grad, (two(3, rg=True), torch.randn(3)), {}),
    "nested TwoTensor(TwoTensor)": lambda: (squared, (TwoTensor(two(3), two(3)).requires_grad_(),), {}),
    # eager's .grad of a plain input that met a TwoTensor is a TwoTensor: the input is promoted (its
    # gradient's leaves are carried by extra graph inputs)
    "plain input, its grad a subclass": lambda: (lambda x, y: (x * y).sin(), (two(3), plain(3)), {}),
    "plain input, grad a subclass and plain uses": lambda: (plain_and_two, (two(3), plain(3)), {}),
    "plain input, grad of a nested subclass": lambda: (lambda x, y: (x * y).cos(), (TwoTensor(two(3), two(3)),
                                                                                   plain(3)), {}),
    "plain bias beside a subclass weight": lambda: (TwoLinearBias(), (torch.randn(2, 3),), {}),
    "plain input meets a subclass made inside": lambda: (made_meets, (plain(3), torch.randn(3)), {}),
    # what eager's autograd records on a subclass input, or a layout change of one: put back on the
    # caller's input after the graph ran (PutBack: as_strided_, copy_ under grad)
    "written under grad": lambda: (lambda x, y: x.mul_(y) * 1, (two(3, rg=True) * 1, torch.randn(3)), {}),
    "written under grad, returned": lambda: (lambda x: x.mul_(2), (two(3, rg=True) * 1,), {}),
    "row written under grad": lambda: (lambda x: x[0].mul_(2).sum() + x.sum(), (two(2, 3, rg=True) * 1,), {}),
    "nested, written under grad": lambda: (lambda x: x.mul_(2).sin(),
                                           (TwoTensor(two(3), two(3)).requires_grad_() * 1,), {}),
    "transposed in place": lambda: (lambda x: x.t_().sin(), (two(2, 3),), {}),
    "transposed in place under grad": lambda: (lambda x: x.t_() * 2, (two(2, 3, rg=True) * 1,), {}),
    "unsqueezed, then written": lambda: (lambda x, y: x.unsqueeze_(0).mul_(y).cos(), (two(3, rg=True) * 1,
                                                                                     plain(3)), {}),
    "promoted plain input written under grad": lambda: (lambda a, b: a.mul_(2) + b, (plain(3) * 1, two(3, rg=True)),
                                                        {}),
    "promoted plain input transposed": lambda: (lambda a, b: a.t_() + b, (plain(2, 2) * 1, two(2, 2)), {}),
}


@pytest.mark.parametrize("entry", ENTRY_NAMES)
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_two_tensor_program_trains_like_eager(program, entry):
    torch._dynamo.reset()
    check(None, make=PROGRAMS[program], compile=ENTRIES[entry].compile)   # types compared: a TwoTensor comes back


REFUSED = {
    # eager returns a view of a TwoTensor made inside; the rebuilt output is not one
    "returned view made inside": (lambda: (lambda x: (x * 2).t(), (two(3, 4, rg=True),), {}),
                                  "returns a view of a TwoTensor made inside"),
    # the trace's TwoTensor is no leaf: its gradient would be laid out as before the change
    "transposed in place under no_grad, requiring grad": (lambda: (transposed_no_grad, (two(2, 3, rg=True),
                                                                                        torch.randn(3, 2)), {}),
                                                          "size or stride of input 0, a TwoTensor"),
}


@pytest.mark.parametrize("entry", ENTRY_NAMES)
@pytest.mark.parametrize("case", list(REFUSED))
def test_untraceable_subclass_use_is_refused_naming_the_subclass(case, entry):
    make, text = REFUSED[case]
    torch._dynamo.reset()
    if case.startswith("transposed") and entry == "dynamo":     # Dynamo runs the no_grad block itself
        check(None, make=make, compile=ENTRIES[entry].compile)
        return
    e = assert_refused(None, make=make, compile=ENTRIES[entry].compile)
    assert isinstance(e, UnsupportedError) and "TwoTensor" in str(e), e
    if entry != "dynamo":   # Dynamo names its own inputs
        assert text in str(e), e


def test_program_shows_the_inner_tensors():
    captured = aotgrad.capture(lambda x, y: (x * y).sin(), two(3, rg=True), torch.randn(3))
    program = captured.compile().program()
    assert "unwrap(flat)" in program        # the prologue flattens the subclass
    assert "def forward(input_0_a, input_0_b, input_1)" in program
    assert "TwoTensor" not in captured.joint.code       # plain ATen ops on the inner tensors


def test_parameter_grad_is_the_subclass_eager_gives_and_accumulates():
    torch.manual_seed(0)
    m = Linear()
    x = torch.randn(2, 3)
    compiled = aotgrad.capture(m, x).compile()
    compiled(x).sum().backward()
    compiled(x).sum().backward()
    got = m.weight.grad
    m.weight.grad = None
    m(x).sum().backward()
    m(x).sum().backward()
    assert type(got) is TwoTensor
    assert_close(m.weight.grad, got, "grad", 0, 0)


def test_staged_step_refuses_another_class_or_layout():
    compiled = aotgrad.capture(lambda x: (x * 2).sin(), two(3, rg=True)).compile()
    with pytest.raises(InputMismatchError, match="was a TwoTensor when captured, now a Tensor"):
        compiled(torch.randn(3, requires_grad=True))
    with pytest.raises(InputMismatchError, match="input 0.a was a plain tensor when captured, now a TwoTensor"):
        compiled(TwoTensor(two(3), two(3)).requires_grad_())
    with pytest.raises(InputMismatchError):     # an inner tensor of another size (the inner guards)
        compiled(two(4, rg=True))
    plain = aotgrad.capture(lambda x: (x * 2).sin(), torch.randn(3, requires_grad=True)).compile()
    with pytest.raises(InputMismatchError, match="was a plain tensor when captured, now a TwoTensor"):
        plain(two(3, rg=True))


def test_jit_recompiles_for_another_class_context_or_inner_layout():
    f = aotgrad.jit(lambda x: (x * 2).sin(), dynamic=False)
    for x in (two(3, rg=True), torch.randn(3, requires_grad=True), TwoTensor(two(3), two(3)).requires_grad_(),
              two(3, rg=True), two(5, rg=True)):
        assert_close(x.detach().mul(2).sin(), f(x).detach(), "output", 1e-6, 1e-6)
    reasons = [why for _, why in f.entries_and_reasons()] if hasattr(f, "entries_and_reasons") else \
        [e.reason for e in f.entries]
    assert len(reasons) == 4, reasons       # the second TwoTensor of size 3 reuses the first entry
    assert "was a TwoTensor when captured, now a Tensor" in str(reasons[1])
    assert "plain tensor when captured, now a TwoTensor" in str(reasons[2])


def test_grad_of_subclass_input_names_the_subclass_when_it_is_plain():
    class Plainify(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.a.clone()

        @staticmethod
        def backward(ctx, g):
            return g        # a plain gradient for a TwoTensor input

    e = assert_refused(lambda x: Plainify.apply(x * 1).sum(), (two(3, rg=True),))
    assert "TwoTensor" in str(e)


# --- a plain input whose gradient is a subclass (promoted: its gradient's leaves ride on carrier inputs)

def test_promoted_bias_grad_accumulates_like_eager_over_calls():
    torch.manual_seed(0)
    m = TwoLinearBias()
    xs = [torch.randn(2, 3) for _ in range(3)]
    compiled = aotgrad.capture(m, xs[0]).compile()
    for x in xs:
        compiled(x).sum().backward()
    got = m.bias.grad, m.weight.grad
    m.bias.grad = m.weight.grad = None
    for x in xs:
        m(x).sum().backward()
    assert type(got[0]) is TwoTensor and type(m.bias.grad) is TwoTensor
    assert_close(m.bias.grad, got[0], "bias grad", 0, 0)
    assert_close(m.weight.grad, got[1], "weight grad", 0, 0)


def test_promoted_input_shows_its_carriers_and_refuses_a_subclass_there():
    captured = aotgrad.capture(lambda x, y: (x * y).sin(), two(3), torch.randn(3, requires_grad=True))
    assert [str(d) for d in captured.input_descs][:5] == ["input 0.a", "input 0.b", "input 1", "input 1.grad.a",
                                                          "input 1.grad.b"]
    compiled = captured.compile()
    with pytest.raises(InputMismatchError, match="input 1 was a plain tensor when captured, now a TwoTensor"):
        compiled(two(3), two(3, rg=True))


class _ToPlain(torch.autograd.Function):
    """A TwoTensor to a plain tensor, whose backward gives the TwoTensor its gradient back."""

    @staticmethod
    def forward(ctx, t):
        return t.a + t.b

    @staticmethod
    def backward(ctx, g):
        return TwoTensor(g, g * 2)


@pytest.mark.parametrize("case", ["subclass input", "promoted plain input"])
def test_export_refuses_a_program_with_subclass_inputs(case, tmp_path):
    """The artifact would hold the graph's inner-tensor inputs and no way to unwrap (it failed at load)."""
    if case == "subclass input":
        captured = aotgrad.capture(lambda x: (x * 2).a.sin(), two(3))
    else:
        captured = aotgrad.capture(lambda x, y: _ToPlain.apply(x * TwoTensor(y, y * 2)).sin(),
                                   torch.randn(3, requires_grad=True), torch.randn(3))
    with pytest.raises(UnsupportedError, match="tensor subclass inputs"):
        captured.export(str(tmp_path / "step.zip"))


@pytest.mark.parametrize("program", ["plain program", "promoted input"])
def test_subclass_gradient_into_a_plain_output_is_refused_as_backward_runs(program):
    """The loss mixes a plain output with a TwoTensor: eager's backward dispatches the TwoTensor
    through it; the compiled one was traced for a plain gradient (Inductor's kernels read its missing
    storage: a crash; the promoted input's carriers got nested TwoTensors)."""
    if program == "plain program":
        x, args = torch.randn(3, requires_grad=True), ()
        compiled = aotgrad.capture(lambda x: x.sin() * 2, x).compile()
    else:
        x, args = torch.randn(3, requires_grad=True), (two(3),)
        compiled = aotgrad.capture(lambda x, y: (x.cos(), x * y), x, *args).compile()
    out = compiled(x, *args)
    plain = out if program == "plain program" else out[0]
    with pytest.raises(UnsupportedError, match="gradient reaching a plain output of the compiled function is a Two"):
        (plain * two(3)).sum().backward()
    assert x.grad is None
