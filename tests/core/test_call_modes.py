"""A compiled step called under other modes than it was first called (or captured) under: grad mode
(``no_grad``, ``inference_mode``, ``set_grad_enabled(False)``), autocast, the default dtype.

Which outputs require grad, the casts autocast chose and any branch on those modes are traced into
the graph, so ``jit`` and ``torch.compile`` compile again and match eager exactly (outputs,
``requires_grad``/``grad_fn``, buffers written in place, what a later backward does), while a
``capture().compile()`` step refuses the call with an ``InputMismatchError`` naming the mode before
anything runs (nothing written, no RNG drawn); so does a step loaded from an export (its artifact
records the modes)."""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad import errors
from tests.eager_check import _state, assert_same_rng, check_usage, rng_state


def _bn():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), (torch.randn(4, 3),), {}


class _With(nn.Module):
    """``body(self, x)`` as a module holding the parameter ``w`` it reads."""

    def __init__(self, body, *shape):
        super().__init__()
        self.w, self.body = nn.Parameter(torch.randn(*shape)), body

    def forward(self, x):
        return self.body(self, x)


def _param_view():
    return _With(lambda m, x: (m.w.view(-1), (x @ m.w).relu()), 3, 3), (torch.randn(4, 3),), {}


def _enable_grad_inside():
    def body(m, x):
        with torch.enable_grad():
            y = x @ m.w
        return y, y.detach() * 2
    return _With(body, 3, 2), (torch.randn(4, 3),), {}


def _branch_on_grad_mode():
    return _With(lambda m, x: x * m.w * (2 if torch.is_grad_enabled() else 3), 3), (torch.randn(4, 3),), {}


def _dropout_and_matmul():
    m = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    return m, (torch.randn(5, 3),), {}


PROGRAMS = {"batchnorm": _bn, "param_view": _param_view, "enable_grad_inside": _enable_grad_inside,
            "branch_on_grad_mode": _branch_on_grad_mode, "dropout_matmul": _dropout_and_matmul}

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
         "set_grad_enabled_false": lambda: torch.set_grad_enabled(False),
         "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
         "default_dtype_float64": lambda: _default_dtype(torch.float64)}


@contextlib.contextmanager
def _default_dtype(dtype):
    was = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(was)


def _usage(mode):
    """A training call, a call under ``mode``, another training call; the first and last backward.
    What a backward through the call under ``mode`` does (eager raises: nothing requires grad) is kept."""
    def run(call, fn, args, kwargs):
        first = call(*args, **kwargs)
        with MODES[mode]():
            during = call(*args, **kwargs)
        last = call(*args, **kwargs)
        loss = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves((first, last))
                   if isinstance(t, torch.Tensor) and t.requires_grad)
        loss.backward()
        leaves = [t for t in torch.utils._pytree.tree_leaves(during) if isinstance(t, torch.Tensor)]
        flags = []
        for t in leaves:
            try:
                t.float().sum().backward()
                flags.append(True)
            except RuntimeError:
                flags.append(False)
        return first, [t.clone() if t.is_inference() else t for t in leaves], last, torch.tensor(flags)
    return run


def _jit(fn, args, kwargs):
    return aotgrad.jit(fn)


def _dynamo(fn, args, kwargs):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotgrad")


# Inference mode traces no autograd views: an enable_grad region inside (eager: an inference tensor)
# is traced as another output.
KNOWN = {("dynamo", "enable_grad_inside", "inference_mode"): "Dynamo's graph for an enable_grad region called "
         "under inference_mode returns an output that requires grad (eager: an inference tensor that does not)"}


def _modes_params():
    for entry in ("jit", "dynamo"):
        for program in PROGRAMS:
            for mode in MODES:
                why = KNOWN.get((entry, program, mode))
                yield pytest.param(entry, program, mode, id=f"{entry}-{program}-{mode}",
                                   marks=[pytest.mark.xfail(reason=why, strict=True)] if why else [])


