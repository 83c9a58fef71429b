"""python -m aotgrad explain|report script.py:name."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from aotgrad import cli

SCRIPT = textwrap.dedent("""
    import torch, aotgrad

    def step(w, x):
        return (x @ w).relu().sum()

    w = torch.randn(4, 3, requires_grad=True)
    compiled = aotgrad.capture(step, w, torch.randn(2, 4)).compile()
    fast = aotgrad.jit(step)
    fast(w, torch.randn(2, 4))

    def make():
        return compiled

    number = 3
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("name", ["compiled", "fast", "make"])
def test_explain_each_kind_of_target(script, name, capsys):
    assert cli.main(["explain", f"{script}:{name}"]) == 0
    out = capsys.readouterr().out
    assert "compile backward" in out and "saved for backward" in out


@pytest.mark.parametrize("target, message", [("nope.py:x", "no such script"), ("{s}:missing", "defines no"),
                                             ("{s}:number", "is not a Compiled"), ("{s}", "expected path")])
def test_bad_targets_say_what_is_wrong(script, target, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["explain", target.format(s=script)])


def test_python_m_aotgrad_report_with_trace_env(script, tmp_path):
    out, trace = tmp_path / "report.html", tmp_path / "trace.json"
    env = {**os.environ, "AOTGRAD_TRACE": str(trace), "AOTGRAD_LOG": "quiet"}
    run = subprocess.run([sys.executable, "-m", "aotgrad", "report", f"{script}:fast", "-o", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout and "<svg" in out.read_text()
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]]
    assert names.count("compile backward") == 2           # the script's capture and its jit call
