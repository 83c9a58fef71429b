"""Stage objects print in one line, argument-structure mismatches are said by key path, and
generated code shows its source in tracebacks."""
import inspect
import traceback

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad import errors


def _one_line(obj) -> str:
    text = repr(obj)
    assert "\n" not in text and len(text) < 160, text
    return text


def test_repr_of_stages_and_jit_is_one_line():
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2)), torch.randn(8, 4)
    captured = aotgrad.capture(m, x)
    assert _one_line(captured).startswith("<Captured Sequential: joint graph of")
    assert _one_line(captured.setup).startswith("<Setup Sequential")
    assert _one_line(captured.compile()).startswith("<Compiled Sequential: forward")
    step = aotgrad.jit(m)
    assert _one_line(step) == "<aotgrad.jit m: 0 compiled entries>"
    step(x)
    assert _one_line(step) == "<aotgrad.jit m: 1 compiled entry>"
    assert "first call" in _one_line(step.entries[0])


def _mismatch(compiled, *args, **kwargs) -> str:
    with pytest.raises(errors.InputMismatchError) as e:
        compiled(*args, **kwargs)
    assert "TreeSpec" not in str(e.value)
    return str(e.value).split(";")[0]


def test_structure_mismatch_is_said_by_key_path():
    def f(x, d, *, scale=None):
        return (x * d["w"]).sum() if scale is None else (x * d["w"] * scale).sum()
    x, w = torch.randn(3, requires_grad=True), torch.randn(3)
    compiled = aotgrad.capture(f, x, {"w": w}).compile()
    assert _mismatch(compiled, x, {"w": w}, scale=w) == "kwargs['scale'] was absent when captured, now given"
    assert _mismatch(compiled, x, {"v": w}) == "args[1]['w'] was given when captured, now absent"
    assert _mismatch(compiled, x, {"w": [w]}) == "args[1]['w'] was a tensor or value when captured, now a list of 1"
    assert _mismatch(compiled, x) == "2 positional arguments when captured, now 1"


def test_jit_recompile_reason_names_the_key_path():
    step = aotgrad.jit(lambda x, **kw: sum(v.sum() for v in kw.values()) * x)
    x = torch.randn(2)
    step(x, a=x)
    step(x, a=x, b=x)
    assert step.entries[1].reason == "kwargs['b'] was absent when captured, now given"


def test_generated_code_shows_in_tracebacks():
    def f(x, i):
        return torch.index_select(x, 0, i).sum()
    x = torch.randn(4, requires_grad=True)
    compiled = aotgrad.capture(f, x, torch.tensor([1])).compile()
    with pytest.raises((IndexError, RuntimeError)) as e:
        compiled(x, torch.tensor([9]))
    text = "".join(traceback.format_exception(e.value))
    assert "File \"<aotgrad forward" in text and "index_select" in text.split("File \"<aotgrad forward")[1]
    check = compiled.captured.guards.check
    assert "def check" in inspect.getsource(check)
