"""``passes/input_writes.writes_in_graph(early=True)`` (the eager backend's in-graph input writes) on
hand-made graphs, as a user edit of the joint could leave them: a write never runs before a node
that reads its input's old value, directly or through a view (found by operator schema, which a
graph loaded from disk still has), and runs right after its value otherwise."""
import operator
from types import SimpleNamespace

import torch
import torch.fx as fx

from aotgrad.ir.records import InputInfo
from aotgrad.passes.input_writes import writes_in_graph

aten = torch.ops.aten


def _written(n_inputs, written):
    return SimpleNamespace(inputs=tuple(InputInfo(False, i in written, False, False, None) for i in range(n_inputs)))


def _graph(build):
    """A GraphModule from ``build(graph, x, y) -> outputs`` (mutated input values first), with fake-free
    example metadata on the placeholders (what ``writes_in_graph`` compares)."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    for p in (x, y):
        p.meta["val"] = torch.empty(3, 3)
    outs = build(g, x, y)
    for n in g.nodes:
        if n.op == "call_function" and "val" not in n.meta:
            n.meta["val"] = torch.empty(3, 3)
    g.output(list(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _order(gm):
    return [getattr(n.target, "_opname", n.name) for n in gm.graph.nodes if n.op == "call_function"]


def _run(gm, x, y):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in gm(x, y)]


def test_write_waits_for_a_view_read_after_its_value():
    def build(g, x, y):
        new = g.call_function(aten.add.Tensor, (x, y))         # x's new value, computed first
        v = g.call_function(aten.t.default, (x,))             # a view of the old x ...
        s = g.call_function(aten.mm.default, (v, y))          # ... read after the new value exists
        return [new, s]
    gm = writes_in_graph(_graph(build), _written(2, {0}), early=True)
    assert _order(gm) == ["add", "t", "mm", "copy_"]
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    expected = (x.t() @ y, x + y)
    xs = x.clone()
    got = _run(gm, xs, y)
    assert torch.equal(got[1], expected[0]) and torch.equal(xs, expected[1])


def test_write_waits_for_a_view_through_getitem():
    def build(g, x, y):
        new = g.call_function(aten.mul.Tensor, (x, 2.0))
        parts = g.call_function(aten.split.Tensor, (x, 1))
        row = g.call_function(operator.getitem, (parts, 0))
        parts.meta["val"] = [torch.empty(1, 3)] * 3
        row.meta["val"] = torch.empty(1, 3)
        s = g.call_function(aten.sum.default, (row,))
        s.meta["val"] = torch.empty(())
        return [new, s]
    gm = writes_in_graph(_graph(build), _written(2, {0}), early=True)
    assert _order(gm).index("copy_") > _order(gm).index("sum")
    x = torch.randn(3, 3)
    xs = x.clone()
    got = _run(gm, xs, torch.zeros(3, 3))
    assert torch.equal(got[1], x[0].sum()) and torch.equal(xs, x * 2)


def test_write_runs_right_after_its_value_when_nothing_reads_the_old_one():
    def build(g, x, y):
        new = g.call_function(aten.add.Tensor, (x, 1.0))      # reads x: before the write
        later = g.call_function(aten.mul.Tensor, (y, y))      # reads only y
        return [new, later]
    gm = writes_in_graph(_graph(build), _written(2, {0}), early=True)
    assert _order(gm) == ["add", "copy_", "mul"]
    gm_late = writes_in_graph(_graph(build), _written(2, {0}))
    assert _order(gm_late) == ["add", "mul", "copy_"]        # Inductor's: at the end


def test_a_target_without_a_schema_counts_as_a_view():
    def build(g, x, y):
        new = g.call_function(aten.add.Tensor, (x, y))
        same = g.call_function(lambda t: t, (x,))             # may return x itself
        s = g.call_function(aten.sum.default, (same,))
        s.meta["val"] = torch.empty(())
        return [new, s]
    gm = writes_in_graph(_graph(build), _written(2, {0}), early=True)
    names = _order(gm)
    assert names.index("copy_") > names.index("sum")


def _foreach_graph(second_other):
    """``zs = _foreach_add(_foreach_mul([x, y], 2), second_other(x, y))``, written back into x and y."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    for p in (x, y):
        p.meta["val"] = torch.empty(3)
    ys = g.call_function(aten._foreach_mul.Scalar, ([x, y], 2.0))
    y0, y1 = (g.call_function(operator.getitem, (ys, i)) for i in range(2))
    zs = g.call_function(aten._foreach_add.List, ([y0, y1], second_other(x, y, y0, y1)))
    z0, z1 = (g.call_function(operator.getitem, (zs, i)) for i in range(2))
    for n in (y0, y1, z0, z1):
        n.meta["val"] = torch.empty(3)
    g.output([z0, z1])
    return fx.GraphModule(torch.nn.Module(), g)


def test_foreach_chain_runs_in_place_on_the_written_inputs():
    gm = writes_in_graph(_foreach_graph(lambda x, y, y0, y1: [y0, y1]), _written(2, {0, 1}), early=True)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten._foreach_mul_.Scalar in targets and aten._foreach_add_.List in targets
    assert aten.copy_.default not in targets
    x, y = torch.randn(3), torch.randn(3)
    xs, ys = x.clone(), y.clone()
    gm(xs, ys)
    assert torch.equal(xs, x * 2 + x * 2) and torch.equal(ys, y * 2 + y * 2)


def test_foreach_reading_another_index_of_its_written_list_stays_functional():
    """The second op reads element 0 of the list it would overwrite as its element 1 (and x's old
    value as its element 0): in place, element 1 would read element 0's new value."""
    gm = writes_in_graph(_foreach_graph(lambda x, y, y0, y1: [y1, y0]), _written(2, {0, 1}), early=True)
    assert aten._foreach_add.List in [n.target for n in gm.graph.nodes]    # [y1, y0]: crossed indices
    x, y = torch.randn(3), torch.randn(3)
    xs, ys = x.clone(), y.clone()
    gm(xs, ys)
    assert torch.equal(xs, x * 2 + y * 2) and torch.equal(ys, y * 2 + x * 2)
