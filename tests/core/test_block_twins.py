"""The twin stacks of ``tests/differential/p_blocks.py`` with block reuse on and off: the same
outputs and gradients bit for bit (reuse stamps the flat trace's graph, or calls the halves of the template's
joint partitioned once), and reuse where it is
sound. The differential suite compares the same programs with eager through every entry point."""
import re

import pytest
import torch

import aotgrad
from aotgrad._torch import no_stack_traces
from aotgrad.capture import block_graph
from tests.differential.p_blocks import G
from tests.differential.programs import PROGRAMS

TWINS = sorted(name for name, p in PROGRAMS.items() if G in p.tags)

# How many block calls a template stands for; 0 where reuse would be wrong or is not possible.
REUSED = {
    # A block drawing from a torch.Generator it holds runs flat: a template's graph would hold one block's.
    "generator_per_block": 0, "generator_alternating_blocks": 0,
    "blocks_input_without_grad": 3, "blocks_input_with_grad": 3,
    "blocks_signed_zero_attribute": 2,          # the two 0.0 blocks share a template, -0.0 runs flat
    "blocks_signed_zero_argument": 3,           # one template for 0.0, one for -0.0
    "blocks_nan_attribute": 2, "blocks_hold_a_plain_tensor_attribute": 0,
    "blocks_one_in_eval": 2, "blocks_one_float64": 2,
    "blocks_one_frozen": 2, "blocks_first_frozen_input_without_grad": 2,
    "blocks_no_grad_around_one": 3, "blocks_no_grad_around_last": 3,
    "blocks_head_shares_weight": 3, "blocks_one_called_twice": 4, "blocks_output_unused": 3,
    "blocks_identity_through_global": 0, "blocks_identity_through_class_attribute": 0,
    "blocks_identity_through_closure": 0,
    "blocks_layer_index": 1,                    # block 0's own template; the others' values are theirs alone
    "blocks_return_their_layer_index": 1,
    "blocks_layer_index_read_only_with_a_cache": 3, "blocks_scalar_unread": 3,
    "blocks_layer_index_writes_a_cache": 0, "blocks_append_to_a_list_argument": 0,
    "blocks_scalar_read_only_where_a_flag_says": 3,     # blocks 0 and 2 share one; block 1 its own
    **{f"blocks_scalar_read_{how}": 4 for how in (
        "attribute", "getattr", "vars", "dict", "helper", "comprehension", "property", "parent",
        "method_of_child")},     # one template for the 0.5 pair, one for the 2.0 pair
    "blocks_sdpa": 3, "blocks_sdpa_dropout": 3, "blocks_sdpa_one_dropout": 2,
    "blocks_bf16_input": 2,
    "blocks_output_is_a_view": 3, "blocks_view_output_written_in_place": 3,
    "blocks_view_output_reshaped_and_returned": 2,
    "blocks_dropout": 4, "blocks_dropout_between_random_ops": 3,
    "blocks_dropout_one_checkpointed": 2,       # the checkpointed call runs flat (saved-tensor hooks)
    "blocks_draw_nothing_reads": 3, "blocks_dropout_one_under_fork_rng": 3,
    "blocks_dropout_of_a_transposed_value": 3,
    "blocks_first_input_column_major": 0,       # column-major gradients: each call runs flat
    "blocks_one_call_passes_one_tensor_twice": 3,       # the call given x twice runs flat
    "blocks_input_used_twice_inside_and_shared": 3,      # each use's gradient its own: the joint adds them in order
    "blocks_input_squared_inside_and_shared": 3,
    "blocks_input_in_one_cat_twice_inside_and_shared": 3,
    "blocks_input_passed_through_inside_and_shared": 3,     # two gradients, one of them a sum itself
    "blocks_weight_argument_used_twice_in_each": 3,     # its two uses' gradients contested: autograd adds them
    "blocks_one_intermediate_read_after_its_call": 3,   # block 1's kept output has an expand as gradient
    # aotgrad.block: a leaf block only when marked; a block marked off runs flat; an instance's mark wins
    "blocks_raw_unmarked": 0, "blocks_raw_class_marked": 3, "blocks_one_instance_marked_off": 3,
    "blocks_class_marked_off": 0, "blocks_instance_mark_wins_over_class": 2, "blocks_torch_leaves_marked": 2,
    "blocks_marked_leaf_writes_a_buffer": 0, "blocks_marked_leaf_dropout": 3, "blocks_marked_leaves_tie_a_weight": 2,
    "blocks_marked_leaf_scales_differ": 2, "blocks_marked_leaf_one_in_eval_one_under_no_grad": 3,
    "blocks_marked_leaf_checkpointed": 2, "blocks_marked_torch_layernorms": 2,
    # layer_idx passed to a cache's update: one template for every layer; any other use of it makes
    # block 0's template its own, and the others run flat. A question asked of the cache (seen()) is
    # asked again of each call's: the same answer, the same template
    "blocks_cache_layer_index_update": 3, "blocks_cache_read_after_squares": 3,
    "blocks_cache_read_after_sums": 0,         # their gradients are expanded: each call runs flat
    "blocks_cache_input_without_grad": 3,
    **{f"blocks_cache_layer_index_{how}": 1 for how in ("scaled", "listed", "named", "caught", "vars")},
    # asked what a stand answers as no int would (type(), is, json's exact int): traced again with block 0's own
    **{f"blocks_cache_layer_index_{how}": 1 for how in ("typed", "typed_then_compared", "identity", "json")},
    "blocks_cache_layer_index_seen": 3, "blocks_cache_layer_index_twice": 0,
    "blocks_cache_one_layer_for_all": 0,        # the second call finds layer 0 full (and the first one's keys get a sliced gradient)
    "blocks_cache_given_full": 0,
    "blocks_cache_update_keeps_the_layer_index": 0,     # an update that stores its index: no template
    # an encoder-decoder cache: questions (get_seq_length, is_updated.get) asked again of each call's
    # cache, a flag set per call, the bias given returned as it is, a number returned
    "blocks_cache_encoder_decoder": 3, "blocks_cache_encoder_decoder_asked_after": 3,
    "blocks_cache_encoder_decoder_flagged": 0,      # the layers read the cross cache's keys: flat
    "blocks_cache_passed_twice": 0,
    "blocks_hook_registered_in_the_forward": 2,     # the hooked block runs flat, with its hook
}

