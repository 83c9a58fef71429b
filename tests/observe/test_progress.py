"""The progress line: shown on a TTY after the threshold, never otherwise."""
import io
import time

import pytest

from aotgrad.observe import events, timed


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def run_stage(monkeypatch, stream, seconds=0.3):
    p = events.Progress(stream=stream, after=0.05, every=0.02)
    monkeypatch.setattr(events, "progress", p)
    with timed([], "trace joint"):
        time.sleep(seconds)
    time.sleep(p.GAP + 3 * p.every)         # let it clear the line and stop
    return p


def test_long_stage_shows_name_and_elapsed_on_a_tty(monkeypatch):
    monkeypatch.delenv("AOTGRAD_LOG", raising=False)
    out = FakeTTY()
    p = run_stage(monkeypatch, out)
    text = out.getvalue()
    assert "aotgrad: trace joint" in text and "s" in text
    assert text.endswith("\r\x1b[K") and p._thread is None


@pytest.mark.parametrize("stream, env", [(io.StringIO(), None), (FakeTTY(), "quiet")])
def test_silent_off_a_tty_or_when_quiet(monkeypatch, stream, env):
    if env:
        monkeypatch.setenv("AOTGRAD_LOG", env)
    run_stage(monkeypatch, stream, seconds=0.15)
    assert stream.getvalue() == ""


def test_quick_stage_prints_nothing(monkeypatch):
    monkeypatch.delenv("AOTGRAD_LOG", raising=False)
    out = FakeTTY()
    p = events.Progress(stream=out, after=5.0, every=0.02)
    monkeypatch.setattr(events, "progress", p)
    with timed([], "simplify"):
        pass
    time.sleep(p.GAP + 0.1)
    assert out.getvalue() == ""
