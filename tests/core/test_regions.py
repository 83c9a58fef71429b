"""Repeated regions (aotgrad.runtime.regions): a repeated block's copies compiled once and called
per copy. A run is grouped with another only when it computes the same function of its inputs:
each test here makes two runs that differ in one thing and checks they are not, then that the
code with regions computes what the inline code computes."""
import re
from collections import Counter

import pytest
import torch
import torch.fx as fx

import aotgrad
from aotgrad.capture import block_graph
from aotgrad.partition.blocks import BlockPart
from aotgrad.runtime import codegen, regions
from tests.core.test_block_reuse import make_stack
from tests.eager_check import check_training

aten = torch.ops.aten


def _graph(copies):
    """A graph of consecutive tagged runs: ``copies`` is one dict per run (what to change in it).
    Each run is ``h = add(mul(h, w), c); h = tanh(h); h = mul(h, 2.0); h = add(h, x)``."""
    g = fx.Graph()
    x = g.placeholder("x")
    ws = [g.placeholder(f"w{i}") for i in range(len(copies))]
    h = g.placeholder("h")
    for i, c in enumerate(copies):
        tag = (7, "fw", i)
        w = x if c.get("same_input") else ws[i]
        nodes = [g.call_function(aten.mul.Tensor, (h, w)),]
        nodes.append(g.call_function(aten.add.Tensor, (nodes[-1], x), {"alpha": c.get("alpha", 1)}))
        nodes.append(g.call_function(aten.tanh.default, (nodes[-1],)))
        nodes.append(g.call_function(aten.mul.Tensor, (nodes[-1], c.get("scale", 2.0))))
        nodes.append(g.call_function(aten.add.Tensor, (nodes[-1], x)))
        for n in nodes:
            n.meta[regions.TAG] = tag
            n.meta["val"] = c.get("val", torch.empty(3, 4))
        h = nodes[-1]
        if c.get("read_inside"):
            h = g.call_function(aten.add.Tensor, (h, nodes[1]))
    g.output((h,))
    return g


def _keys(copies, layouts=False):
    return [r.key for r in regions.repeated(_graph(copies), layouts=layouts)]


def test_equal_runs_share_a_key():
    assert _keys([{}, {}, {}]) == [0, 0, 0]


@pytest.mark.parametrize("change", [
    {"scale": -2.0},            # another constant
    {"alpha": True},            # True is not 1 (equal, and hash alike)
    {"same_input": True},       # an input read twice is one input, not two
    {"read_inside": True},      # an intermediate read after the run: another output
], ids=["constant", "bool-vs-int", "wiring", "outputs"])
def test_a_run_unlike_the_others_is_left_inline(change):
    assert _keys([{}, {}, change]) == [0, 0]


def test_negative_zero_is_another_constant():
    assert _keys([{"scale": 0.0}, {"scale": -0.0}]) == []
    assert _keys([{"scale": -0.0}, {"scale": -0.0}]) == [0, 0]


def test_layouts_count_only_when_asked():
    copies = [{}, {"val": torch.empty(4, 3).t()}]
    assert _keys(copies) == [0, 0]
    assert _keys(copies, layouts=True) == []


def test_symbolic_sizes_make_no_region():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._dynamo.source import ConstantSource
    env = ShapeEnv()
    sym = env.create_symintnode(env.create_symbol(3, ConstantSource("s")), hint=3)
    assert _keys([{"scale": sym}, {"scale": sym}]) == []


def test_short_runs_are_left_inline(monkeypatch):
    monkeypatch.setattr(regions, "MIN_NODES", 6)
    assert _keys([{}, {}]) == []


def _calls(source: str) -> set:
    """How many calls each block function of generated code has."""
    return set(Counter(re.findall(r"[=;] (_block\d+)\(_b\)", source)).values())


def _run(g, *args):
    return codegen.python_function(fx.GraphModule(torch.nn.Module(), g), "forward")(*args)


