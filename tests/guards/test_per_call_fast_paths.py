"""The per-call fast paths (issue #61): each shortcut still raises, recompiles or refuses where the
full check would. A saved view of a parameter that is already a view of the caller's tensor
(the eager backend's ``t()``) skips the storage comparison: a write to the parameter after the
forward must still raise eager's version error at backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import aotgrad


def _outcome(fn):
    try:
        fn()
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)
    return None


def _write_after_forward(step, model, x, write):
    loss = step(x).square().sum()
    write(model)
    loss.backward()


@pytest.mark.parametrize("write", ["weight", "weight_view_base", "bias"])
def test_a_saved_view_of_a_parameter_written_after_the_forward_raises_as_eager(write):
    outcomes = []
    for compiled in (False, True):
        torch.manual_seed(0)
        lin = nn.Linear(3, 2)      # its input requires grad: eager's addmm saves its weight
        if write == "weight_view_base":       # a parameter that is itself a view of another tensor
            lin.weight = nn.Parameter(torch.randn(2, 2, 3)[0])
        model, x = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), lin), torch.randn(5, 4)
        step = aotgrad.capture(model, x).compile() if compiled else model

        def mutate(m):
            with torch.no_grad():
                (m[2].bias if write == "bias" else m[2].weight).add_(1.0)
        outcomes.append(_outcome(lambda: _write_after_forward(step, model, x, mutate)))
    assert outcomes == [write != "bias" or None] * 2


def test_an_unwritten_saved_view_trains_like_eager():
    from tests.eager_check import check
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (torch.randn(5, 4, requires_grad=True),))


# --- children and hook dicts checked by version tag (guards.state._by_version)

class Chain(nn.Module):
    """Runs its ModuleDict's children in the dict's order."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Tanh(), "c": nn.Linear(4, 4)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _same_as_eager(step, model, x):
    torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)


def _reinsert_last(d):
    k, v = d.popitem()      # a write leaving the same entries in the same order: a new version tag
    d[k] = v


CHANGES = {
    "replace a child": lambda m: m.layers.__setitem__("b", nn.ReLU()),
    "reorder children in place": lambda m: [m.layers._modules.__setitem__(k, m.layers._modules.pop(k)) for k in "ab"],
    "add a child": lambda m: m.layers.__setitem__("d", nn.Sigmoid()),
    "remove a child": lambda m: m.layers._modules.pop("b"),
    "a new dict, same entries, then a replaced child": lambda m: (
        setattr(m.layers, "_modules", dict(m.layers._modules)), m.layers.__setitem__("b", nn.ReLU())),
}


@pytest.mark.parametrize("first_a_noop_write", [False, True])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_child_dict_recompiles_after_its_tag_was_refreshed(change, first_a_noop_write):
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(3, 4)
    step = aotgrad.jit(model)
    _same_as_eager(step, model, x)
    if first_a_noop_write:       # tag changed, entries equal: no recompile, and the new tag is the expected one
        _reinsert_last(model.layers._modules)
        _same_as_eager(step, model, x)
        _same_as_eager(step, model, x)
        assert len(step.entries) == 1
    CHANGES[change](model)
    _same_as_eager(step, model, x)
    assert len(step.entries) == 2


def test_forward_hooks_reordered_in_place_recompile():
    """Hook dicts are ``OrderedDict``s, whose ``move_to_end`` keeps the version tag: compared entry by entry."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(3, 4)
    model[0].register_forward_hook(lambda m, i, o: o * 2)
    model[0].register_forward_hook(lambda m, i, o: o + 1)
    step = aotgrad.jit(model)
    _same_as_eager(step, model, x)
    model[0]._forward_hooks.move_to_end(next(iter(model[0]._forward_hooks)))
    _same_as_eager(step, model, x)
    assert len(step.entries) == 2


def test_a_holder_given_a_non_dict_is_a_mismatch_not_a_crash():
    from aotgrad.guards import state
    holder = {"kids": {"a": 1}}
    read = state.Read("h.kids", None, holder, "kids", {"a": 1}, "dict")
    guards = state.build([read])
    assert guards.check() is None
    holder["kids"] = [("a", 1)]         # dict_version raises on it
    assert guards.check() == 0
    holder["kids"] = {"a": 1}
    assert guards.check() is None
    holder["kids"]["a"] = 2
    assert guards.check() == 0


def test_a_group_of_plain_dicts_and_hook_dicts_checks_both():
    """A hooked module's ``OrderedDict`` next to plain children dicts: each still recompiles when changed."""
    for change in ("child", "hooks"):
        torch.manual_seed(0)
        model, x = Chain(), torch.randn(3, 4)
        model.layers["a"].register_forward_hook(lambda m, i, o: o * 2)
        model.layers["a"].register_forward_hook(lambda m, i, o: o + 1)
        step = aotgrad.jit(model)
        _same_as_eager(step, model, x)
        if change == "child":
            model.layers["b"] = nn.ReLU()
        else:
            model.layers["a"]._forward_hooks.move_to_end(next(iter(model.layers["a"]._forward_hooks)))
        _same_as_eager(step, model, x)
        assert len(step.entries) == 2, change