# The forward's copies that share one compiled block (runtime/regions.py): (by the eager backend,
# by a compiler that specialises on layouts). The copy unlike its twins runs its own code.
REGIONS = {
    "blocks_one_call_passes_one_tensor_twice": (3, 3), "blocks_one_intermediate_read_after_its_call": (3, 3),
    "blocks_input_with_grad": (3, 3),
    "blocks_input_without_grad": (3, 3),    # block 0 saved less; with view chains folded (passes.views) its forward is its twins'
    "blocks_first_input_column_major": (0, 0),
}


def _run(name, reuse):
    torch.manual_seed(0)
    fn, args, kwargs = PROGRAMS[name].make()
    captured = aotgrad.capture(fn, *args, reuse_blocks=reuse, **kwargs)
    used = next(s.info["reused blocks"] for s in captured.history if s.name == "trace joint")
    torch.manual_seed(1)
    outs = captured.compile()(*args, **kwargs)
    outs = [o for o in torch.utils._pytree.tree_leaves(outs) if isinstance(o, torch.Tensor)]
    sum(o.float().pow(2).sum() for o in outs).backward()
    out = torch.cat([o.detach().flatten() for o in outs])
    grads = [p.grad for p in fn.parameters()] + [a.grad for a in args if isinstance(a, torch.Tensor)]
    return used, out.detach(), grads


# Why the calls that ran flat did (``history``: the joint trace's ``blocks run flat``).
WHY = {
    "blocks_layer_index": ("Indexed", "its layer_idx differs from every twin's, and the template read it"),
    "blocks_append_to_a_list_argument": ("Appended", "it writes a list or dict argument"),
    "blocks_identity_through_global": ("Marked", "its code reaches a block other than through itself"),
    "blocks_dropout_one_checkpointed": ("Dropped", "a checkpoint"),
    "blocks_signed_zero_attribute": ("Block", "its eps differs"),
    "blocks_input_with_grad": None,
    "blocks_first_input_column_major": ("Block", "an output's gradient is not contiguous"),
    "blocks_one_call_passes_one_tensor_twice": ("Pair", "it is given one tensor twice"),
}


