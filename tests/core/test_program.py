"""A compiled step is a program you can read: ``step.program()`` shows, in the order a call runs them,
the prologue (modes, the Python state the trace read, the argument checks and input guards), the
forward graph, the epilogue and the backward graph; the prologue shown is the generated code that
runs, not a description of it."""
import pytest
import torch

import aotgrad
from aotgrad.runtime.codegen import source_of
from examples import models
from tests.eager_check import check

SECTIONS = ("# --- prologue: modes", "# --- prologue: Python state", "# --- prologue: arguments",
            "# --- forward", "# --- epilogue", "# --- backward")


def _in_order(text: str, parts) -> bool:
    at = [text.find(p) for p in parts]
    return -1 not in at and at == sorted(at)


@pytest.mark.parametrize("make", [models.make_mlp, models.make_cnn, models.make_gpt_tiny], ids=lambda f: f.__name__)
def test_examples_print_as_programs(make):
    model, args = make()
    step = aotgrad.capture(model, *args).compile()
    text = step.program()
    assert _in_order(text, SECTIONS)
    assert source_of(step.path.match) in text           # the prologue that runs is the one printed
    assert "def forward(" in text and "def backward(" in text
    # Each module's parameter dict read once (its parameters gathered from it; a tied second place
    # checked through its own module's dict).
    n_places = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    assert n_places > sum(1 for _ in model.parameters()) or make is not models.make_gpt_tiny
    owners = {id(m) for _, m in model.named_modules() if m._parameters}
    assert text.count("['_parameters']") == len(owners)
    check(make()[0], make()[1])      # and the step it prints trains as eager does


def test_jit_program_has_one_section_per_entry_with_its_modes():
    model, args = models.make_mlp()
    j = aotgrad.jit(model)
    j(*args)
    with torch.no_grad():
        j(*args)
    text = j.program()
    assert text.count("# ===== entry") == 2
    assert "#   grad mode: True" in text and "#   grad mode: False" in text


def test_constants_and_epilogue_are_shown_and_checked():
    def f(a, b, scale, flag):
        a.mul_(scale)
        return (a.t(), b * scale) if flag else (a, b)
    a, b = torch.randn(2, 3), torch.randn(2, requires_grad=True)
    step = aotgrad.capture(f, a.clone(), b, -0.0, True).compile()
    text = step.program()
    assert "same_value(x, c2)" in text and "_data(flat[0]" in text and "as_view(flat[0]" in text
    with pytest.raises(aotgrad.errors.InputMismatchError, match=r"non-tensor argument args\[2\] was -0.0 .*now 0.0"):
        step(a.clone(), b, 0.0, True)
    check(f, make=lambda: ((torch.randn(2, 3), torch.randn(2, requires_grad=True), 2.0, True), {}))


def test_program_matches_behaviour_of_a_mismatched_call():
    """The generated argument check refuses what the closure refused, with the same sentences."""
    model, args = models.make_mlp()
    step = aotgrad.capture(model, *args).compile()
    with torch.no_grad(), pytest.raises(aotgrad.errors.InputMismatchError, match="grad mode was enabled"):
        step(*args)
    with pytest.raises(aotgrad.errors.InputMismatchError, match="positional arguments|structure|were"):
        step(*args, args[0])
