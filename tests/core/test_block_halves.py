"""A repeated block's joint partitioned once (aotgrad/partition/blocks.py): each call of a template is
two calls of its halves in the joint, the forward and the backward graph; what needs operators gets
the halves' nodes copied in. Every check compares with eager and with copies of the template's nodes
(``block_graph.KEEP = False``), bit for bit."""
import json
import zipfile
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.capture import block_graph
from aotgrad.ir.ops import is_random
from aotgrad.partition.blocks import BlockPart, has_calls, inline_calls, is_call
from aotgrad.store import codec
from examples import models
from tests.differential.p_blocks import Checked, Dropped, Stack, _nothing
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


# --- blocks that draw random numbers: the forward half draws them, in eager's stream -------------

def _dropout_gpt(n_layer=3, sdpa=True):
    return models.make_gpt(replace(models.GPT_SDPA if sdpa else models.GPT_TINY, n_layer=n_layer, dropout=0.1))


def _run_seeded(make, keep: bool, monkeypatch, around=None, **compile_opts):
    """Loss, gradients and the RNG state after one seeded step, eager (``keep`` None) or compiled;
    the capture's history when compiled."""
    model, args = make()
    history = None
    if keep is not None:
        monkeypatch.setattr(block_graph, "KEEP", keep)
        captured = aotgrad.capture(model, *args)
        history, step = captured.history, captured.compile(**compile_opts)
    else:
        step = model
    torch.manual_seed(7)
    loss = step(*args)
    loss.backward()
    return (loss.detach(), [p.grad for p in model.parameters()], torch.get_rng_state()), history


def _same(a, b) -> bool:
    (la, ga, ra), (lb, gb, rb) = a, b
    return torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb)) and torch.equal(ra, rb)


def _halves(history) -> int:
    return next(s.info for s in history if s.name == "trace joint").get("blocks called as halves", 0)


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa_dropout", "nn_dropout"])
def test_blocks_with_dropout_are_halves_drawing_eagers_numbers(sdpa, monkeypatch):
    """Dropout (``nn.Dropout`` and SDPA's ``dropout_p``) in every layer: each call of the forward half
    draws at the stream position the layer's copy would, so the step is eager's bit for bit, the
    global RNG ends where eager leaves it, and the copies agree."""
    make = lambda: _dropout_gpt(3, sdpa)        # noqa: E731
    eager, _ = _run_seeded(make, None, monkeypatch)
    kept, history = _run_seeded(make, True, monkeypatch)
    copied, history_copies = _run_seeded(make, False, monkeypatch)
    assert _halves(history) == 3 and _halves(history_copies) == 0
    assert _same(eager, kept) and _same(eager, copied)


def test_blocks_with_dropout_train_like_eager():
    check_training(lambda: _dropout_gpt(2), steps=3)


def test_the_flat_joint_tags_each_draw_with_its_layers_position(monkeypatch):
    """What gets the halves' nodes copied in (min cut, budgets, Inductor) sees the positions the
    copies had: every draw its own, in layer order."""
    monkeypatch.setattr(block_graph, "KEEP", True)
    model, args = _dropout_gpt(3)
    kept = aotgrad.capture(model, *args).flat_joint
    monkeypatch.setattr(block_graph, "KEEP", False)
    copied = aotgrad.capture(model, *args).joint
    tags = [[n.meta.get("aotgrad_rng") for n in gm.graph.nodes if is_random(n)] for gm in (kept, copied)]
    assert tags[0] == tags[1] and len(tags[0]) == len(set(tags[0])) > 3 and None not in tags[0]


@pytest.mark.parametrize("partitioner", ["min_cut", "default"])
def test_dropout_halves_under_each_partitioner_and_a_memory_budget(partitioner, monkeypatch):
    make = lambda: _dropout_gpt(3)      # noqa: E731
    eager, _ = _run_seeded(make, None, monkeypatch)
    got, _ = _run_seeded(make, True, monkeypatch, partitioner=partitioner)
    assert _same(eager, got)
    got, _ = _run_seeded(make, True, monkeypatch, memory_budget=0.5)
    assert _same(eager, got)


def _loss(stack_class):
    """``stack_class`` (a ``p_blocks`` stack) whose forward returns a scalar loss."""
    class Loss(stack_class):
        def forward(self, x):
            return super().forward(x).square().mean()
    return Loss


@pytest.mark.parametrize("stack, around", [
    (Checked, None), (Stack, lambda i: torch.random.fork_rng() if i == 1 else _nothing())], ids=["checkpoint", "fork_rng"])
def test_a_replayed_or_rewound_draw_makes_the_blocks_copies(stack, around, monkeypatch):
    """Block 1 under a checkpoint (its recomputation draws at positions it drew before) or under
    ``fork_rng`` (the stream is rewound): ``passes.rng`` rewrites those draws in the flat graph, so
    no call of a half draws."""
    def make():
        torch.manual_seed(0)
        return (_loss(stack)([Dropped() for _ in range(3)], nn.Linear(4, 3), around=around),
                (torch.randn(4, 4, requires_grad=True),))
    eager, _ = _run_seeded(make, None, monkeypatch)
    got, history = _run_seeded(make, True, monkeypatch)
    assert _halves(history) == 0
    assert _same(eager, got)


class _SeedsFirst(Stack):
    def forward(self, x):
        torch.manual_seed(3)
        return super().forward(x)


def test_manual_seed_inside_with_draws_only_in_blocks_is_refused(monkeypatch):
    """The seed check sees the draws inside the calls of halves."""
    monkeypatch.setattr(block_graph, "KEEP", True)
    torch.manual_seed(0)
    model, x = _SeedsFirst([Dropped() for _ in range(3)], nn.Linear(4, 3)), torch.randn(4, 4)
    rng = torch.get_rng_state()
    with pytest.raises(aotgrad.errors.UnsupportedError, match=r"torch.manual_seed\(3\) inside"):
        aotgrad.capture(model, x)
    assert torch.equal(rng, torch.get_rng_state())


def test_a_gradient_penalty_through_dropout_halves_replays_eagers_draws(monkeypatch):
    """``create_graph=True`` runs the function again for the second-order graph: it must know the
    program draws (inside the calls) to replay the forward's RNG state."""
    monkeypatch.setattr(block_graph, "KEEP", True)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model, x = _loss(Stack)([Dropped() for _ in range(3)], nn.Linear(4, 3)), torch.randn(4, 4)
        step = aotgrad.capture(model, x).compile() if compiled else model
        if compiled:
            assert _halves(step.captured.history) == 3
        torch.manual_seed(5)
        loss = step(x)
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
        results.append([p.grad for p in model.parameters()] + [torch.get_rng_state()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_saved_estimate_counts_a_halfs_view_and_base_once(monkeypatch):
    """A forward half may save a view and its base: one storage, as in the copies' partition."""
    from aotgrad.partition.memory import estimate
    saved = [estimate(_trained(keep, monkeypatch)[1].partition).saved_bytes for keep in (True, False)]
    assert saved[0] == saved[1] > 0
