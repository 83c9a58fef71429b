"""The new comparisons must be able to fail: an entry's float tolerance leaves integers, bools
(masks), RNG and metadata exact; the export entry's step-by-step comparison catches a loaded step
that computes, draws, updates or refuses differently; the device floors and the CUDA cases skip
cleanly without CUDA."""
import pytest
import torch

from tests.differential import exported
from tests.differential.entries import ENTRIES, INDUCTOR_TOL
from tests.differential.harness import PROGRAMS, Result, devices, run_case, tolerance
from tests.differential.programs import Program
from tests.eager_check import check

from .test_eager_check import wrong

TOL = dict(zip(("rtol", "atol"), INDUCTOR_TOL))


def test_float_noise_within_the_entry_tolerance_passes():
    check(lambda x: x * 2, (torch.randn(4, 3),), compile=wrong(lambda out, a: out * (1 + 1e-6)), **TOL)


@pytest.mark.parametrize("fn,transform,message", [
    (lambda x: x * 2, lambda out, a: out * (1 + 1e-2), "output 0"),
    (lambda x: (x > 0).long().cumsum(0), lambda out, a: out + (out == out.max()).long(), "output 0"),
    (lambda x: x > 0, lambda out, a: out ^ (torch.arange(out.numel()) == 0).view(out.shape), "output 0"),
    (lambda x: x * 2, lambda out, a: out.double(), "dtype"),
    (lambda x: x.t(), lambda out, a: out.contiguous(), "strides"),
    (lambda x: x * 2, lambda out, a: (torch.rand(()), out)[1], "RNG"),
], ids=["float beyond", "integer off by one", "bool mask bit", "dtype", "strides", "rng"])
def test_the_entry_tolerance_keeps_the_rest_exact(fn, transform, message):
    with pytest.raises(AssertionError, match=message):
        check(fn, (torch.randn(4, 3),), compile=wrong(transform), **TOL)


def test_an_integer_off_by_one_is_caught_at_any_tolerance():
    big = torch.full((3,), 10 ** 6, dtype=torch.int64)
    with pytest.raises(AssertionError, match="output 0"):
        check(lambda x: x + 1, (big,), compile=wrong(lambda out, a: out + 1), rtol=1e-4, atol=1e-4)


def test_tolerance_is_the_largest_of_program_entry_and_device():
    prog = PROGRAMS["float64"]
    assert tolerance(prog, ENTRIES["capture"], "cpu") == prog.tol
    assert tolerance(prog, ENTRIES["inductor"], "cpu") == tuple(max(a, b) for a, b in zip(prog.tol, INDUCTOR_TOL))


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.nn.functional.dropout(x @ self.w, 0.5)


def _records(call_of):
    torch.manual_seed(0)
    model, x = Affine(), torch.randn(4, 3)
    prog = Program("affine", lambda: (model, (x,), {}))
    return exported.train(call_of(model), (x,), {}, prog)


class _Spoiled:
    """The model with one thing done differently, with its parameters and buffers under their own
    names, as a loaded step (``aotgrad.Exported``) has them."""

    def __init__(self, model, how):
        self.model, self.how = model, how

    def __call__(self, x):
        return self.how(self.model, x)

    def named_parameters(self):
        return self.model.named_parameters()

    def named_buffers(self):
        return self.model.named_buffers()


def _refuses_second_call(m, x):
    if m.calls.item() >= 1:
        from aotgrad.errors import InputMismatchError
        raise InputMismatchError("input 0 changed")
    return m(x)


@pytest.mark.parametrize("how,message", [
    (lambda m, x: m(x) * 1.01, "output"),
    (lambda m, x: (m(x), torch.rand(()))[0], "RNG"),
    (lambda m, x: (m.calls.add_(1), m(x))[1], "after the update: buffer calls"),
    (lambda m, x: m(x.detach().clone()), None),
    (_refuses_second_call, "eager no error; loaded step InputMismatchError"),
], ids=["value", "rng", "buffer update", "same", "refused later"])
def test_the_export_comparison_catches_a_different_step(how, message):
    eager = _records(lambda m: m)
    loaded = _records(lambda m: _Spoiled(m, how))
    if message is None:
        assert "3 steps" in exported.compare(eager, loaded, 1e-5, 1e-5)
    else:
        with pytest.raises(AssertionError, match=message):
            exported.compare(eager, loaded, 1e-5, 1e-5)


def test_export_entry_round_trip_in_a_fresh_process():
    """Through the child: a module with a parameter, a buffer written in place and dropout."""
    result = run_case(PROGRAMS["dropout"], ENTRIES["export"])
    assert result.outcome == "pass" and "3 steps trained like eager" in result.detail, result


def test_cuda_cases_skip_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu runs the CUDA cases")
    assert devices() == ["cpu"] and not torch.cuda.is_initialized()
    assert run_case(PROGRAMS["dropout"], ENTRIES["capture"], device="cuda") == \
        Result("dropout", "capture", "skip", "no cuda on this machine", device="cuda")
    assert not torch.cuda.is_initialized()
