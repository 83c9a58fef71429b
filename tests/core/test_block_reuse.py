"""Repeated blocks traced once (aotgrad.capture.blocks): the graph, values and guards of a flat capture."""
import operator
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dataclasses import replace

import aotgrad
from aotgrad.ir.ops import aliases_input
from aotgrad import errors
from aotgrad.capture import block_graph, block_groups, blocks
from examples import models
from tests.eager_check import check_training


class Block(nn.Module):
    def __init__(self, d=8, scale=0.5, norm=None, p=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = norm if norm is not None else nn.Identity()
        self.drop = nn.Dropout(p)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * self.drop(self.fc2(F.gelu(self.fc1(self.norm(self.ln(x))))))


class Stack(nn.Module):
    def __init__(self, make_block=Block, n=4, d=8):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(make_block() for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.out(h).squeeze(-1), y)


def make_stack(make_block=Block, n=4, edit=None):
    def make():
        torch.manual_seed(0)
        m = Stack(make_block, n)
        if edit is not None:
            edit(m)
        g = torch.Generator().manual_seed(1)
        return m.train(), (torch.randn(6, 3, generator=g), torch.randn(6, generator=g))
    return make


def reused(captured) -> int:
    return next(s.info["reused blocks"] for s in captured.history if s.name == "trace joint")


def compiled_and_reused(make, **capture_opts):
    seen = []

    def compile(fn, args, kwargs, **opts):
        captured = aotgrad.capture(fn, *args, **capture_opts, **kwargs)
        aotgrad.verify(captured)
        seen.append(reused(captured))
        return captured.compile(**opts)
    check_training(make, compile=compile)
    return seen[0]


def test_gpt_blocks_traced_once_match_the_flat_capture_exactly():
    runs = []
    for reuse in (True, False):
        model, args = models.make_gpt(replace(models.GPT_TINY, n_layer=2))
        captured = aotgrad.capture(model, *args, reuse_blocks=reuse)
        loss = captured.compile(fw_compiler="eager")(*args)
        loss.backward()
        # Every operator but views and unpacking (a block's backward half makes a view of its input
        # again rather than saving it) the flat trace computes, as often.
        ops = Counter(str(n.target) for n in captured.flat_joint.graph.nodes
                      if n.op == "call_function" and n.target is not operator.getitem and not aliases_input(n))
        runs.append((captured, loss.detach(), [p.grad for p in model.parameters()], ops))
    (c_on, loss_on, grads_on, ops_on), (c_off, loss_off, grads_off, ops_off) = runs
    assert reused(c_on) == 2 and reused(c_off) == 0
    assert ops_on == ops_off
    assert torch.equal(loss_on, loss_off)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))


def test_repeated_blocks_train_like_eager():
    assert compiled_and_reused(make_stack()) == 4


def test_opt_out_traces_every_block():
    assert compiled_and_reused(make_stack(), reuse_blocks=False) == 0


def test_a_block_with_another_value_of_an_attribute_it_reads_runs_its_own_code():
    # Twins by structure (a scalar attribute counts by its type), but the template read ``scale``:
    # it stands only for the three blocks with 0.5; block 2, the only one with 2.0, runs flat.
    def edit(m):
        m.blocks[2].scale = 2.0
    groups = block_groups.find_groups(make_stack(edit=edit)()[0])
    assert len(groups) == 4 and {m.varying for m in groups.values()} == {(("", "scale"),)}
    assert compiled_and_reused(make_stack(edit=edit)) == 3


def test_blocks_that_mutate_run_flat():
    assert compiled_and_reused(make_stack(lambda: Block(norm=nn.BatchNorm1d(8)))) == 0


def test_blocks_that_draw_random_numbers_are_reused_on_eagers_stream():
    # Each stamped copy's dropout draws at its own call's place in the stream: eager's masks.
    assert compiled_and_reused(make_stack(lambda: Block(p=0.5))) == 4


