"""Shortcuts aotgrad takes past torch's generic paths give exactly torch's answers."""
import gc
import threading

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from aotgrad import _torch
from aotgrad.capture import session as S
from aotgrad.scoped import GC_PAUSED


def _graph():
    def f(x, w):
        y = torch.nn.functional.linear(x, w).relu()
        return y.sum(dim=[0], keepdim=True) + y.new_zeros(3).sum(), x.view(-1)
    return make_fx(f)(torch.randn(2, 3), torch.randn(3, 3)).graph


def test_copy_node_copies_like_node_copy():
    src = _graph()
    copies = []
    for copy in (lambda g, n, t: g.node_copy(n, t), _torch.copy_node):
        g, env = fx.Graph(), {}
        for n in src.nodes:
            if n.op != "output":
                env[n] = copy(g, n, env.__getitem__)
        g.output(fx.node.map_arg(src.output_node().args[0], env.__getitem__))
        g.lint()
        copies.append(g)
    fast, plain = copies
    assert str(fast) == str(plain) and fast.python_code("self").src == plain.python_code("self").src
    for a, b in zip(fast.nodes, plain.nodes):
        assert (a.name, a.op, a.target, a.type) == (b.name, b.op, b.target, b.type)
        assert a.meta == b.meta and a.meta is not b.meta
    assert len(fast.nodes) == len(plain.nodes) and list(fast.find_nodes(op="placeholder")) == list(fast.nodes)[:2]


def test_copy_graph_keeps_the_names_a_graph_already_uses():
    src = _graph()
    g = fx.Graph()
    x = g.placeholder("relu")       # taken: the copy's relu gets another name
    out = _torch.copy_graph(g, src, {})
    g.output(out)
    g.lint()
    names = [n.name for n in g.nodes]
    assert len(set(names)) == len(names) and x.name == "relu"


def test_device_of_wrapped_fakes_is_the_fake_modes_answer():
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:
        p = torch.nn.Parameter(torch.empty(4, 4))
        m = torch.empty(2, device="meta")
    with mode, S.functional_mode():
        f, fm = S.to_functional(p), S.to_functional(m)
        assert f.device == p.device == torch.device("cpu") and fm.device.type == "meta"
        assert (f * 2).device == torch.device("cpu")
    assert S._device(p) == torch.device("cpu")
    with mode:
        with torch._subclasses.fake_tensor.in_kernel_invocation_manager(mode):
            assert S._device(p) == torch.device("meta") == p.device
    assert S._device(torch.randn(2)) is None        # not a fake: torch's own path answers


def test_gc_pause_restores_the_collector_in_any_interleaving():
    assert gc.isenabled()
    started, release = threading.Event(), threading.Event()

    def other():
        with GC_PAUSED():
            started.set()
            release.wait(10)
    t = threading.Thread(target=other)
    t.start()
    started.wait(10)
    with GC_PAUSED():
        assert not gc.isenabled()
    assert not gc.isenabled()       # the other thread still holds it
    release.set()
    t.join(10)
    assert gc.isenabled()
    gc.disable()
    try:                            # a collector the user turned off stays off
        with GC_PAUSED():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x).relu() * 2


def _anchored(m, x):
    h = m(x)
    return (h + x).sum()       # a plain function's own line: kept through its anchor


def _stack_traces(cheap: bool) -> list:
    m = _Inner()
    _torch.register_stack_trace_anchor(_anchored)

    def f(x):
        if cheap:
            _torch.user_stack_traces()
        return _anchored(m, x)
    gm = make_fx(f, record_stack_traces=True)(torch.randn(2, 3))
    return [(n.name, n.meta.get("stack_trace")) for n in gm.graph.nodes]


def test_user_stack_traces_are_the_ones_fx_records():
    """The joint trace's cheap stack traces are fx's forward-only ones, text for text (a torch that
    formats or filters them otherwise fails here, not in a user's error message). fx is told of the
    anchor only for this comparison (aotgrad keeps its anchors to its own traces)."""
    cheap = _stack_traces(True)
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if register is not None:        # torch 2.11 has no anchors: fx would drop the plain function's frames
        register(_anchored)
        plain = _stack_traces(False)
        torch.fx.proxy._STACK_TRACE_ANCHORS.discard((_anchored.__code__.co_filename, "_anchored"))
        assert cheap == plain
    traced = [t for _, t in cheap if t]
    assert any("in forward" in t and "self.fc(x).relu()" in t for t in traced)
    assert any("in _anchored" in t and "(h + x).sum()" in t for t in traced)


def _cell(source: str):
    """A function defined by running ``source`` as a notebook cell: every run the same file name."""
    import linecache
    linecache.cache["<cell>"] = (len(source), None, source.splitlines(keepends=True), "<cell>")
    ns = {"torch": torch}
    exec(compile(source, "<cell>", "exec"), ns)
    return ns["step"]


def _traces(fn, m) -> list:
    def f(x):
        _torch.user_stack_traces()
        return fn(m, x)
    gm = make_fx(f, record_stack_traces=True)(torch.randn(2, 3))
    return [n.meta.get("stack_trace") or "" for n in gm.graph.nodes]


def test_cheap_stack_traces_follow_a_later_anchor_and_code_defined_again():
    """Which frames a stack trace keeps, and its text, are found once per code object and reused: a
    function anchored after it was traced gets its line from then on, and a cell run again with other
    lines (the same file and function name) names its new lines, not the first run's."""
    m = _Inner()
    first = _cell("def step(m, x):\n    return (m(x) * 3).sum()\n")
    assert not any("in step" in t for t in _traces(first, m))      # not anchored: only forward's frames
    _torch.register_stack_trace_anchor(first)
    assert any("in step" in t and "(m(x) * 3).sum()" in t for t in _traces(first, m))
    again = _cell("def step(m, x):\n    h = m(x)\n    return (h - 1).mean()\n")
    _torch.register_stack_trace_anchor(again)
    traced = _traces(again, m)
    assert any('"<cell>", line 3, in step' in t and "(h - 1).mean()" in t for t in traced)
    assert not any("(m(x) * 3).sum()" in t for t in traced)
