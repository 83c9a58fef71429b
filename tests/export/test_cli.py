"""``python -m aotgrad export script.py:name -o step.aotgrad`` and ``python -m aotgrad inspect step.aotgrad``
(run in process through ``cli.main``)."""
import textwrap

import pytest
import torch

import aotgrad
from aotgrad import cli

SCRIPT = textwrap.dedent("""
    import torch
    import aotgrad

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x).square().mean()

    def example():
        torch.manual_seed(0)
        return Tiny(), (torch.randn(4, 3),)

    def captured():
        model, args = example()
        return aotgrad.capture(model, *args)

    not_a_step = 3
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train_script.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.parametrize("name", ["example", "captured"])
def test_export_then_inspect(script, tmp_path, capsys, name):
    out = str(tmp_path / "step.aotgrad")
    assert cli.main(["export", f"{script}:{name}", "-o", out]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli.main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "param  lin.weight" in text and "param 'lin.weight'" in text and "forward:" in text and "backward:" in text
    step = aotgrad.load(out)
    params = dict(step.named_parameters())
    x = torch.ones(4, 3)
    want = torch.nn.functional.linear(x, params["lin.weight"], params["lin.bias"]).square().mean()
    torch.testing.assert_close(step(x), want)


def test_inspect_without_values(script, tmp_path, capsys):
    out = str(tmp_path / "bare.aotgrad")
    assert cli.main(["export", f"{script}:example", "-o", out, "--no-values"]) == 0
    assert cli.main(["inspect", out]) == 0
    assert "param  lin.weight" in capsys.readouterr().out


def test_export_refuses_what_is_not_a_step(script, tmp_path):
    with pytest.raises(SystemExit, match="export needs a Captured"):
        cli.main(["export", f"{script}:not_a_step", "-o", str(tmp_path / "x.aotgrad")])


def test_inspect_refuses_a_broken_file(tmp_path):
    bad = tmp_path / "bad.aotgrad"
    bad.write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="corrupted or truncated"):
        cli.main(["inspect", str(bad)])