@pytest.mark.parametrize("name", sorted(WHY))
def test_history_says_why_blocks_ran_flat(name):
    fn, args, kwargs = PROGRAMS[name].make()
    captured = aotgrad.capture(fn, *args, **kwargs)
    why = next(s.info.get("blocks run flat") for s in captured.history if s.name == "trace joint")
    if WHY[name] is None:
        assert why is None
    else:
        cls, text = WHY[name]
        assert text in why[cls]


def test_every_twin_program_has_an_expectation():
    assert sorted(REUSED) == TWINS


@pytest.mark.parametrize("halves", [True, False], ids=["halves", "copies"])
@pytest.mark.parametrize("name", TWINS)
def test_reuse_stamps_the_flat_graph(name, halves, monkeypatch):
    """Calls of a template's halves (partition/blocks.py) and copies of its nodes, each bit for bit
    the flat trace."""
    monkeypatch.setattr(block_graph, "KEEP", halves)
    used, out, grads = _run(name, True)
    flat_used, flat_out, flat_grads = _run(name, False)
    assert flat_used == 0
    assert used == REUSED[name]
    assert torch.equal(out, flat_out)
    assert len(grads) == len(flat_grads)
    for g, f in zip(grads, flat_grads):
        assert (g is None) == (f is None)
        if g is not None:
            assert torch.equal(g, f)


