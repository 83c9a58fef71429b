"""The per-call state check is one generated function with expected values in
closure cells, refreshed after a false alarm (an equal value in a new object, a
parameter replaced by another of the same count). A refresh must never hide a
later real change: each case first triggers a refresh, then changes the state
and expects a recompile and eager's result."""
import torch
import torch.nn as nn

import aotgrad


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scale = 2.0
        self.cfg = {"shift": 1, 7: 0.5}

    def forward(self, x):
        return self.fc(x) * self.scale + self.cfg["shift"] + self.cfg[7]


def _same(jitted, eager, x):
    torch.testing.assert_close(jitted(x), eager(x))


def test_equal_new_value_refreshes_then_a_real_change_recompiles():
    m, x = Scaled(), torch.randn(2, 3)
    f = aotgrad.jit(m)
    _same(f, m, x)
    m.scale = float("2.0")          # equal, another object: a false alarm, no recompile
    _same(f, m, x)
    assert len(f.entries) == 1
    m.scale = 3.0
    _same(f, m, x)
    assert len(f.entries) == 2
    m.scale = 2                     # int, not float: type-exact
    _same(f, m, x)
    assert len(f.entries) == 3
    assert "scale" in f.entries[-1].reason


def test_keyed_reads_and_swapped_children_recompile():
    m, x = Scaled(), torch.randn(2, 3)
    f = aotgrad.jit(m)
    _same(f, m, x)
    m.cfg[7] = 0.25                 # a non-string key read by the generated check
    _same(f, m, x)
    assert len(f.entries) == 2
    m.fc = nn.Linear(3, 3)          # a swapped child: the children dict differs
    _same(f, m, x)
    assert len(f.entries) == 3


def test_replaced_parameter_of_the_same_count_then_a_new_one():
    m, x = Scaled(), torch.randn(2, 3)
    f = aotgrad.jit(m)
    _same(f, m, x)
    with torch.no_grad():
        m.fc.bias = nn.Parameter(torch.randn(3))    # same count: the parameter check refreshes
    _same(f, m, x)
    m.fc.register_parameter("extra", nn.Parameter(torch.ones(1)))   # one more: recompiles
    _same(f, m, x)
    assert len(f.entries) >= 2


def test_a_rebound_closure_cell_after_a_refresh_recompiles():
    k = 1.5

    def g(x):
        return x * k

    f, x = aotgrad.jit(g), torch.randn(3)
    _same(f, g, x)
    k = float("1.5")
    _same(f, g, x)
    assert len(f.entries) == 1
    k = -1.0
    _same(f, g, x)
    assert len(f.entries) == 2


TABLE = {}


class Optional(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        extra = getattr(self, "extra", None)        # absent from the instance's dict and the class's
        if extra is not None:
            y = y + extra
        shift = TABLE.get((1, 2))                   # a tuple key, absent from a global dict
        return y if shift is None else y * shift


def test_names_that_were_absent_and_are_defined_later_recompile():
    """The absent names of one generated check (one ``key not in dict`` per read): an instance
    attribute, a class attribute, a global dict's tuple key and an instance ``forward``, each
    defined after the first call."""
    m, x = Optional(), torch.randn(2, 3)
    f = aotgrad.jit(m)
    _same(f, m, x)
    m.extra = 1.5
    _same(f, m, x)
    assert len(f.entries) == 2 and "extra" in f.entries[-1].reason
    del m.extra
    Optional.extra = -2.0
    try:
        _same(f, m, x)
        assert len(f.entries) == 3 and "extra" in f.entries[-1].reason
    finally:
        del Optional.extra
    TABLE[(1, 2)] = 3.0
    try:
        _same(f, m, x)
        assert len(f.entries) == 4 and "(1, 2)" in f.entries[-1].reason
    finally:
        TABLE.clear()
    m.forward = lambda x: m.fc(x) * 0
    _same(f, m, x)
    assert len(f.entries) == 5 and "forward" in f.entries[-1].reason
