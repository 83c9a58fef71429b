"""``passes.views.fold_views``: view chains that end laid out as they began run as their first value.

Each program folds something (asserted, so the family exercises the pass) and must match eager
through ``eager_check`` on every entry point, and match the same program compiled with the pass
off bit for bit: folded views returned (a view of the same base), written in place through,
aliased with an input, non-contiguous and channels_last inputs, symbolic sizes, double backward.
Hand-made graphs pin what must not fold."""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import aotgrad
import importlib

import aotgrad.compile as compile_module
from aotgrad.passes.views import fold_views
from tests.eager_check import check

aten = torch.ops.aten


def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.linear(x, w1, b1).relu(), w2, b2).sum()


def _returned(x, w):
    v = x.t().t()                           # returned: stays a view of x
    return v, (v @ w).tanh()


def _returned_intermediate(x, w):
    y = (x @ w).sin()
    return y, y.t().t(), y.t().t().cos()   # the second stays a view of the first; the third reads y


def _written_through(x, w):
    y = x * w
    v = y.t().t()
    v.mul_(2)                               # writes y through the view that would fold
    return (y @ w.t()).sum(), v


def _input_write(x, w):
    x.t().t().add_(1)                       # writes the input through a folded chain
    return (x.t().t() * w).sum()


def _same_shape(x, w):
    v = x.view(x.shape).expand(x.shape).unsqueeze(0).squeeze(0)
    return (v * w).t().t().sum(dim=0)


def _channels_last(x, w):
    y = x * w
    z = y.permute(0, 2, 3, 1).permute(0, 3, 1, 2)
    return z.relu(), z.sum()


def _shared(a, b, c):
    # both gradients are t(t(g * c)): one may become g * c, the other stays its own tensor
    return ((a.t().t() + b.t().t()) * c).sum()


def _complex(z, w):
    # conj() is a view laid out as its input: only its conjugate bit tells them apart
    return (z * w).abs().sum(), z.conj().t().t() * 2, z.conj().conj().t().t().real


def _dynamic(x, w):
    return (x.view(x.shape[0], -1).t().t() @ w).tanh().sum()


def _rand(*shape, grad=True, **kw):
    return torch.randn(*shape, **kw).requires_grad_(grad)


PROGRAMS = {
    "mlp": (_mlp, lambda: (_rand(4, 6, grad=False), _rand(5, 6), _rand(5), _rand(3, 5), _rand(3))),
    "returned": (_returned, lambda: (_rand(4, 4), _rand(4, 3))),
    "returned_intermediate": (_returned_intermediate, lambda: (_rand(4, 4), _rand(4, 3))),
    "written_through": (_written_through, lambda: (_rand(4, 4), _rand(4, 4))),
    "input_write": (_input_write, lambda: (_rand(4, 3, grad=False), _rand(4, 3))),
    "same_shape": (_same_shape, lambda: (_rand(4, 3), _rand(4, 3))),
    "non_contiguous": (_same_shape, lambda: (_rand(3, 4).t(), _rand(4, 3))),
    "channels_last": (_channels_last, lambda: (_rand(2, 3, 4, 5).to(memory_format=torch.channels_last),
                                               _rand(1, 3, 1, 1))),
    "shared_gradient": (_shared, lambda: (_rand(3, 4), _rand(3, 4), _rand(3, 4))),
    "complex": (_complex, lambda: (_rand(4, 3, dtype=torch.complex64), _rand(4, 3, dtype=torch.complex64))),
    "dynamic": (_dynamic, lambda: (_rand(4, 3), _rand(3, 2))),
}
DYNAMIC = {"dynamic"}


def _leafy(args):
    """Fresh leaves (a transposed input made by ``.t()`` of a leaf stays a non-leaf view)."""
    return tuple(a.detach().requires_grad_(a.requires_grad) if a.is_leaf else a for a in args)


def _entry(entry, dynamic):
    if entry == "capture":
        return lambda fn, args, kwargs, **o: aotgrad.capture(fn, *args, dynamic=dynamic).compile(**o)
    if entry == "jit":
        return lambda fn, args, kwargs, **o: aotgrad.jit(fn, dynamic=dynamic, **o)

    def dynamo(fn, args, kwargs, **o):
        torch._dynamo.reset()
        return torch.compile(fn, backend="aotgrad", dynamic=dynamic)
    return dynamo


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_program_folds_something(name):
    fn, make = PROGRAMS[name]
    captured = aotgrad.capture(fn, *make(), dynamic=name in DYNAMIC)
    # The capture folds its fresh joint in place (the compile's fold then finds nothing to copy).
    simplify = next(s for s in captured.history if s.name == "simplify")
    assert simplify.info["views folded"] > 0, "nothing folded: the case does not exercise the pass"
    assert fold_views(captured.joint, captured.layout.n_fw) is captured.joint   # not folded twice
    with _fold_off():
        unfolded = aotgrad.capture(fn, *make(), dynamic=name in DYNAMIC)
    folded = fold_views(unfolded.joint, unfolded.layout.n_fw)
    assert folded is not unfolded.joint and len(folded.graph.nodes) < len(unfolded.joint.graph.nodes)
    assert len(folded.graph.nodes) == len(captured.joint.graph.nodes)


