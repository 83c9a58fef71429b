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


def test_explain_is_the_objects_own_method(compiled, mlp, tmp_path):
    """aotgrad.explain(obj) is obj.explain(): a loaded artifact and a compiled_autograd block explain
    themselves too, and an object whose fields merely look like a stage's is not explained."""
    assert aotgrad.explain(compiled) == compiled.explain()
    x = torch.randn(2, 4)
    captured = aotgrad.capture(mlp, x)
    path = tmp_path / "mlp.aotgrad"
    captured.export(str(path))
    loaded = aotgrad.load(str(path))
    assert "saved for backward" in aotgrad.explain(loaded)
    with aotgrad.compiled_autograd("eager") as ca:
        mlp(x).sum().backward()
    assert "compiled_autograd: 1 capture(s)" in aotgrad.explain(ca)

    class LooksLikeAStage:          # what the old field sniffing took for a Compiled
        forward_graph = captured = None

    with pytest.raises(TypeError, match="aotgrad.jit"):
        aotgrad.explain(LooksLikeAStage())
