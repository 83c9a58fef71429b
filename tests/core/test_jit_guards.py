"""aotgrad.jit guards the Python state its trace read: each case changes some state
after the first call and expects eager's result (a recompile, named in explain) or
a typed error. Programs differ from the issue's repros on purpose."""
import math
import re
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad import errors
from tests.eager_check import check

OFFSET = 1.5
LAYERS = {"act": torch.tanh}


def _same(jitted, eager, *args, grads=()):
    """Call both on the same live state; outputs (and the grads of ``grads``) must match."""
    for t in grads:
        t.grad = None
    out = jitted(*args)
    got = [t.grad for t in grads] if not grads else None
    if grads:
        out.sum().backward()
        got = [t.grad.clone() for t in grads]
        for t in grads:
            t.grad = None
    ref = eager(*args)
    torch.testing.assert_close(out, ref)
    if grads:
        ref.sum().backward()
        for g, t in zip(got, grads):
            torch.testing.assert_close(g, t.grad)
    return out


def _reasons(f):
    return [e.reason for e in f.entries]


def shifted(x):
    return _helper(x) * 2


def _helper(x):
    return x + OFFSET          # read one call down: the guard must follow the call


def test_global_read_by_a_called_helper_recompiles():
    global OFFSET
    f = aotgrad.jit(shifted)
    x = torch.randn(3)
    _same(f, shifted, x)
    OFFSET = -4.0
    try:
        _same(f, shifted, x)
    finally:
        OFFSET = 1.5
    assert "`OFFSET` was 1.5 when captured, now -4.0" in aotgrad.explain(f)


_CHOSEN: list = []


def test_another_object_with_the_same_description_is_named_as_such():
    """A global list holding one of two modules, refilled with the other: both are "a list object",
    so the reason says that it is not equal to what it was, rather than "was X, now X"."""
    a, b = torch.nn.Identity(), torch.nn.Identity()

    def pick(x):
        return x * 2 if _CHOSEN[0] is a else x * 3
    f = aotgrad.jit(pick)
    x = torch.randn(3)
    _CHOSEN[:] = [a]
    _same(f, pick, x)
    _CHOSEN[:] = [b]
    _same(f, pick, x)
    reason = _reasons(f)[1]
    assert "is not equal to what it was when captured" in reason or "is not the object it was" in reason, reason


def test_rebound_closure_cell_recompiles():
    power = 2

    def f(x):
        return x ** power
    g = aotgrad.jit(f)
    x = torch.randn(4)
    _same(g, f, x)
    power = 3
    _same(g, f, x)
    assert "`power` was 2 when captured, now 3" in _reasons(g)[1]


def test_dict_of_functions_in_a_global_recompiles_when_an_entry_changes():
    def f(x):
        return LAYERS["act"](x)
    g = aotgrad.jit(f)
    x = torch.randn(4)
    _same(g, f, x)
    LAYERS["act"] = torch.sigmoid
    try:
        _same(g, f, x)
    finally:
        LAYERS["act"] = torch.tanh
    assert len(g.entries) == 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.3))
        self.head = nn.Linear(6, 2)
        self._gain = 1.0

    def forward(self, x):
        return self.head(self.body(x)) * self._gain


def test_module_state_changes_recompile_and_match_eager():
    torch.manual_seed(0)
    net = Net()
    f = aotgrad.jit(net)
    x = torch.randn(5, 4)
    f(x).sum().backward()
    net.eval()                               # dropout off, BatchNorm on running statistics
    before = net.body[1].running_mean.clone()
    _same(f, net, x)
    torch.testing.assert_close(net.body[1].running_mean, before)     # eval does not update them
    net._gain = 0.5                          # an underscore attribute the forward reads
    _same(f, net, x)
    net.head = nn.Linear(6, 2)               # a swapped submodule
    _same(f, net, x, grads=(net.head.weight,))
    reasons = " | ".join(_reasons(f)[1:])
    assert "`net.body.1.training` was True when captured, now False" in reasons
    assert "`net._gain` was 1.0 when captured, now 0.5" in reasons
    assert "`net.head` was Linear" in reasons


def test_forward_hook_added_later_recompiles_and_runs():
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    f = aotgrad.jit(net)
    x = torch.randn(2, 3)
    _same(f, net, x)
    net[0].register_forward_hook(lambda m, i, o: o * 10)
    _same(f, net, x)
    assert "_forward_hooks` had 0 entries when captured, now 1" in _reasons(f)[1]