def test_code_with_regions_computes_the_inline_code(monkeypatch):
    copies = [{}, {"scale": -2.0}, {}, {"same_input": True}, {}]
    g = _graph(copies)
    args = [torch.randn(3, 4) for _ in range(2 + len(copies))]
    fn = codegen.python_function(fx.GraphModule(torch.nn.Module(), g), "forward")
    assert _calls(fn.source) == {3}, fn.source       # three equal runs call one function
    monkeypatch.setattr(regions, "ENABLED", False)
    inline = codegen.python_function(fx.GraphModule(torch.nn.Module(), g), "forward")
    assert not _calls(inline.source)
    assert torch.equal(fn(*args)[0], inline(*args)[0])


def test_a_block_whose_values_nothing_reads_still_runs():
    """Runs read by nothing after them (random draws kept for the stream) are called for their effect."""
    g = fx.Graph()
    x = g.placeholder("x")
    for i in range(2):
        h = x
        for _ in range(4):
            h = g.call_function(aten.mul.Tensor, (h, 2.0))
            h.meta[regions.TAG] = (3, "fw", i)
    g.output((x,))
    fn = codegen.python_function(fx.GraphModule(torch.nn.Module(), g), "forward")
    assert _calls(fn.source) == {2}, fn.source
    x = torch.randn(3)
    assert fn(x)[0] is x


def test_boxed_inputs_die_inside_the_block():
    """A backward's saved activation read last by a block is freed as the block reads it last, not
    when the block returns (the caller's name goes before the call)."""
    g = _graph([{}, {}])
    fn = codegen.python_function(fx.GraphModule(torch.nn.Module(), g), "backward", boxed=True)
    assert "_b = [h, w0, x]; del h, w0; " in fn.source, fn.source
    args = [torch.randn(3, 4) for _ in range(4)]
    expect = _run(_graph([{}, {}]), *args)
    assert torch.equal(fn(list(args))[0], expect[0])


def _edit_one_copy(captured, call_index: int):
    """The joint with the ``tanh`` of one block copy's forward made a ``sigmoid`` (its backward is
    left as it is: only the values matter here, not their meaning)."""
    gm = captured.flat_joint
    calls = sorted({n.meta[regions.TAG][2] for n in gm.graph.nodes if regions.TAG in n.meta})
    edited = 0
    for n in gm.graph.nodes:
        if n.meta.get(regions.TAG) is not None and n.meta[regions.TAG][1:] == ("fw", calls[call_index]) \
                and n.target is aten.gelu.default:
            n.target = aten.tanh.default
            n.kwargs = {}
            edited += 1
    assert edited == 1
    gm.recompile()
    return captured.with_joint(gm)


@pytest.mark.parametrize("which", [0, 2, 3])
def test_an_edited_copy_runs_its_own_code(monkeypatch, which):
    """A user edit of one copy of the joint makes it unlike its twins: it runs inline, the others
    still share one function, and the numbers are the inline code's (which differ from unedited)."""
    model, args = make_stack(n=4)()

    def step(enabled):
        monkeypatch.setattr(regions, "ENABLED", enabled)
        compiled = _edit_one_copy(aotgrad.capture(model, *args), which).compile()
        model.zero_grad()
        loss = compiled(*args)
        loss.backward()
        fw = codegen.python_function(compiled.forward_graph, "forward")
        return fw.source, loss.detach(), [p.grad.clone() for p in model.parameters()]
    source, loss, grads = step(True)
    assert _calls(source) == {3}, source
    source, loss_inline, grads_inline = step(False)
    assert not _calls(source), source
    assert torch.equal(loss, loss_inline) and all(torch.equal(a, b) for a, b in zip(grads, grads_inline))
    assert not torch.equal(loss, model(*args).detach())


