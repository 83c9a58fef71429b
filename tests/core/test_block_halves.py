"""A repeated block's joint partitioned once (aotgrad/partition/blocks.py): each call of a template is
two calls of its halves in the joint, the forward and the backward graph; what needs operators gets
the halves' nodes copied in. Every check compares with eager and with copies of the template's nodes
(``block_graph.KEEP = False``), bit for bit."""
import json
import zipfile
from dataclasses import replace

import pytest
import torch

import aotgrad
from aotgrad.capture import block_graph
from aotgrad.partition.blocks import BlockPart, has_calls, inline_calls, is_call
from aotgrad.store import codec
from examples import models
from tests.eager_check import check_training


def _gpt(n_layer=3):
    torch.manual_seed(0)
    return models.make_gpt(replace(models.GPT_SDPA, n_layer=n_layer))


def _trained(keep: bool, monkeypatch, **compile_opts):
    monkeypatch.setattr(block_graph, "KEEP", keep)
    model, args = _gpt()
    captured = aotgrad.capture(model, *args)
    compiled = captured.compile(**compile_opts)
    loss = compiled(*args)
    loss.backward()
    return captured, compiled, loss.detach(), [p.grad for p in model.parameters()]


def _calls(gm, kind) -> list:
    return [n for n in gm.graph.nodes if is_call(n) and n.target.kind == kind]


def test_each_layer_is_a_call_of_one_forward_and_one_backward_half(monkeypatch):
    captured, compiled, loss, grads = _trained(True, monkeypatch)
    _, _, loss_copies, grads_copies = _trained(False, monkeypatch)
    assert torch.equal(loss, loss_copies) and all(torch.equal(a, b) for a, b in zip(grads, grads_copies))
    fw, bw = _calls(compiled.forward_graph, "forward"), _calls(compiled.backward_graph, "backward")
    assert len(fw) == len(bw) == 3
    assert len({n.target for n in fw}) == len({n.target for n in bw}) == 1      # one function per half
    info = next(s.info for s in captured.history if s.name == "trace joint")
    assert info["blocks called as halves"] == 3
    assert len(captured.joint.graph.nodes) * 2 < len(captured.flat_joint.graph.nodes)


def test_halves_train_like_eager():
    check_training(lambda: _gpt(2), steps=2)


def test_a_saved_input_or_view_of_one_is_the_callers_tensor(monkeypatch):
    """The forward half returns no input and no view of one (``t(w)`` of a Linear): the backward
    half takes the input from the caller, so the program's partition saves the caller's tensor."""
    captured, *_ = _trained(True, monkeypatch)
    part = _calls(captured.joint, "forward")[0].target
    outs = part.gm.graph.output_node().args[0]
    primals = set(part.gm.graph.find_nodes(op="placeholder"))
    for o in outs:
        while o.op == "call_function" and o.target is not None and getattr(o.target, "_schema", None) \
                and o.target._schema.returns and o.target._schema.returns[0].alias_info is not None:
            o = o.args[0]
        assert o not in primals, o
    halves = block_graph._HALVES[part.key]
    assert ("input", 3) in halves.saved        # the qkv weight, read by the backward half itself


def test_a_weight_changed_in_place_before_backward_raises_as_eager_does(monkeypatch):
    monkeypatch.setattr(block_graph, "KEEP", True)
    errors = []
    for compiled in (False, True):
        model, args = _gpt(2)
        step = aotgrad.capture(model, *args).compile() if compiled else model
        loss = step(*args)
        with torch.no_grad():
            model.blocks[0].attn.qkv.weight.add_(1.0)
        with pytest.raises(RuntimeError) as e:
            loss.backward()
        errors.append("modified by an inplace operation" in str(e.value))
    assert errors == [True, True]


def test_another_compiler_gets_the_halves_nodes(monkeypatch):
    """A compiler other than the eager backend never sees a call of a half; the numbers are the same."""
    seen = []

    def compiler(gm, example_inputs):
        seen.append(has_calls(gm))
        return gm
    _, _, loss, grads = _trained(True, monkeypatch, fw_compiler=compiler)
    _, _, loss_eager, grads_eager = _trained(True, monkeypatch)
    assert seen == [False, False]
    assert torch.equal(loss, loss_eager) and all(torch.equal(a, b) for a, b in zip(grads, grads_eager))


def test_the_disk_cache_codec_keeps_the_calls_and_the_halves(monkeypatch):
    _, compiled, *_ = _trained(True, monkeypatch)
    gm, tensors = compiled.forward_graph, {}
    data = json.loads(json.dumps(codec.encode_graph(gm, tensors, "forward/", symbolic=True)))
    assert sorted(data["blocks"]) == ["block%d_forward" % _calls(gm, "forward")[0].target.key]
    back = codec.decode_graph(data, tensors, "forward/", symbolic=True)
    calls = _calls(back, "forward")
    assert len(calls) == 3 and len({n.target for n in calls}) == 1 and type(calls[0].target) is BlockPart
    ins = [torch.randn(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) and
           n.meta["val"].dtype.is_floating_point else torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
           for n in gm.graph.find_nodes(op="placeholder")]
    want, got = gm(*ins), back(*ins)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(want, inline_calls(gm)(*ins)))


def test_a_call_of_an_unknown_half_does_not_load(monkeypatch):
    _, compiled, *_ = _trained(True, monkeypatch)
    data = json.loads(json.dumps(codec.encode_graph(compiled.forward_graph, {}, "forward/", symbolic=True)))
    name = next(iter(data["blocks"]))
    data["blocks"]["block7_forward"] = data["blocks"].pop(name)
    with pytest.raises(aotgrad.errors.ExportFormatError, match="does not hold"):
        codec.decode_graph(data, {}, "forward/", symbolic=True)


def test_the_export_artifact_holds_the_halves_nodes(monkeypatch, tmp_path):
    monkeypatch.setattr(block_graph, "KEEP", True)
    model, args = _gpt(2)
    path = aotgrad.capture(model, *args).export(str(tmp_path / "step.aotgrad"))
    with zipfile.ZipFile(path) as z:
        graphs = [json.loads(z.read(n)) for n in z.namelist() if n.startswith("graphs/")]
    assert graphs and not any("blocks" in g for g in graphs)
    loaded = aotgrad.load(path)
    loss = loaded(*args)
    loss.backward()
    expect = model(*args)
    expect.backward()
    assert torch.equal(loss.detach(), expect.detach())
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(loaded.parameters(), model.parameters()))