def test_parameter_of_a_module_reached_through_a_closure_is_guarded():
    lin = nn.Linear(3, 3)

    def f(x):
        return lin(x).relu()
    g = aotgrad.jit(f)
    x = torch.randn(2, 3)
    with torch.no_grad():
        _same(g, f, x)
        lin.weight = nn.Parameter(torch.randn(3, 3))
        _same(g, f, x)
    assert "`lin.weight` is not the object it was when captured (now another Parameter" in _reasons(g)[1]


@dataclass
class Config:
    scale: float
    clamp: bool


CFG = Config(2.0, False)


def configured(x):
    y = x * CFG.scale
    return y.clamp(-1, 1) if CFG.clamp else y


def test_mutated_config_object_recompiles():
    f = aotgrad.jit(configured)
    x = torch.randn(6) * 3
    _same(f, configured, x)
    CFG.clamp = True
    try:
        _same(f, configured, x)
    finally:
        CFG.clamp = False
    assert "`CFG.clamp` was False when captured, now True" in _reasons(f)[1]


class Holder:
    def __init__(self, k):
        self.k = k


def test_object_argument_with_a_changed_attribute_recompiles():
    def f(x, h):
        return x * h.k
    g = aotgrad.jit(f)
    h = Holder(2)
    x = torch.arange(3)
    _same(g, f, x, h)
    h.k = 0.5
    _same(g, f, x, h)
    assert "`input 1.k` was 2 when captured, now 0.5" in _reasons(g)[1]


def test_object_argument_holding_a_tensor_is_refused():
    with pytest.raises(errors.UnsupportedError, match="Holder holding tensors"):
        aotgrad.jit(lambda x, h: x @ h.k)(torch.randn(2, 3), Holder(torch.randn(3, 2)))


HELPERS = types.ModuleType("aotgrad_test_helpers")     # an imported user module, as the trace sees one
HELPERS.GAIN, HELPERS.act = 3.0, torch.relu


def through_helpers(x):
    return HELPERS.act(x) * HELPERS.GAIN


def test_user_module_attributes_read_through_an_import():
    g = aotgrad.jit(through_helpers)
    x = torch.randn(5)
    _same(g, through_helpers, x)
    try:
        HELPERS.act = torch.sigmoid
        _same(g, through_helpers, x)
        HELPERS.GAIN = 3           # same value, another type
        _same(g, through_helpers, x)
    finally:
        HELPERS.GAIN, HELPERS.act = 3.0, torch.relu
    assert "`HELPERS.act` was torch" in _reasons(g)[1] and "`HELPERS.GAIN`" in _reasons(g)[2]


def test_code_made_by_exec_is_guarded_too():
    scope = {"K": 2.0, "__name__": "user_script"}
    exec("def f(x):\n    return x * K\n", scope)
    g = aotgrad.jit(scope["f"])
    x = torch.randn(3)
    _same(g, scope["f"], x)
    scope["K"] = 5.0
    _same(g, scope["f"], x)


def test_autocast_dtype_is_a_mode():
    lin = nn.Linear(4, 4)
    f = aotgrad.jit(lin)
    x = torch.randn(2, 4)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            out = f(x)
            assert out.dtype == lin(x).dtype == dtype
    assert "CPU autocast dtype was torch.bfloat16, now torch.float16" in _reasons(f)[1]


class _Doubling(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.relu else out


def test_a_torch_function_mode_entered_around_the_call_is_a_mode():
    """A ``TorchFunctionMode`` (or ``torch.device(...)`` as a context) changes what torch's functions do:
    its effect on the trace is in the graph. jit recompiles under it, and again without it; the staged
    step refuses a call under other modes (a stale graph before: the mode was ignored)."""
    def f(x):
        return torch.relu(x) + 1
    g = aotgrad.jit(f)
    x = torch.tensor([1.0, -2.0])
    staged = aotgrad.capture(f, x).compile()
    _same(g, f, x)
    for enter in (_Doubling, lambda: torch.device("cpu"), _Doubling):
        with enter():
            _same(g, f, x)
            with pytest.raises(errors.InputMismatchError, match=r"torch function modes was \(\), now \('"):
                staged(x)
        _same(g, f, x)
    assert len(g.entries) == 3 and "_Doubling()" in _reasons(g)[1] and "DeviceContext(device=cpu" in _reasons(g)[2]
    torch.testing.assert_close(staged(x), f(x))


def test_assigning_python_state_in_the_trace_is_refused_and_undone():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x)
    m = Counter()
    with pytest.raises(errors.UnsupportedError, match="assigns `calls`"):
        aotgrad.jit(m)(torch.randn(1, 2))
    assert m.calls == 0


# ---- type-exact constants (item 2)

def test_int_float_bool_constants_are_distinct_entries():
    g = aotgrad.jit(lambda x, k: x * k)
    x = torch.arange(3)
    assert g(x, 2).dtype == torch.int64
    assert g(x, 2.0).dtype == torch.float32
    assert g(x, True).dtype == torch.int64
    assert len(g.entries) == 3
    assert "was 2 (int) when captured, now 2.0 (float)" in _reasons(g)[1]