@pytest.mark.parametrize("entry,program,mode", list(_modes_params()))
def test_recompiled_call_under_another_mode_matches_eager(entry, program, mode):
    tol = dict(rtol=2e-2, atol=2e-2) if mode == "autocast_bf16" else {}
    check_usage(PROGRAMS[program], _usage(mode), compile={"jit": _jit, "dynamo": _dynamo}[entry], **tol)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_captured_step_refuses_another_mode_before_anything_runs(program, mode):
    fn, args, kwargs = PROGRAMS[program]()
    step = aotgrad.capture(fn, *args, **kwargs).compile()
    step(*args, **kwargs)
    before = {k: v.clone() for k, v in _state(fn, args, kwargs).items()}
    rng = rng_state()
    with pytest.raises(errors.InputMismatchError, match="grad mode|inference mode|autocast|default dtype") as e:
        with MODES[mode]():
            step(*args, **kwargs)
    assert "test_call_modes.py" in str(e.value)       # the user's line
    for k, v in _state(fn, args, kwargs).items():
        assert torch.equal(before[k], v), f"{k} changed by a refused call"
    assert_same_rng(rng, rng_state(), "after a refused call")


def test_captured_under_no_grad_runs_under_no_grad_only():
    fn, args, kwargs = _bn()
    with torch.no_grad():
        step = aotgrad.capture(fn, *args).compile()
        out = step(*args)
    assert not out.requires_grad
    with pytest.raises(errors.InputMismatchError, match="grad mode was disabled when captured"):
        step(*args)


def test_an_operator_refusing_its_inputs_is_a_typed_error_naming_the_line():
    m = nn.Linear(3, 3)
    step = aotgrad.jit(m)
    step(torch.randn(2, 3))
    x64 = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError) as eager:
        m(x64)
    with pytest.raises(errors.OpError, match="addmm.*float64") as compiled:
        step(x64)
    assert isinstance(compiled.value, RuntimeError) and str(eager.value) in str(compiled.value)
    assert "linear.py" in str(compiled.value)      # the layer's line: the user's own frame is outside the trace

    def draw(p):
        return F.relu(torch.multinomial(p, 1).float())
    step = aotgrad.capture(draw, torch.rand(2, 4)).compile()
    with pytest.raises(errors.OpError, match="multinomial") as e:      # eager: RuntimeError, probabilities < 0
        step(-torch.rand(2, 4))
    assert "test_call_modes.py" in str(e.value) and "torch.multinomial(p, 1)" in str(e.value)
    with pytest.raises(IndexError):         # a typed error of torch's own keeps its type
        aotgrad.capture(lambda x, i: x[i] * 2, torch.randn(4), torch.tensor([1])).compile()(
            torch.randn(4), torch.tensor([9]))


def _exported(fn, args, kwargs, tmp_path, name="step.aotgrad"):
    path = str(tmp_path / name)
    aotgrad.capture(fn, *args, **kwargs).export(path)
    return aotgrad.load(path)


@pytest.mark.parametrize("mode", list(MODES))
def test_loaded_step_refuses_another_mode_before_anything_runs(mode, tmp_path):
    """An exported step keeps the modes its graphs were traced under (the artifact's ``modes``): under
    autocast it ran in float32 before, silently."""
    fn, args, kwargs = _bn()
    step = _exported(fn, args, kwargs, tmp_path)
    step(*args)
    before = {k: v.clone() for k, v in step.state_dict().items()}
    rng = rng_state()
    with pytest.raises(errors.InputMismatchError, match="grad mode|inference mode|autocast|default dtype") as e:
        with MODES[mode]():
            step(*args)
    assert "test_call_modes.py" in str(e.value)
    for k, v in step.state_dict().items():
        assert torch.equal(before[k], v), f"{k} changed by a refused call"
    assert_same_rng(rng, rng_state(), "after a refused call")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loaded_step_exported_under_autocast_runs_under_it(dtype, tmp_path):
    fn, args, kwargs = _bn()
    with torch.autocast("cpu", dtype=dtype):
        step = _exported(fn, args, kwargs, tmp_path)
        out, want = step(*args), fn(*args)
    assert out.dtype == want.dtype == dtype
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert step.manifest["modes"][1] is True
    with pytest.raises(errors.InputMismatchError, match="CPU autocast was on, now off"):
        step(*args)