@pytest.mark.parametrize("entry", ["capture", "jit", "dynamo"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_matches_eager(name, entry):
    fn, make = PROGRAMS[name]
    check(fn, make=lambda: (fn, make(), {}), compile=_entry(entry, name in DYNAMIC), calls=2 if entry == "jit" else 1)


@pytest.mark.parametrize("name", ["mlp", "returned", "same_shape", "channels_last"])
def test_double_backward_matches_eager(name):
    fn, make = PROGRAMS[name]
    check(fn, make=lambda: (fn, make(), {}), double_backward=True)


def test_dynamic_sizes_fold_and_match_eager_at_another_size():
    compiled = aotgrad.capture(_dynamic, _rand(4, 3), _rand(3, 2), dynamic=True).compile()
    for rows in (4, 7):
        x, w = _rand(rows, 3), _rand(3, 2)
        xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        compiled(x, w).backward()
        _dynamic(xe, we).backward()
        assert torch.allclose(x.grad, xe.grad) and torch.allclose(w.grad, we.grad)


@contextlib.contextmanager
def _fold_off():
    """The pass turned off: at capture (in place) and at compile."""
    capture_module = importlib.import_module("aotgrad.capture.capture")
    real = compile_module.fold_views, capture_module.fold_views_owned
    compile_module.fold_views, capture_module.fold_views_owned = (lambda joint, n_fw: joint), (lambda joint, n_fw: 0)
    try:
        yield
    finally:
        compile_module.fold_views, capture_module.fold_views_owned = real


def _compiled(fn, args, fold: bool, **opts):
    with _fold_off() if not fold else contextlib.nullcontext():
        return aotgrad.capture(fn, *args).compile(**opts)


def _run(compiled, args):
    out = compiled(*args)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    sum(o.float().sum() for o in outs if o.requires_grad).backward()
    return [o.detach().clone() for o in outs], [a.grad for a in args if a.is_leaf and a.requires_grad], outs


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - DYNAMIC))
def test_bitwise_like_the_pass_turned_off(name):
    fn, make = PROGRAMS[name]
    torch.manual_seed(0)
    args = make()
    runs = []
    for fold in (False, True):
        a = _leafy(args) if name != "non_contiguous" else (args[0].detach().t().t().requires_grad_(), args[1])
        a = tuple(t.detach().clone().requires_grad_(t.requires_grad) if t.is_leaf else t for t in a)
        runs.append((_run(_compiled(fn, a, fold), a), a))
    ((outs0, grads0, raw0), a0), ((outs1, grads1, raw1), a1) = runs
    for x, y in zip(outs0 + grads0 + list(a0), outs1 + grads1 + list(a1)):
        assert x.stride() == y.stride() and torch.equal(x, y)
    for o0, o1 in zip(raw0, raw1):     # a returned view stays a view of the same input
        assert o0._is_view() == o1._is_view()
        assert [o0._base is t for t in a0 + tuple(raw0)] == [o1._base is t for t in a1 + tuple(raw1)]
        assert [o0 is t for t in raw0] == [o1 is t for t in raw1]


def _saved(c) -> list:
    """The forward's nodes for the values it saves (one tangent follows them in the backward's inputs)."""
    n = len(c.backward_graph.graph.find_nodes(op="placeholder")) - 1
    return list(c.forward_graph.graph.output_node().args[0][-n:])


def _transposes_of_transposes(c) -> int:
    """``t(t(..))`` pairs in the backward, counting a ``t`` of a saved value the forward made by ``t``."""
    saved = _saved(c)
    bw_in = c.backward_graph.graph.find_nodes(op="placeholder")
    made_by_t = {p for p, v in zip(bw_in, saved) if v.target is aten.t.default}
    return sum(1 for n in c.backward_graph.graph.nodes if n.target is aten.t.default
               and (n.args[0] in made_by_t or getattr(n.args[0], "target", None) is aten.t.default))


def test_mlp_backward_drops_the_transpose_pairs_and_saves_weights():
    torch.manual_seed(0)
    args = PROGRAMS["mlp"][1]()
    off, on = _compiled(_mlp, args, False), _compiled(_mlp, args, True)
    assert _transposes_of_transposes(off) == 3      # t(t(w2)) for the input gradient, t(t(mm)) per weight
    assert _transposes_of_transposes(on) == 0
    assert [v.target for v in _saved(off)].count(aten.t.default) == 1      # t(w2)
    assert [v.op for v in _saved(on)].count("placeholder") == 2             # x and w2 itself


