"""aotgrad.explain: stages, sizes, saved activations with their source line, guards, recompiles."""
import pytest
import torch

import aotgrad


def test_explain_compiled(compiled):
    text = aotgrad.explain(compiled)
    for stage in ("setup", "trace joint", "partition", "compile forward", "compile backward", "total"):
        assert stage in text
    assert "joint" in text and "forward" in text and "backward" in text
    assert "saved for backward: 4 values" in text
    relu = next(line for line in text.splitlines() if line.strip().startswith("relu"))
    assert "[3, 8]" in relu and "float32" in relu and "96 B" in relu
    assert "conftest.py" in relu and "torch.relu(self.fc1(x))" in relu
    assert "param 'fc1.weight': float32[8, 4] on cpu, requires_grad" in text


def test_explain_jit_lists_entries_and_recompile_reasons(recompiled_jit):
    text = aotgrad.explain(recompiled_jit)
    assert "2 compiled entries" in text
    assert "=== entry 1 (recompiled because input 0: size(0) was 3 when captured, now 5) ===" in text
    assert text.count("compile backward") == 2


def test_explain_captured_and_uncalled_jit(mlp):
    assert "trace joint" in aotgrad.explain(aotgrad.capture(mlp, torch.randn(2, 4)))
    assert "not called yet" in aotgrad.explain(aotgrad.jit(mlp))


def test_explain_plain_function_says_what_to_do():
    with pytest.raises(TypeError, match="aotgrad.jit"):
        aotgrad.explain(lambda x: x)