@pytest.mark.parametrize("n", [2, 5])
def test_stack_trains_like_eager_and_inline(monkeypatch, n):
    monkeypatch.setattr(block_graph, "KEEP", False)     # copies of the template's nodes, not calls of its halves
    make = make_stack(n=n)
    model, args = make()
    compiled = aotgrad.capture(model, *args).compile()
    found = regions.repeated(compiled.forward_graph.graph), regions.repeated(compiled.backward_graph.graph)
    assert all(len(f) == n for f in found), [len(f) for f in found]
    said = {s.name: s.info.get("blocks compiled once") for s in compiled.history if s.name.startswith("compile")}
    assert said == {"compile forward": f"1 for {n} copies", "compile backward": f"1 for {n} copies"}
    check_training(make, steps=2)
    loss = compiled(*args)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    monkeypatch.setattr(regions, "ENABLED", False)
    model.zero_grad()
    inline = aotgrad.capture(model, *args).compile()
    assert not any(s.info.get("blocks compiled once") for s in inline.history)
    loss_inline = inline(*args)
    loss_inline.backward()
    assert torch.equal(loss, loss_inline)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


@pytest.mark.parametrize("halves", [True, False], ids=["halves", "copies"])
def test_an_op_failing_inside_a_block_names_the_users_line(monkeypatch, halves):
    """An op that refuses its inputs at run time inside a compiled block is an OpError naming the
    block's line, as it is in inline code: in a call of the block's forward half, and in a region
    of copies of its nodes."""
    monkeypatch.setattr(block_graph, "KEEP", halves)
    class Gather(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, h, idx):
            h = self.fc(h).tanh() * 2 + 1
            return h + h.sum(-1, keepdim=True).tanh() + h.gather(0, idx).sum()   # idx out of range fails here

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Gather() for _ in range(3))

        def forward(self, h, idx):
            for b in self.blocks:
                h = b(h, idx)
            return h.sum()
    net, h = Net(), torch.randn(3, 4, requires_grad=True)      # every block alike, the first too
    idx = torch.zeros(3, 4, dtype=torch.long)
    compiled = aotgrad.capture(net, h, idx).compile()
    # The last block runs flat (its output's gradient is the expand of a sum), the others share one.
    fw = codegen.python_function(compiled.forward_graph, "forward")
    source = fw.source
    assert _calls(source) == (set() if halves else {2}), source
    half_calls = [name for name in re.findall(r"= (_f\d+)\(", source) if isinstance(fw.__globals__[name], BlockPart)]
    assert len(half_calls) == (2 if halves else 0), source
    with pytest.raises(aotgrad.errors.OpError) as e:
        compiled(h, idx + 7)
    assert "idx out of range fails here" in str(e.value), str(e.value)
    assert "gather" in str(e.value)



def test_a_layers_recomputed_and_backward_nodes_are_one_region(monkeypatch):
    """Under the min-cut partitioner (Inductor's) the calls of a block's halves are inlined and the
    backward recomputes forward values (the GELU) between its own nodes: the copies of one layer's
    forward half and of its backward half carry one call number, so each layer's backward is one
    region (it was four: recomputed and backward nodes alternate), and the code computes the inline
    code's numbers."""
    from dataclasses import replace

    from examples import models

    n = 3
    model, args = models.make_gpt(replace(models.GPT_SDPA, n_layer=n, d_model=32, n_head=2))

    def step(enabled):
        monkeypatch.setattr(regions, "ENABLED", enabled)
        model.zero_grad()
        compiled = aotgrad.capture(model, *args).compile(partitioner="min_cut")
        loss = compiled(*args)
        loss.backward()
        return compiled, loss.detach(), [p.grad.clone() for p in model.parameters()]
    compiled, loss, grads = step(True)
    bw = compiled.backward_graph.graph
    assert any(n.meta.get(regions.TAG, ("", "bw"))[1] == "fw" for n in bw.nodes), "nothing recomputed"
    found = regions.repeated(bw)
    assert len(found) == n and len({r.key for r in found}) == 1, [(r.key, len(r.nodes)) for r in found]
    assert all({n.meta[regions.TAG][1] for n in r.nodes} == {"fw", "bw"} for r in found)
    _, loss_inline, grads_inline = step(False)
    assert torch.equal(loss, loss_inline) and all(torch.equal(a, b) for a, b in zip(grads, grads_inline))