def test_blocks_sharing_a_submodule_train_like_eager():
    shared = nn.Linear(16, 8)

    def block():
        b = Block()
        b.fc2 = shared
        return b
    assert compiled_and_reused(make_stack(block)) == 4


def _same(f, model, *args):
    got = f(*args)
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ref = model(*args)
    ref.backward()
    torch.testing.assert_close(got, ref)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    model.zero_grad(set_to_none=True)


def test_a_change_to_one_reused_block_recompiles():
    model, args = make_stack()()
    f = aotgrad.jit(model)
    _same(f, model, *args)
    model.blocks[3].scale = 3.0             # read only by the template's trace of blocks[0]
    _same(f, model, *args)
    model.blocks[2].fc1.register_forward_hook(lambda m, i, o: o * 2)
    _same(f, model, *args)
    reasons = " | ".join(e.reason for e in f.entries[1:])
    assert "blocks.3.scale" in reasons and "blocks.2.fc1._forward_hooks" in reasons


def test_capture_leaves_nothing_behind_when_a_block_fails():
    class Bad(Block):
        def forward(self, x):
            raise RuntimeError("the block's own failure")
    model, args = make_stack(Bad)()
    with pytest.raises(errors.AotgradError):
        aotgrad.capture(model, *args)
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl
    assert not block_graph.TEMPLATES


class KwBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x, mask=None, scale=1.0, pair=True):
        y = self.fc(self.ln(x)) * scale
        if mask is not None:
            y = y * mask
        return (x + y, y.square().mean()) if pair else x + y


class KwStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(KwBlock() for _ in range(3))

    def forward(self, x, mask):
        aux = 0
        for i, b in enumerate(self.blocks):
            x, a = b(x, mask=mask, scale=0.5 * (i % 2 + 1))
            aux = aux + a
        return x.sum() + aux


def test_keyword_and_constant_arguments_and_tuple_outputs():
    def make():
        torch.manual_seed(0)
        return KwStack(), (torch.randn(4, 8), (torch.rand(4, 8) > 0.3).float())
    # Two scales: two templates, each standing for its calls but the last, whose output's gradient is
    # the expand of x.sum() (block_graph.FlatCall).
    assert compiled_and_reused(make) == 2


def test_compiled_graphs_give_each_placeholder_its_own_example():
    """Copies of a template share their nodes' values; a compiler retracing with make_fx maps
    examples to inputs by object, so shared examples made it read one input for another."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def retracing(gm, examples):
        vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        shared.append(len({id(v) for v in vals}) < len(vals))
        assert len({id(e) for e in examples}) == len(examples), "two placeholders were given one example"
        with examples[0].fake_mode:
            return make_fx(gm, decomposition_table={})(*examples)

    shared = []
    make = make_stack(n=3)
    model, args = make()
    assert reused(aotgrad.capture(model, *args)) == 3
    check_training(make, steps=2, fw_compiler=retracing)
    assert any(shared), "no graph had placeholders sharing a value: the test tests nothing"


def _direct(captured) -> int:
    return next(s.info["direct grads"] for s in captured.history if s.name == "trace joint")


def _flat_and_reused_agree(make):
    """Loss and every gradient of the reused capture equal the flat capture's bit for bit."""
    runs = []
    for reuse in (True, False):
        model, args = make()
        captured = aotgrad.capture(model, *args, reuse_blocks=reuse)
        captured.compile(fw_compiler="eager")(*args).backward()
        runs.append((captured, [p.grad for p in model.parameters()]))
    (c_on, grads_on), (_, grads_off) = runs
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    return c_on


def _unseen(captured) -> int:
    return next(s.info["unseen inputs"] for s in captured.history if s.name == "trace joint")


