"""The eager backend's generated code (aotgrad.runtime.codegen): a call whose result only indexing
reads is unpacked in one line; every other shape of use keeps a line per item. Each case compares
the generated function with the graph's own FX code, bit for bit."""
import operator
import re

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import aotgrad
from aotgrad.runtime import codegen

aten = torch.ops.aten


def _both(fn, *args):
    gm = make_fx(fn)(*args)
    gen = codegen.python_function(gm, "forward")
    want, got = gm(*args), gen(*args)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got)), gen.source
    return gen.source


def test_a_result_read_only_by_index_is_unpacked_in_one_line():
    def f(x, w, b):
        out, mean, rstd = aten.native_layer_norm(x, [4], w, b, 1e-5)
        return out * 2, rstd
    source = _both(f, torch.randn(3, 4), torch.randn(4), torch.randn(4))
    assert re.search(r"^\s+\w+, _, \w+ = _f\d+\(", source, re.M), source     # the mean, read by nothing
    assert re.search(r"del .*\b_$", source, re.M), source     # what nothing reads dies at once, not at the end
    assert "[0]" not in source and "[2]" not in source, source


def test_a_list_result_and_a_single_item():
    def f(x):
        a, b, c = torch.split(x, 2)
        (only,) = torch.unbind(x[:1])
        return a + c, only
    source = _both(f, torch.randn(6, 3))
    assert re.search(r"^\s+\w+, _, \w+ = _f\d+\(", source, re.M), source


def _split_graph(uses):
    """``split(x, 2)`` of a (4, 3) ``x``; ``uses(g, s)`` returns the graph's outputs."""
    g = fx.Graph()
    x = g.placeholder("x")
    s = g.call_function(aten.split.Tensor, (x, 2))
    s.meta["val"] = [torch.empty(2, 3), torch.empty(2, 3)]
    g.output(uses(g, s))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gen = codegen.python_function(gm, "forward")
    t = torch.randn(4, 3)
    want, got = gm(t), gen(t)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(want), pytree.tree_leaves(got))), gen.source
    return gen.source


def test_other_uses_keep_a_line_per_item():
    """A result also read whole, or one item read by two index nodes, is not unpacked."""
    def twice(g, s):
        first, again = (g.call_function(operator.getitem, (s, 0)) for _ in range(2))
        return (g.call_function(aten.add.Tensor, (first, again)),)
    assert len(re.findall(r"\[0\]", _split_graph(twice))) == 2

    def whole(g, s):
        return (g.call_function(operator.getitem, (s, 1)), s)
    assert re.search(r"^\s+\w+ = \w+\[1\]", _split_graph(whole), re.M)


@pytest.mark.parametrize("boxed", [False, True])
def test_a_failing_unpacked_call_names_its_operator(boxed):
    def f(x, idx):
        vals, where = torch.ops.aten.max.dim(x.gather(0, idx), 1)
        return vals, where
    x, idx = torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.long)
    gm = make_fx(f)(x, idx)
    gen = codegen.python_function(gm, "forward", boxed=boxed)
    run = (lambda *a: gen(list(a))) if boxed else gen
    assert all(torch.equal(a, b) for a, b in zip(run(x, idx), gm(x, idx)))
    with pytest.raises(aotgrad.errors.OpError, match="gather"):
        run(x, idx + 9)


def test_an_item_read_inside_a_compiled_block_keeps_its_call_named():
    """Two equal runs (one function for both, ``runtime.regions``) that each begin by indexing the result
    of a call before them: the region reads the call by its name, so that call is not unpacked."""
    from aotgrad.runtime import regions
    g = fx.Graph()
    x = g.placeholder("x")
    h = x
    for k in range(2):
        s = g.call_function(aten.split.Tensor, (h, 2))
        s.meta["val"] = [torch.empty(2, 3), torch.empty(2, 3)]
        nodes = [g.call_function(operator.getitem, (s, 0))]
        for op, extra in ((aten.mul.Tensor, 2.0), (aten.tanh.default, None), (aten.add.Tensor, 1.0)):
            nodes.append(g.call_function(op, (nodes[-1],) + ((extra,) if extra is not None else ())))
        for n in nodes:
            n.meta[regions.TAG] = (5, "fw", k)
            n.meta["val"] = torch.empty(2, 3)
        h = g.call_function(aten.cat.default, ([nodes[-1], nodes[-1]],))
    g.output((h,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gen = codegen.python_function(gm, "forward")
    assert "_block" in gen.source, gen.source          # the runs are one compiled block
    t = torch.randn(4, 3)
    assert torch.equal(gen(t)[0], gm(t)[0]), gen.source
