"""The per-call fast paths of issue #61 part 2, against the full check: held parameter and buffer dicts'
lengths checked in C with the module tags, types and empty hook dicts (``guards.tags.state_check``), and parameters'
and buffers' metadata checked by a guard manager's ``TENSOR_MATCH`` leaves over the flat inputs
(``_torch.tensors_check``), with ``TensorGuards`` and the generated Python check as the fallbacks.

Each is changed in the ways that would fool a shortcut (same count after a pop and an add, a write then
its undo, metadata changed on the same tensor object: ``p.data =``, ``set_``, ``resize_``,
``requires_grad_``), before the C state check is built and after, and on each fallback path forced. After
each change: ``aotgrad.jit`` gives eager's result, recompiling exactly where the change is real; a
staged step raises ``InputMismatchError`` exactly there; and the fast state check agrees with the
per-read loop."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import aotgrad
from aotgrad import _native
from aotgrad.errors import InputMismatchError
from aotgrad.guards import inputs as input_guards
from aotgrad.guards import state as state_guards


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.u = nn.Parameter(torch.randn(1))          # unused by forward: a graph input all the same
        self.register_buffer("s", torch.ones(3))
        self.register_buffer("b", torch.zeros(1))      # unused too

    def forward(self, x):
        return x * self.w + self.s


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.sc = Scale()
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.sc(self.lin(x)))


def _no_grad(fn):
    def run(m):
        with torch.no_grad():
            fn(m)
    return run


def _in_thread(fn):
    def run(m):
        t = threading.Thread(target=fn, args=(m,))
        t.start()
        t.join()
    return run


def _swap_param(m):         # the same count: one popped, another added
    m.sc._parameters.pop("u")
    m.sc._parameters["v"] = nn.Parameter(torch.randn(1))


def _swap_buffer(m):
    m.sc._buffers.pop("b")
    m.sc._buffers["c"] = torch.zeros(1)


# name: steps, each (change, whether it is real: a recompile under jit, a mismatch for a staged step)
CHANGES = {
    "parameter data, another size": [(lambda m: setattr(m.sc.w, "data", torch.randn(2, 3)), True)],
    "parameter data, another layout": [(lambda m: setattr(m.lin.weight, "data", torch.randn(3, 3).t()), True)],
    "parameter data, another dtype": [(lambda m: setattr(m.sc.w, "data", torch.randn(3, dtype=torch.float64)), True)],
    "parameter data, same metadata": [(lambda m: setattr(m.lin.weight, "data", torch.randn(3, 3)), False)],
    "parameter data from another thread": [(_in_thread(lambda m: setattr(m.sc.w, "data", torch.randn(2, 3))), True)],
    "parameter requires_grad_(False)": [(lambda m: m.sc.w.requires_grad_(False), True)],
    "parameter requires_grad off and on": [(lambda m: m.sc.w.requires_grad_(False).requires_grad_(True), False),
                                           (lambda m: m.lin.bias.requires_grad_(False), True)],
    "parameter set_ to another size": [(_no_grad(lambda m: m.sc.w.set_(torch.randn(1, 3))), True)],
    "parameter set_ to the same metadata": [(_no_grad(lambda m: m.sc.w.set_(torch.randn(3))), False)],
    "buffer resized in place": [(lambda m: m.sc.s.resize_(1, 3), True)],
    "buffer resized and back": [(lambda m: m.sc.s.resize_(1, 3).resize_(3), False),
                                (lambda m: m.sc.s.resize_(1, 3), True)],
    "buffer set_ to a strided view": [(lambda m: m.sc.s.set_(torch.ones(6)[::2]), True)],
    "parameter registered": [(lambda m: m.sc.register_parameter("extra", nn.Parameter(torch.zeros(1))), True)],
    "parameter popped and another added": [(_swap_param, True)],
    "parameter popped and put back": [(lambda m: m.sc._parameters.__setitem__("u", m.sc._parameters.pop("u")), False)],
    "parameter dict written from another thread": [
        (_in_thread(lambda m: m.sc.register_parameter("extra", nn.Parameter(torch.zeros(1)))), True)],
    "buffer registered": [(lambda m: m.sc.register_buffer("extra", torch.zeros(1)), True)],
    "buffer popped and another added": [(_swap_buffer, True)],
    "buffer dict replaced by an equal one, then written": [
        (lambda m: setattr(m.sc, "_buffers", dict(m.sc._buffers)), False),
        (lambda m: m.sc._buffers.__setitem__("extra", torch.zeros(1)), True)],
    "parameter replaced in its dict": [(lambda m: m.sc._parameters.__setitem__("w", nn.Parameter(torch.randn(3))), False)],
    "parameter replaced by setattr": [(lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(3, 3))), False)],
    "parameter replaced from another thread": [
        (_in_thread(lambda m: setattr(m.sc, "w", nn.Parameter(torch.randn(3)))), False)],
    "buffer replaced by setattr": [(lambda m: setattr(m.sc, "s", torch.full((3,), 2.0)), False)],
    "parameter dict replaced by an equal one, then an entry replaced": [
        (lambda m: setattr(m.sc, "_parameters", dict(m.sc._parameters)), False),
        (lambda m: m.sc._parameters.__setitem__("w", nn.Parameter(torch.randn(3))), False)],
    "hooks of a parameterless module, same count": [
        (lambda m: m.act._forward_hooks.__setitem__(1, lambda mod, i, o: o), True)],
}


def _agree(guards):
    """The fast check and the per-read loop say the same."""
    fast = guards.check()
    slow = guards.check.__self__._slow()
    assert (fast is None) == (slow is None), (fast, slow)


PATHS = {
    "python, before the C check": (1, {}),
    "C check built": (6, {}),
    "no native tensor check": (6, {"native": False}),
    "no C state check, no guard manager": (6, {"native": False, "manager": False}),
    "no C++ tensor check at all": (6, {"native": False, "manager": False, "tensor_guards": False}),
}


def _force(monkeypatch, native=True, manager=True, tensor_guards=True):
    """The fallbacks a torch without these guard-manager methods takes (or an install that did not
    build aotgrad's own C++ check, or built it for another torch), forced on this one."""
    if not native:
        monkeypatch.setattr(_native, "TensorCheck", None)
    if not manager:
        monkeypatch.setattr(state_guards, "state_check", lambda *a, **k: None)
        monkeypatch.setattr(input_guards, "_MANAGER", False)
    if not tensor_guards:
        def missing(*a, **k):
            raise TypeError("no TensorGuards here")
        monkeypatch.setattr(input_guards, "TensorGuards", missing)


def _setup(monkeypatch, path):
    warm, forced = PATHS[path]
    _force(monkeypatch, **forced)
    torch.manual_seed(0)
    return Net(), torch.randn(2, 3), warm


def _tensor_check(entry):
    """Which check the entry's input guards run on the static tensors."""
    return _checker_name(entry.compiled.captured.guards.check.__globals__.get("fast"))


def _checker_name(fast):
    """Which check ``fast`` (``_static_prefix``'s) is."""
    if fast is None:
        return None
    if fast.__name__ == "fast":         # PyTorch's, wrapped
        return "TensorGuards" if fast.__closure__[0].cell_contents.__name__ == "<lambda>" else "guard manager"
    assert type(fast.__self__) is _native.TensorCheck
    return "native"


# aotgrad's own C++ check where the install built it for this torch (make test's does: asserted in
# test_the_native_check_is_built), else the guard manager's
BEST = "native" if _native.TensorCheck is not None else "guard manager"


def _same(out, expected):
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_jit_recompiles_exactly_where_the_full_check_fails(change, path, monkeypatch):
    model, x, warm = _setup(monkeypatch, path)
    step = aotgrad.jit(model)
    for _ in range(warm):
        _same(step(x), model(x))
    first = step.entries[0].state
    from aotgrad.guards.tags import StateCheck     # (None where not built, or tags miss writes: Python 3.13)
    assert (first.check.__self__.cpp is not None) == (path in ("C check built", "no native tensor check")
                                                        and StateCheck is not None)
    assert _tensor_check(step.entries[0]) == {"no C state check, no guard manager": "TensorGuards",
                                              "no C++ tensor check at all": None,
                                              "no native tensor check": "guard manager"}.get(path, BEST)
    expected = 1
    for do, real in CHANGES[change]:
        do(model)
        _agree(first)
        expected += real
        _same(step(x), model(x))
        assert len(step.entries) == expected, [e.reason for e in step.entries]
        _same(step(x), model(x))        # a second call: the refreshed check
        assert len(step.entries) == expected


@pytest.mark.parametrize("path", ["python, before the C check", "C check built", "no native tensor check",
                                  "no C++ tensor check at all"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_staged_step_refuses_exactly_where_the_full_check_fails(change, path, monkeypatch):
    model, x, warm = _setup(monkeypatch, path)
    step = aotgrad.capture(model, x).compile()
    for _ in range(warm):
        _same(step(x), model(x))
    for do, real in CHANGES[change]:
        do(model)
        _agree(step.captured.state)
        if real:
            with pytest.raises(InputMismatchError):
                step(x)
            return
        out = step(x)
        _same(out, model(x))


class _Desc:
    def __init__(self, param, state=True):
        self.param, self.state = param, state

    def is_param(self):
        return self.param

    def is_state(self):
        return self.state


def _spec(t):
    return input_guards.TensorSpec(t.dtype, t.device, tuple(t.shape), t.requires_grad, (*t.stride(), t.storage_offset()))


class _Sub(torch.Tensor):
    pass


# Each changes one field a graph assumed, on the same tensor object or in its place: a parameter, a
# buffer, then a user input (whose storage offset counts too).
METADATA_CHANGES = {
    "parameter data of another shape": lambda f: setattr(f[0], "data", torch.randn(3, 2)),
    "parameter data transposed": lambda f: setattr(f[0], "data", torch.randn(3, 2).t()),
    "parameter data of another dtype": lambda f: setattr(f[0], "data", torch.randn(2, 3, dtype=torch.float64)),
    "parameter on another device": lambda f: f.__setitem__(0, nn.Parameter(torch.empty(2, 3, device="meta"))),
    "parameter's requires_grad": lambda f: f[0].requires_grad_(False),
    "parameter's neg bit": lambda f: f.__setitem__(0, nn.Parameter(torch._neg_view(torch.randn(2, 3)))),
    "a plain tensor for the parameter": lambda f: f.__setitem__(0, f[0].detach().clone()),
    "a subclass for the parameter": lambda f: f.__setitem__(0, f[0].detach().clone().as_subclass(_Sub)),
    "buffer resized": lambda f: f[1].resize_(2, 2),
    "buffer's requires_grad": lambda f: f[1].requires_grad_(),
    "buffer transposed in place": lambda f: f[1].set_(torch.zeros(4)).unsqueeze_(0).t_(),
    "buffer as_strided in place": lambda f: f[1].as_strided_((2,), (2,)),
    "buffer of another dtype": lambda f: f.__setitem__(1, f[1].to(torch.int64)),
    "an inference tensor for the buffer": lambda f: f.__setitem__(1, _inference(f[1])),
    "a nested tensor for the buffer": lambda f: f.__setitem__(1, torch.nested.nested_tensor([torch.zeros(4)])),
    "a number for the buffer": lambda f: f.__setitem__(1, 4),
    "input at another storage offset": lambda f: f.__setitem__(2, torch.zeros(6)[1:]),
    "input set_ to another offset": lambda f: f[2].set_(torch.zeros(6).untyped_storage(), 1, (5,), (1,)),
    "input viewed with a stride": lambda f: f.__setitem__(2, torch.zeros(10)[::2]),
    "input conjugated": lambda f: f.__setitem__(2, torch.zeros(5, dtype=torch.complex64).conj()),
    "one input fewer": lambda f: f.pop(),
}


# Changes only the fast checks see (dispatch keys; the flat list's length, which the caller's pytree
# check fixes): the whole check reads dtype, device, requires_grad, sizes and layout, and a graph given
# such a tensor computes what eager does on it (or raises as eager does).
FAST_ONLY = {"parameter's neg bit", "an inference tensor for the buffer", "one input fewer"}


def _inference(t):
    with torch.inference_mode():
        return t.clone()


@pytest.mark.parametrize("checker", ["native", "guard manager", "TensorGuards"])
@pytest.mark.parametrize("change", list(METADATA_CHANGES))
def test_the_tensor_check_fails_at_each_metadata_change(change, checker, monkeypatch):
    """The static-prefix check alone (``fast``), for each native checker: each field of a parameter's,
    a buffer's and an input's metadata, changed on the same tensor object or by another in its place,
    fails it; the tensors' values do not."""
    if checker == "native" and _native.TensorCheck is None:
        pytest.skip("aotgrad's C++ tensor check is not built for this torch")
    if checker == "TensorGuards" and "nested" in change:
        pytest.skip("PyTorch's TensorGuards.check aborts the process on a nested tensor (a C++ throw it does not catch)")
    if checker != "native":
        monkeypatch.setattr(_native, "TensorCheck", None)
    monkeypatch.setattr(input_guards, "_MANAGER", checker == "guard manager")

    def fresh():
        return [nn.Parameter(torch.randn(2, 3)), torch.zeros(4), torch.zeros(5)]
    flat = fresh()
    k, fast, offsets = input_guards._static_prefix([_spec(t) for t in flat], [_Desc(True), _Desc(False),
                                                                             _Desc(False, state=False)])
    assert k == 3 and offsets == (checker == "native") and _checker_name(fast) == checker
    assert fast(flat) and fast(fresh()) and fast([*fresh(), "more"])
    assert fast(tuple(fresh())) or checker == "guard manager"     # (a list getter: callers pass lists)
    flat = fresh()
    with torch.no_grad():
        METADATA_CHANGES[change](flat)
    state = torch._C._get_torch_function_state()
    if "offset" in change and not offsets:
        assert fast(flat) and flat[2].storage_offset() != 0     # build()'s Python expression checks it
    else:
        assert not fast(flat)
    assert torch._C._get_torch_function_state() == state       # (a guard manager's left it disabled)
    if change in FAST_ONLY:
        return
    guards = input_guards.build([_spec(t) for t in fresh()], [_Desc(True), _Desc(False), _Desc(False, state=False)], [])
    assert guards.check(fresh()) is None
    assert guards.check(flat) is not None       # the whole check says which


def test_the_native_check_is_built():
    """``make test``'s install builds aotgrad's C++ tensor check for the torch it installs (CPython with a
    compiler): where it is missing or built for another torch, every input guard falls back unnoticed."""
    import platform
    import shutil
    if platform.python_implementation() != "CPython" or platform.system() != "Linux" or \
            not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("the test installs build it on Linux CPython with a C++ compiler")
    import importlib
    module = importlib.import_module(f"aotgrad.{_native.module_name(torch.__version__)}")
    assert module.TORCH_VERSION == torch.__version__
    assert _native.TensorCheck is module.TensorCheck
    assert _native.module_name("2.15.0+cu130") == "_tensors_2_15_0_cu130"


def test_the_native_check_refuses_bad_arguments():
    native = _native.TensorCheck
    if native is None:
        pytest.skip("aotgrad's C++ tensor check is not built for this torch")
    t = torch.zeros(2)
    with pytest.raises(TypeError):
        native([1], [[2]], [[1]], [None])
    with pytest.raises(ValueError):
        native([t], [[2]], [[1, 1]], [None])
    with pytest.raises(ValueError):
        native([t], [[2], [2]], [[1]], [None])
    with pytest.raises(TypeError):
        native([t], [[2]], [[1]], [None]).check(5)
    check = native([t], [[2]], [[1]], [0]).check
    assert check([t]) and check((t,)) and not check([]) and not check([None]) and not check([t[1:]])


def test_per_call_counts_each_check():
    """``per_call`` says what a call checks; the C part holds the tags, the types, the lengths and the empty dicts."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    for _ in range(6):
        step(x)
    counts = step.entries[0].state.per_call()
    assert counts["in C"] is (state_guards.state_check((), (), (), (), (), ()) is not None)
    tagged = state_guards.dict_version is not None      # (Python 3.13: tags miss writes, none are checked)
    assert (counts["tags"] >= 4 if tagged else counts["tags"] == 0) and counts["types"] == 4
    assert counts["held dicts"] >= (8 if tagged else 0)
    assert counts["checks"] == counts["tags"] + counts["types"] + counts["held dicts"] + counts["others"]


def test_the_prologue_takes_the_gathered_parameters_only_while_the_cpp_check_proves_them():
    """After a few calls the entry keeps the parameters and buffers its prologue gathered, under the C
    state check whose passes prove their dicts unchanged; a parameter replaced drops that check, and the
    next calls gather (and use) the new one until a new check is built."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    for _ in range(6):
        _same(step(x), model(x))
    entry = step.entries[0]
    cpp = entry.state.check.__self__.cpp
    if cpp is None:
        pytest.skip("aotgrad's C module is not built here")
    assert entry.gathered[0] is cpp and entry.gathered[1][2] is model.sc.w
    model.sc.w = nn.Parameter(torch.randn(3))
    for _ in range(6):
        _same(step(x), model(x))
        now = entry.state.check.__self__.cpp
        assert now is not cpp and (entry.gathered[0] is not now or entry.gathered[1][2] is model.sc.w)
    assert entry.state.check.__self__.cpp not in (None, cpp) and entry.gathered[0] is entry.state.check.__self__.cpp
    assert len(step.entries) == 1


def test_no_proof_for_slots_the_state_check_does_not_hold():
    """``vouched`` proves only dicts the C check holds by tag, and only while that check is built: a
    parameter dict replaced (by an equal one) drops it."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    for _ in range(6):
        step(x)
    state, held = step.entries[0].state, step.entries[0].compiled.path.held
    if state.check.__self__.cpp is None:
        pytest.skip("aotgrad's C module is not built here")
    assert state.vouched(held) is not None
    other = nn.Linear(3, 3)
    assert state.vouched(((vars(other), "_parameters", "weight"),)) is None
    stand_in = dict(model.sc._parameters)
    slots = ((vars(model.sc), "_parameters", "w"),)
    vars(model.sc)["_parameters"] = stand_in         # changes the tag: the check fails first
    assert state.check() is None
    assert state.vouched(slots) is None


def test_nothing_is_checked_twice():
    """Each place is read by one state guard, and no state guard watches a tensor the input guards check
    (parameters and buffers are the prologue's: their metadata there, their dicts here)."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    for _ in range(6):
        step(x)
    entry = step.entries[0]
    reads = entry.state.reads
    places = [(id(r.where), r.key, r.kind == "type") for r in reads]
    assert len(places) == len(set(places))
    flat, why = entry.match((x,), {})
    assert why is None and len(flat) == 7
    inputs = {id(t) for t in flat}
    watched = [r.source for r in reads if id(r.value) in inputs or id(getattr(r.value, "obj", None)) in inputs]
    assert watched == []


def _random_tensor(rng, param_ok=True):
    """A tensor of random dtype, shape, layout (transposed, sliced, offset), requires_grad and type."""
    dtype = rng.choice([torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.complex64])
    shape = [rng.randint(1, 4) for _ in range(rng.randint(0, 3))]
    t = torch.zeros([s + 1 for s in shape], dtype=dtype) if rng.random() < 0.3 else torch.zeros(shape, dtype=dtype)
    if t.dim() and t.shape != torch.Size(shape):
        t = t[tuple(slice(1, None) if rng.random() < 0.5 else slice(0, s) for s in shape)]     # offset and strides
    if t.dim() >= 2 and rng.random() < 0.3:
        t = t.transpose(0, 1)
    if dtype.is_floating_point or dtype.is_complex:
        if param_ok and rng.random() < 0.4:
            return nn.Parameter(t.clone() if rng.random() < 0.5 else t, requires_grad=rng.random() < 0.8)
        t = t.requires_grad_(rng.random() < 0.3)
    return t


def _variant(rng, t):
    """``t``, or another tensor like it in all but one field at most (its storage offset, strides,
    requires_grad, dtype, type), or a random one."""
    def laid_out(offset, stride=None):
        stride = t.stride() if stride is None else stride
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(t.shape, stride))
        v = torch.zeros(extent, dtype=t.dtype).as_strided(t.shape, stride, offset)
        return type(t)(v, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else \
            v.requires_grad_(t.requires_grad)
    kind = rng.randrange(7)
    if kind == 0:
        return t
    if kind == 1:
        return laid_out(t.storage_offset())                  # equal in every field: passes both
    if kind == 2:
        return laid_out(t.storage_offset() + rng.randint(1, 2))
    if kind == 3 and t.dim():
        return laid_out(t.storage_offset(), tuple(s * 2 for s in t.stride()))
    if kind == 4 and (t.dtype.is_floating_point or t.dtype.is_complex):
        return t.detach().requires_grad_(not t.requires_grad)
    if kind == 5:
        return t.detach().to(torch.float16 if t.dtype != torch.float16 else torch.float32)
    return _random_tensor(rng)


@pytest.mark.parametrize("seed", range(4))
def test_the_native_check_never_passes_what_the_whole_check_fails(seed):
    """Random exemplars against candidates like them but in one field, or random: wherever aotgrad's C++
    check passes, the generated Python check (the authority on what a graph assumed) passes too, but for
    a parameter's or buffer's storage offset (not guarded on the fast path: the module's state does not
    move in its storage, and the graph reads values); a candidate equal in every field passes both. One
    parameter or buffer slot, one user-input slot (its storage offset counts)."""
    if _native.TensorCheck is None:
        pytest.skip("aotgrad's C++ tensor check is not built for this torch")
    import random
    rng = random.Random(seed)
    agreed = passed = 0
    for _ in range(300):
        flat = [_random_tensor(rng), _random_tensor(rng, param_ok=False)]
        descs = [_Desc(isinstance(flat[0], nn.Parameter)), _Desc(False, state=False)]
        # the generated Python alone (``check`` runs the C++ check first)
        whole = input_guards.build([_spec(t) for t in flat], descs, []).check.__globals__["check_all"]
        k, fast, _ = input_guards._static_prefix([_spec(t) for t in flat], descs)
        assert k == 2 and fast(flat) and whole(flat) is None
        for _ in range(6):
            other = [_variant(rng, flat[0]), _variant(rng, flat[1])]
            if fast(other):
                passed += 1
                # by design, a parameter's or buffer's storage offset alone is not checked there
                failed = whole(other)
                assert failed is None or failed == 0 and _spec(other[0]).layout[:-1] == _spec(flat[0]).layout[:-1] \
                    and other[0].storage_offset() != flat[0].storage_offset(), (flat, other)
            agreed += fast(other) == (whole(other) is None)
    assert passed > 100 and agreed > 1200     # the family reaches both verdicts