def test_block_parameters_stay_out_of_the_trace():
    """Each block's own parameters (4 blocks x 6) are not inputs of the traced function and skip
    its autograd; nothing else does."""
    captured = _flat_and_reused_agree(make_stack())
    assert reused(captured) == 4 and _direct(captured) == 24 and _unseen(captured) == 24
    assert compiled_and_reused(make_stack()) == 4
    assert [n.name for n in captured.joint.graph.find_nodes(op="placeholder")][:3] == \
        ["p_inp_weight", "p_inp_bias", "p_blocks_0_ln_weight"]


class OutsideUse(Stack):
    """A block's parameter also used outside the blocks: its gradient has two contributions."""

    def forward(self, x, y):
        return super().forward(x, y) + self.blocks[1].fc1.weight.square().mean()


class GradInside(Stack):
    """autograd.grad of a block's parameter inside the function: the block's backward must return
    it then, though the joint's own backward has it written directly."""

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        g, = torch.autograd.grad(h.square().sum(), self.blocks[2].fc2.weight, retain_graph=True)
        return F.mse_loss(self.out(h).squeeze(-1), y) + self.out(h).mean() * g.norm()


class CalledTwice(Stack):
    """One block applied twice: its parameters' gradients have two contributions."""

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.out(self.blocks[0](h)).squeeze(-1), y)


class CaughtOutside(Stack):
    """An op outside the blocks reads a block's parameter inside a try/except that swallows
    everything: the trace must still notice and trace that parameter as an input."""

    def forward(self, x, y):
        try:
            extra = self.blocks[3].fc2.bias.abs().sum()
        except Exception:
            extra = 0.0
        return super().forward(x, y) + extra


class DataOutside(Stack):
    """A block's parameter read through .data outside the blocks (no gradient, another tensor)."""

    def forward(self, x, y):
        return super().forward(x, y) + self.blocks[1].fc1.weight.data.sum() * 0.1


@pytest.mark.parametrize("cls, direct, calls", [(OutsideUse, 0, 4), (GradInside, 24, 4), (CalledTwice, 18, 5),
                                                (CaughtOutside, 0, 4), (DataOutside, 24, 4)])
def test_block_parameters_with_other_uses_match_the_flat_trace(cls, direct, calls):
    def make():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return cls(Block, 4).train(), (torch.randn(6, 3, generator=g), torch.randn(6, generator=g))
    captured = _flat_and_reused_agree(make)
    # Each one is traced again with every input seen; those with a gradient from outside the
    # blocks once more, without direct gradients (autograd adds them up in a flat trace's order).
    assert reused(captured) == calls and _direct(captured) == direct and _unseen(captured) == 0
    assert compiled_and_reused(make) == calls


def test_blocks_that_ran_flat_keep_their_parameters_seen(monkeypatch):
    """A block whose template was refused (a mutation) runs its own code, which reads its
    parameters: they are traced as inputs from the start, not found missing and traced again."""
    import importlib
    cap = importlib.import_module("aotgrad.capture.capture")
    traces = []
    original = cap.trace_joint
    monkeypatch.setattr(cap, "trace_joint", lambda *a, **k: traces.append(k["unseen"]) or original(*a, **k))
    model, args = make_stack(lambda: Block(norm=nn.BatchNorm1d(8)))()
    captured = aotgrad.capture(model, *args)
    assert reused(captured) == 0 and _unseen(captured) == 0 and traces == [frozenset()]     # one trace
    traces.clear()
    model, args = make_stack()()
    assert _unseen(aotgrad.capture(model, *args)) == 24 and len(traces) == 1


class WithConstant(Stack):
    """A tensor built from data in the function: a real constant in the graph, not a stand-in."""

    def forward(self, x, y):
        return super().forward(x, y) * torch.tensor([1.5, 2.0]).sum()


def test_real_constants_do_not_drop_unseen_inputs():
    def make():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return WithConstant(Block, 4).train(), (torch.randn(6, 3, generator=g), torch.randn(6, generator=g))
    captured = _flat_and_reused_agree(make)
    assert captured.joint.graph.find_nodes(op="get_attr") and _unseen(captured) == 24
    assert compiled_and_reused(make) == 4