def test_inductor_matches_eager():
    pytest.importorskip("torch._inductor")
    fn, make = PROGRAMS["mlp"]
    check(fn, make=lambda: (fn, make(), {}), fw_compiler="inductor")


# --- hand-made graphs: what must not fold

def _graph(build, n_fw, shape=(3, 3)):
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(*shape)
    outs = build(g, x)
    for n in g.nodes:
        if n.op == "call_function" and "val" not in n.meta:
            n.meta["val"] = n.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args])
    g.output(list(outs))
    return fx.GraphModule(torch.nn.Module(), g), n_fw


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_forward_output_stays_its_view():
    def build(g, x):
        tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (x,)),))
        return [tt, g.call_function(aten.sin.default, (tt,))]
    gm, n_fw = _graph(build, 2)
    out = fold_views(gm, n_fw)
    tt, sin = out.graph.output_node().args[0]
    assert tt.target is aten.t.default and sin.args[0].op == "placeholder"


def test_a_gradient_never_becomes_a_placeholder_or_another_output():
    def build(g, x):
        s = g.call_function(aten.sin.default, (x,))
        g1 = g.call_function(aten.t.default, (g.call_function(aten.t.default, (s,)),))
        g2 = g.call_function(aten.t.default, (g.call_function(aten.t.default, (s,)),))
        g3 = g.call_function(aten.t.default, (g.call_function(aten.t.default, (x,)),))
        return [s, g1, g2, g3]
    gm, _ = _graph(build, 0)
    outs = fold_views(gm, 0).graph.output_node().args[0]
    assert outs[0].target is aten.sin.default           # s is returned already: g1 and g2 keep their views
    assert outs[1].target is aten.t.default and outs[2].target is aten.t.default and outs[1] is not outs[2]
    assert outs[3].target is aten.t.default             # not the placeholder
    gm, _ = _graph(lambda g, x: build(g, x)[1:], 0)     # s not returned: one gradient takes it
    outs = fold_views(gm, 0).graph.output_node().args[0]
    assert [o.target for o in outs] == [aten.sin.default, aten.t.default, aten.t.default]


def test_a_written_family_does_not_fold():
    def build(g, x):
        y = g.call_function(aten.cos.default, (x,))
        tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (y,)),))
        s = g.call_function(aten.sin.default, (tt,))
        g.call_function(aten.add_.Tensor, (g.call_function(aten.t.default, (y,)), 1))
        return [s]
    gm, n_fw = _graph(build, 1)
    assert fold_views(gm, n_fw) is gm


def test_as_strided_and_size_changes_do_not_fold():
    def build(g, x):
        a = g.call_function(aten.as_strided.default, (x, [3, 3], [3, 1]))
        v = g.call_function(aten.view.default, (x, [9]))
        e = g.call_function(aten.expand.default, (g.call_function(aten.unsqueeze.default, (x, 0)), [2, 3, 3]))
        return [g.call_function(aten.sin.default, (a,)), g.call_function(aten.sin.default, (v,)),
                g.call_function(aten.sin.default, (e,))]
    gm, n_fw = _graph(build, 3)
    assert fold_views(gm, n_fw) is gm


def test_a_use_by_a_side_effect_or_block_call_keeps_the_view():
    def build(g, x):
        tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (x,)),))
        g.call_function(aten._assert_async.msg, (tt, "m")).meta["val"] = None     # no result: a check
        return [g.call_function(aten.cos.default, (tt,)), g.call_function(torch.sin, (tt,))]   # not an ATen overload
    gm, n_fw = _graph(build, 2)
    out = fold_views(gm, n_fw)
    cos, sin = out.graph.output_node().args[0]
    assert cos.args[0].op == "placeholder"
    assert sin.args[0].target is aten.t.default
    assert next(iter(out.graph.find_nodes(op="call_function", target=aten._assert_async.msg))).args[0] is sin.args[0]


def test_symbolic_sizes_fold_only_when_the_expressions_are_identical():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(4, 3), symbolic_context=ctx)
    y = mode.from_tensor(torch.empty(4, 3), symbolic_context=ctx)     # another symbol, 4 in the example too
    assert isinstance(x.shape[0], torch.SymInt) and str(x.shape[0]) != str(y.shape[0])
    folded = []
    for val in (x, y):
        g = fx.Graph()
        p = g.placeholder("x")
        p.meta["val"] = x
        v = g.call_function(aten.view.default, (p, [-1, 3]))
        v.meta["val"] = val
        s1 = g.call_function(aten.sin.default, (v,))
        s1.meta["val"] = val
        g.output([s1])
        gm = fx.GraphModule(torch.nn.Module(), g)
        folded.append(fold_views(gm, 1) is not gm)
    assert folded == [True, False]