def test_scalars_changed_after_the_first_call_are_seen_where_a_block_reads_them():
    """Twins differing in a value their template did not read share it; a later change to a
    value a block then reads (its ``use_scale``, then its ``scale``) must reach that block."""
    from tests.differential.p_blocks import Scaled, Stack
    torch.manual_seed(0)
    m = Stack([Scaled(s, use_scale=False) for s in (0.5, 1.0, 2.0)])
    step, x = aotgrad.jit(m), torch.randn(4, 4)
    changes = [lambda: None, lambda: setattr(m.blocks[2], "scale", 9.0),
               lambda: setattr(m.blocks[1], "use_scale", True), lambda: setattr(m.blocks[1], "scale", -3.0),
               lambda: setattr(m.blocks[2], "use_scale", True)]
    for change in changes:
        change()
        torch.testing.assert_close(step(x), m(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(REGIONS))
def test_copies_share_a_compiled_block_only_where_equal(name, monkeypatch):
    from aotgrad.runtime import regions
    monkeypatch.setattr(block_graph, "KEEP", False)     # copies of the template's nodes, not calls of its halves
    fn, args, kwargs = PROGRAMS[name].make()
    fw = aotgrad.capture(fn, *args, **kwargs).compile().forward_graph.graph
    found = [len(regions.repeated(fw)), len(regions.repeated(fw, layouts=True))]
    assert tuple(found) == REGIONS[name]


def _dispatched():
    raise AssertionError("a block call was dispatched, not recorded")


def _numbered(code: str) -> str:
    """``code`` with its templates' keys (a process-wide count) numbered in order of appearance."""
    keys: dict = {}
    return re.sub(r"block(\d+)", lambda m: "block%d" % keys.setdefault(m.group(1), len(keys)), code)


@pytest.mark.parametrize("name", TWINS)
def test_recorded_block_nodes_are_the_dispatched_ones(name, monkeypatch):
    """A call of a template is recorded straight into the joint's trace (``_torch.traced_call``):
    the same joint graph, outputs and gradients as dispatching its ``block_fw``/``block_bw`` op
    through functionalization, the proxy mode and the fake mode."""
    seen = []
    for direct in (True, False):
        monkeypatch.setattr(block_graph, "DIRECT", direct)
        # Recorded, every one of them: the dispatch (no_stack_traces around the op) is not reached.
        monkeypatch.setattr(block_graph, "no_stack_traces", _dispatched if direct else no_stack_traces)
        seen.append(_trained(PROGRAMS[name].make))
    _same_runs(*seen)


def _trained(make):
    """The joint's code (templates numbered), its values' layouts, the outputs and the gradients of
    one step of ``make()``'s program, captured and compiled."""
    torch.manual_seed(0)
    fn, args, kwargs = make()
    captured = aotgrad.capture(fn, *args, **kwargs)
    torch.manual_seed(1)
    outs = captured.compile()(*args, **kwargs)
    outs = [o for o in torch.utils._pytree.tree_leaves(outs) if isinstance(o, torch.Tensor)]
    sum(o.float().pow(2).sum() for o in outs).backward()
    grads = [p.grad for p in fn.parameters()] + [a.grad for a in args if isinstance(a, torch.Tensor)]
    vals = [(tuple(v.shape), v.stride(), v.dtype) for n in captured.joint.graph.nodes
            if isinstance(v := n.meta.get("val"), torch.Tensor)]
    return _numbered(captured.joint.code), vals, [o.detach() for o in outs], grads


def _same_runs(a, b) -> None:
    (code, vals, outs, grads), (code_b, vals_b, outs_b, grads_b) = a, b
    assert code == code_b and vals == vals_b
    assert all(torch.equal(x, y) for x, y in zip(outs, outs_b))
    assert all((x is None) == (y is None) and (x is None or torch.equal(x, y)) for x, y in zip(grads, grads_b))


class _UsedTwice(torch.nn.Module):
    """Gradients the engine sums: a residual's input (two contiguous ones), a transposed use beside a
    plain one (another layout: dispatched), a broadcast use beside a whole one."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = x @ self.w
        h = h + torch.tanh(h)           # h's two gradients, both contiguous
        h = h + (self.w.t() * 3.0).sum(0)       # w's second gradient is transposed
        return (h + self.b).sum() + (self.b * 2).sum()  # b used broadcast and whole


_HALF = torch.full((3, 4), 0.5)


class _ConstantGradient(torch.autograd.Function):
    """A backward that returns a tensor the trace holds as a constant (no node of its own)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return _HALF


class _SumsAConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        h = x * self.w
        return _ConstantGradient.apply(h).sum() + (h * 2).sum()


class _DegenerateSums(torch.nn.Module):
    """Gradients the engine sums where a dimension is 1 or 0: ``is_contiguous`` holds for an expanded
    gradient (stride 0) there, and the sum is laid out afresh, not as either gradient is."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x, e):
        # (the engine sums a tensor's gradients latest use first: x.t()'s and e.sum(0)'s come first)
        return (x @ self.w).sum() + (e @ self.w).sum() + (e * 2).sum() + (x.t() * 3.0).sum() + e.sum(0).sum()


_ENGINE_SUM_PROGRAMS = {"used_twice": lambda: (_UsedTwice(), (torch.randn(3, 4, requires_grad=True),), {}),
                        "constant_gradient": lambda: (_SumsAConstant(), (torch.randn(3, 4),), {}),
                        "degenerate": lambda: (_DegenerateSums(), (torch.randn(1, 3, requires_grad=True),
                                                                   torch.randn(0, 3, requires_grad=True)), {})}


# (a checkpoint's recomputation runs under the read recording, which would refuse the spy's list)
@pytest.mark.parametrize("name", [n for n in TWINS if "checkpoint" not in n][::4] + list(_ENGINE_SUM_PROGRAMS))
def test_recorded_engine_sums_are_the_dispatched_ones(name, monkeypatch):
    """The engine's sum of two gradients of one tensor is recorded straight into the joint's trace
    (``_torch.traced_sum``) where both are contiguous and alike: the same joint graph, values and
    layouts, outputs and gradients as dispatching ``aten.add`` through the three modes."""
    from aotgrad import _torch
    from aotgrad.capture import session
    recorded = []
    real = _torch.traced_sum

    def spy(a, b, mode):
        recorded.append(real(a, b, mode))
        return recorded[-1]
    if name == "used_twice":    # (where a custom backward runs, the capture watches its writes: the list's too)
        monkeypatch.setattr(session, "traced_sum", spy)
    make = _ENGINE_SUM_PROGRAMS.get(name) or PROGRAMS[name].make
    seen = []
    for on in (True, False):
        monkeypatch.setattr(session, "ENGINE_SUMS", on)
        seen.append(_trained(make))
    _same_runs(*seen)
    if name == "used_twice":     # h's and b's sums recorded, w's (a transposed gradient) dispatched
        assert any(r is not None for r in recorded) and any(r is None for r in recorded)