def test_list_of_ints_and_list_of_floats_differ():
    def f(x, ks):
        return x * ks[0] + ks[1]
    g = aotgrad.jit(f)
    x = torch.arange(3)
    for ks in ([1, 2], [1.0, 2.0]):
        out = g(x, ks)
        assert out.dtype == f(x, ks).dtype
    assert len(g.entries) == 2


class _Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale, self.pair = scale, (1.0, scale)

    def forward(self, x):
        return x / self.scale + x / self.pair[1]


FLOAT_TWINS = [(0.0, -0.0), (-0.0, 0.0), (complex(0.0, 1.0), complex(-0.0, 1.0)), (1e-300, math.nextafter(1e-300, 1.0))]


@pytest.mark.parametrize("was,now", FLOAT_TWINS, ids=lambda v: repr(v))
def test_floats_are_guarded_bit_exactly(was, now):
    """``0.0`` and ``-0.0`` compare equal but divide differently: constants, attributes and floats
    inside containers are guarded by their bits (a NaN is the same as a NaN)."""
    x = torch.tensor([1.0, -2.0, 3.0])
    f = lambda x, eps: x / eps  # noqa: E731
    g = aotgrad.jit(f)
    assert torch.equal(g(x, was), f(x, was)) and torch.equal(g(x, now), f(x, now))
    step = aotgrad.capture(f, x, was).compile()
    if was.__repr__() != now.__repr__():
        with pytest.raises(errors.InputMismatchError, match=r"non-tensor argument args\[1\]"):
            step(x, now)
    m = _Scaled(was)
    gm = aotgrad.jit(m)
    gm(x)
    m.scale, m.pair = now, (1.0, now)
    assert torch.equal(gm(x), m(x)), "a module's float attribute changed sign without a recompile"
    captured = aotgrad.capture(m, x).compile()
    m.scale = was
    with pytest.raises(errors.InputMismatchError, match="scale"):
        captured(x)


def _triple(x):
    return x * 3


def test_code_replaced_in_place_recompiles():
    """Hot reload and monkeypatching in tests swap a function's ``__code__``: the same function
    object runs another program, so the code objects the trace ran are guarded by identity."""
    def helper(x):
        return x * 2

    def f(x):
        return helper(x) + 1
    x = torch.ones(2)
    g, step = aotgrad.jit(f), aotgrad.capture(f, x).compile()
    g(x)
    original = helper.__code__
    helper.__code__ = _triple.__code__
    assert torch.equal(g(x), f(x)) and len(g.entries) == 2
    assert "helper.__code__" in _reasons(g)[1]
    with pytest.raises(errors.InputMismatchError, match="helper.__code__"):
        step(x)
    helper.__code__ = original       # the first program again: its entry is used
    assert torch.equal(g(x), f(x)) and len(g.entries) == 2


class _Doubled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * 2


@pytest.mark.parametrize("change, named", [
    # A subclass that inherited ``forward`` is given one of its own: the class the trace found
    # ``forward`` in still holds the same function, a class before it in the MRO now shadows it.
    (lambda m: setattr(type(m), "forward", lambda self, x: self.fc(x) * 3), "Sub.forward"),
    # The instance is made another class's (a library converting modules in place).
    (lambda m: setattr(m, "__class__", type("Other", (_Doubled,), {"forward": lambda self, x: self.fc(x) * 4})),
     "type("),
    # A child module whose class changes: its own forward is read through the parent's call.
    (lambda m: setattr(m.fc, "__class__", type("Halved", (nn.Linear,), {"forward": lambda self, x: x / 2})),
     "type("),
], ids=["subclass_given_a_forward", "instance_class_swapped", "child_class_swapped"])
def test_which_forward_a_module_runs_is_guarded(change, named):
    def make():
        torch.manual_seed(0)
        return type("Sub", (_Doubled,), {})()
    model, captured, x = make(), make(), torch.randn(2, 3)
    g, step = aotgrad.jit(model), aotgrad.capture(captured, x).compile()
    g(x)
    change(model)
    change(captured)
    assert torch.equal(g(x), model(x)) and len(g.entries) == 2
    assert named in _reasons(g)[1]
    with pytest.raises(errors.InputMismatchError, match=re.escape(named)):
        step(x)


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x).tanh())