class Transposing(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x).transpose(0, 1)       # each block's output gradient comes transposed
        return x.sum()


def test_calls_a_template_cannot_stand_for_cost_one_more_trace_in_all(monkeypatch):
    """Every call here has a non-contiguous output gradient, so runs flat; one trace finds them
    all, so the joint is traced as often for 6 blocks as for 2 (it was once more per call)."""
    from aotgrad.capture import capture as capture_mod
    counts, real = [], capture_mod.trace_joint
    for n in (2, 6):
        traced = []
        monkeypatch.setattr(capture_mod, "trace_joint", lambda *a, **k: traced.append(1) or real(*a, **k))
        torch.manual_seed(0)
        model, x = Transposing(n), torch.randn(8, 8, requires_grad=True)
        captured = aotgrad.capture(model, x)
        assert reused(captured) == 0
        why = next(s.info["blocks run flat"] for s in captured.history if s.name == "trace joint")
        assert "not contiguous" in why["Block"]
        counts.append(len(traced))
    assert counts[0] == counts[1], counts

    def make():
        torch.manual_seed(0)
        return Transposing(4), (torch.randn(8, 8, requires_grad=True),)
    check_training(make, steps=1)


def test_the_block_marker_takes_modules_and_module_classes_only():
    with pytest.raises(errors.OptionError, match="nn.Module"):
        aotgrad.block(lambda x: x)
    with pytest.raises(errors.OptionError, match="reuse"):
        aotgrad.block(nn.Linear(2, 2), reuse="no")
    lin = nn.Linear(2, 2)
    assert aotgrad.block(lin, reuse=False) is lin and block_groups.marked(lin) is False

    @aotgrad.block(reuse=False)
    class Off(Block):
        pass

    class Under(Off):
        pass
    under = Under()
    assert block_groups.marked(under) is False and block_groups.marked(Block()) is None
    aotgrad.block(under)
    assert block_groups.marked(under) is True      # the instance's mark wins


def test_a_marked_leaf_block_traces_once_and_trains_like_eager():
    """Four raw-parameter layers (no submodules) are no block until their class is marked; marked,
    one template stands for all four and the step trains exactly like eager."""
    class RawLayer(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(d, d) / 3), nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return x + F.gelu(x @ self.w + self.b)

    def make_block():
        return RawLayer()
    make = make_stack(make_block)
    assert compiled_and_reused(make) == 0
    aotgrad.block(RawLayer)
    assert compiled_and_reused(make) == 4


class _ReadsAWrittenBase(nn.Module):
    """Each block reads a view of a tensor written in place after the view was taken, and, in the
    other order, a view taken after the write: its call's input is functionalization's pending
    update, replayed before the recorded call reads it (``_torch.traced_call``)."""

    def __init__(self, n=3, d=8, late=False):
        super().__init__()
        self.inp = nn.Linear(3, 2 * d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(2 * d, 1)
        self.d, self.late = d, late

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            v = h[:, :self.d]
            h.mul_(1.5)     # the view sees it: eager's value, and autograd's history through the write
            if self.late:
                v = h[:, self.d:]
            h = b(v).repeat(1, 2) * 0.5 + h
        return F.mse_loss(self.out(h).squeeze(-1), y)


@pytest.mark.parametrize("late", [False, True], ids=["view_then_write", "write_then_view"])
@pytest.mark.parametrize("direct", [True, False], ids=["recorded", "dispatched"])
def test_a_block_reading_a_view_of_a_written_tensor_trains_like_eager(late, direct, monkeypatch):
    monkeypatch.setattr(block_graph, "DIRECT", direct)

    def make():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return _ReadsAWrittenBase(late=late).train(), (torch.randn(6, 3, generator=g), torch.randn(6, generator=g))
    assert compiled_and_reused(make) == 3