def test_loaded_step_with_malformed_modes_is_refused_at_load(tmp_path):
    import json
    import zipfile
    fn, args, kwargs = _bn()
    path = str(tmp_path / "a.aotgrad")
    aotgrad.capture(fn, *args).export(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    for bad in ([True], [False, False, False, None, None, {"dtype": "nonsense"}], "off",
                [1, False, False, None, None, {"dtype": "float32"}]):
        m = json.loads(members["manifest.json"])
        m["modes"] = bad
        out = str(tmp_path / "b.aotgrad")
        with zipfile.ZipFile(out, "w") as z:
            for n, data in members.items():
                z.writestr(n, json.dumps(m) if n == "manifest.json" else data)
        with pytest.raises(errors.ExportFormatError):
            aotgrad.load(out)


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_anomaly_mode_nan_gradient_raises_as_in_eager(entry):
    """Under anomaly detection eager's engine raises when a backward node returns NaN. The compiled
    backward is one node to the engine: traced without values to check, it raises when it runs."""
    def f(x, w):
        return torch.where(x > 0, (x * w).sqrt(), x).sum()

    x, w = torch.tensor([1.0, -2.0, 3.0]), torch.ones(3, requires_grad=True)
    compiled = aotgrad.capture(f, x, w).compile() if entry == "capture" else aotgrad.jit(f)
    with torch.autograd.set_detect_anomaly(True):
        for run in (f, compiled):
            out = run(x, w)
            with pytest.raises(RuntimeError, match="returned nan values"):
                out.backward()
        assert torch.equal(compiled(x, w), f(x, w))
    with torch.autograd.set_detect_anomaly(False):
        w.grad = None
        compiled(x, w).backward()
        assert w.grad.isnan().any()     # without it, the NaN gradient is eager's too


def _precision_changed_inside(x, w):
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        y = x @ w.t()
    finally:
        torch.set_float32_matmul_precision(precision)
    return y.tanh()


def test_numerics_set_and_put_back_inside_match_eager_on_cpu():
    """CPU kernels read none of these settings: the captured function is eager's."""
    from tests.eager_check import check
    check(_precision_changed_inside, (torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)))


@pytest.mark.parametrize("change", ["precision", "cudnn_tf32", "deterministic"])
def test_a_cuda_op_traced_under_numerics_the_caller_does_not_have_is_refused(change):
    """The compiled graph's CUDA kernels run under the caller's TF32 / cuDNN / determinism settings:
    an op traced while the function had them otherwise would give other numbers than eager's.
    (A fake CUDA tensor stands for one: the check runs on the traced op, before any kernel.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from aotgrad.capture.session import _refuse_other_numerics
    from aotgrad.runtime import modes
    at_entry = modes.numerics()
    setters = {"precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "medium"),
               "cudnn_tf32": (torch._C._get_cudnn_allow_tf32, torch._C._set_cudnn_allow_tf32,
                              not torch._C._get_cudnn_allow_tf32()),
               "deterministic": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms,
                                 not torch.are_deterministic_algorithms_enabled())}
    get, put, other = setters[change]
    with FakeTensorMode():
        cuda, cpu = torch.empty(2, 2, device="cuda"), torch.empty(2, 2)
    before = get()
    _refuse_other_numerics(torch.ops.aten.mm.default, (cuda, cuda), at_entry)     # settings unchanged
    put(other)
    try:
        _refuse_other_numerics(torch.ops.aten.mm.default, (cpu, cpu), at_entry)   # a CPU op reads none
        with pytest.raises(errors.UnsupportedError, match="numerics settings") as e:
            _refuse_other_numerics(torch.ops.aten.mm.default, ([cuda], cuda), at_entry)
        assert "the caller's settings" in str(e.value)
    finally:
        put(before)