def test_untied_weight_recompiles():
    """A tied weight is one graph input (taken from its first place); untied after capture, the
    second place holds another tensor the graph would never read: its gradient would stay None."""
    def make():
        torch.manual_seed(0)
        return _TiedHead()
    model, eager, captured, x = make(), make(), make(), torch.randn(2, 3)
    g, step = aotgrad.jit(model), aotgrad.capture(captured, x).compile()
    g(x)
    for m in (model, eager, captured):
        m.head.weight = nn.Parameter(m.emb.weight.detach() * 2)
    _same(g, eager, x)
    out, ref = g(x), eager(x)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(out, ref) and len(g.entries) == 2 and "'head.weight' was tied to 'emb.weight'" in _reasons(g)[1]
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
    with pytest.raises(errors.InputMismatchError, match="'head.weight' was tied to 'emb.weight'"):
        step(x)


def _pick(a, b, c):
    """Which arguments are one object decides the path (``a is b``), as in nn.MultiheadAttention."""
    return a * (2.0 if a is b else 3.0) + c * (5.0 if b is c else 7.0)


@pytest.mark.parametrize("order", [("abb", "aaa", "abc"), ("aaa", "abc", "aab"), ("aab", "aba", "abb")])
def test_which_arguments_are_one_object_is_guarded(order):
    """One object passed in two places is one object in the trace (the graph's path for ``a is b``);
    a call passing other objects there, or one object where the capture had two, gets another graph
    (jit) or an InputMismatchError naming both places (a compiled step), never the first graph."""
    x, y, z = (torch.randn(3, requires_grad=True) for _ in range(3))
    pick = {"a": x, "b": y, "c": z}
    calls = [tuple(pick[k] for k in s) for s in order]
    g = aotgrad.jit(_pick)
    step = aotgrad.capture(_pick, *calls[0]).compile()
    for args in calls:
        _same(g, _pick, *args, grads=tuple({id(t): t for t in (args[0], args[2])}.values()))
    assert len(g.entries) == len(set(order)) and all("same tensor object" in w for w in _reasons(g)[1:])
    for args in calls[1:]:
        with pytest.raises(errors.InputMismatchError, match=r"args\[\d\] was (not )?the same tensor object as args"):
            step(*args)


def test_nan_constant_reuses_its_entry():
    g = aotgrad.jit(lambda x, k: x * k)
    x = torch.ones(2)
    for _ in range(3):
        g(x, float("nan"))
    assert len(g.entries) == 1


def test_number_replaced_by_a_tensor_gets_its_gradient():
    def f(x, k):
        return (x * k).sum()
    check(f, (torch.randn(3), torch.tensor(0.5, requires_grad=True)),
          compile=lambda fn, a, kw: aotgrad.jit(fn))
    g = aotgrad.jit(f)
    x = torch.randn(3)
    g(x, 0.5)
    k = torch.tensor(0.5, requires_grad=True)
    g(x, k).backward()
    torch.testing.assert_close(k.grad, x.sum())


# ---- API traps (item 5)

def test_jit_on_a_method():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        @aotgrad.jit
        def forward(self, x):
            return self.lin(x).tanh()
    b = Block()
    x = torch.randn(2, 3)
    out = b(x)
    out.sum().backward()
    ref = b.lin(x).tanh()
    torch.testing.assert_close(out, ref)
    assert b.lin.weight.grad is not None
    assert len(Block.forward.__get__(b).entries) == 1


@pytest.mark.parametrize("opts, hint", [({"backend": "inductor"}, "did you mean fw_compiler='inductor'"),
                                        ({"partitoner": "min_cut"}, "did you mean partitioner='min_cut'"),
                                        ({"fw_compiler": "inductr"}, "not a registered compiler")])
def test_unknown_options_are_refused_when_jit_is_called(opts, hint):
    with pytest.raises(errors.OptionError, match=hint):
        aotgrad.jit(nn.Linear(2, 2), **opts)


def test_jit_called_inside_capture_is_traced_through():
    inner = aotgrad.jit(lambda x: x.sin() * 2)

    def outer(x):
        return inner(x).cos().sum()
    x = torch.randn(4, requires_grad=True)
    inner(x)
    captured = aotgrad.capture(outer, x)
    assert len(inner.entries) == 1           # the capture traced through it, compiling nothing
    check(outer, (x,), compile=lambda fn, a, kw: captured.compile())


def test_jit_recompiles_inside_a_compiled_autograd_block():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    f = aotgrad.jit(m)
    with aotgrad.compiled_autograd("eager"):
        for n in (2, 3, 5):            # the second size recompiles with a symbolic batch
            x = torch.randn(n, 4)
            f(x).sum().backward()
            got = [p.grad.clone() for p in m.parameters()]
            m.zero_grad()
            m(x).sum().backward()
            for g, p in zip(got, m.parameters()):
                torch.testing.assert_close(g, p.grad)
            m.zero_grad()
    assert len(f.entries) == 2
