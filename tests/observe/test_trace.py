"""Chrome trace events: every timed stage, recompile reasons, the env var."""
import json

import pytest
import torch

import aotgrad
from aotgrad.observe import timed, trace
from aotgrad.observe import events as trace_module

STAGES = {"setup", "analyze", "trace joint", "simplify", "input guards", "partition",
          "compile forward", "compile backward"}


def load_events(path):
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))
    return events


def test_compile_writes_valid_trace_with_every_stage(tmp_path, mlp):
    path = tmp_path / "out" / "trace.json"
    with trace(path):
        aotgrad.capture(mlp, torch.randn(3, 4)).compile()
    events = load_events(path)
    complete = {e["name"]: e for e in events if e["ph"] == "X"}
    assert STAGES <= set(complete)
    assert complete["partition"]["args"]["saved"] == 4
    assert complete["trace joint"]["args"]["nodes"] > 0


def test_recompile_event_names_its_reason(tmp_path, mlp):
    path = tmp_path / "trace.json"
    j = aotgrad.jit(mlp, dynamic=False)
    with trace(path):
        j(torch.randn(3, 4))
        j(torch.randn(3, 4))            # guard hit: no new stages
        j(torch.randn(5, 4))
    events = load_events(path)
    assert [e["name"] for e in events].count("setup") == 2
    recompiles = [e for e in events if e["ph"] == "i" and "recompiling" in e["name"]]
    assert len(recompiles) == 1
    assert "size(0) was 3 when captured, now 5" in recompiles[0]["args"]["message"]


def test_nothing_is_recorded_without_a_sink_and_sinks_nest():
    with trace() as outer:
        with trace() as inner:
            with timed([], "inner step", n=1):
                pass
        with timed([], "outer step", obj=object()):
            pass
    with timed([], "untraced"):
        pass
    assert [e["name"] for e in inner.events] == ["inner step"]
    assert [e["name"] for e in outer.events] == ["inner step", "outer step"]
    json.dumps(outer.document())        # non-JSON args were turned into text


def test_failed_stage_is_traced_with_its_error():
    with trace() as sink:
        try:
            with timed([], "boom"):
                raise ValueError("x")
        except ValueError:
            pass
    assert sink.events[0]["args"]["error"] == "ValueError"


def test_environment_variable_starts_a_process_sink(tmp_path):
    path = tmp_path / "env.json"
    sink = trace_module.from_environment({"AOTGRAD_TRACE": str(path)})
    try:
        with timed([], "from env"):
            pass
    finally:
        trace_module._detach(sink)
    sink.write()
    assert [e["name"] for e in load_events(path) if e["ph"] == "X"] == ["from env"]
    assert trace_module.from_environment({}) is None


def test_disk_cache_hit_is_traced(tmp_path, mlp, monkeypatch):
    pytest.importorskip("aotgrad.guards.cache")
    monkeypatch.setenv("AOTGRAD_CACHE", "1")
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(3, 4)
    aotgrad.jit(mlp, dynamic=False)(x)                  # compiles and stores
    with trace() as sink:
        j = aotgrad.jit(mlp, dynamic=False)
        j(x)
    if not any(e.loaded for e in j.entries):
        pytest.skip("this call was not served from the disk cache")
    names = [e["name"] for e in sink.events]
    assert "trace joint" not in names
    assert any("cache" in e["args"].get("message", "") for e in sink.events if e["ph"] == "i")


def test_jit_recompile_is_one_event_with_its_reason(tmp_path, mlp):
    j = aotgrad.jit(mlp, dynamic=False)
    with aotgrad.trace(tmp_path / "t.json"):
        j(torch.randn(3, 4)); j(torch.randn(5, 4))
    events = [e for e in load_events(tmp_path / "t.json") if e["ph"] == "X"]
    first, again = [e for e in events if e["name"] in ("jit compile", "jit recompile")]
    assert first["args"]["reason"] is None and again["args"]["entry"] == 1
    assert "size(0) was 3 when captured, now 5" in again["args"]["reason"]
