"""Real tensor-subclass programs (issue #60): torchao float8 training (emulated on CPU), the traceable
subclasses of PyTorch's own tests (jagged nested tensors: test_subclass_nested.py). Each trains several SGD steps next to
eager, bitwise (loss, every ``.grad`` and every parameter), under ``torch.compile(backend="aotgrad")``,
``aotgrad.jit``, a staged ``capture``, and as a whole training step; or is refused with a typed error
naming the subclass and the user's line before anything runs. DTensor: ``tests/distributed/test_dtensor.py``.
"""
import pytest
import torch
from torch import nn
from torch.testing._internal.custom_tensor import ConstantExtraMetadataTensor, CustomTensorPlainOut
from torch.testing._internal.subclasses import WrapperSubclass
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.errors import AotgradError, UnsupportedError
from tests.differential.entries import ENTRIES
from tests.eager_check import assert_refused, check

STEPS = 3
ENTRY_NAMES = ["capture", "jit", "dynamo"]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if type(a) is not torch.Tensor and type(a) is not nn.Parameter:
        keys, _ = a.__tensor_flatten__()
        return all(_same(getattr(a, k), getattr(b, k)) for k in keys)
    return torch.equal(a, b) and a.requires_grad == b.requires_grad


def _forward_entry(entry, model, x):
    if entry == "capture":
        return aotgrad.capture(model, x).compile()
    if entry == "jit":
        return aotgrad.jit(model)
    return torch.compile(model, backend="aotgrad")


def _stepper(model, opt):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss         # a TwoTensor weight's loss is a TwoTensor that required grad
    return step


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_like_eager(make, entry, data, optimizer=_sgd):
    """``make()`` twice: one trained eagerly, one through ``entry``; per step, all equal bitwise?"""
    torch._dynamo.reset()
    eager, model = make(), make()
    opt_e, opt_m = optimizer(eager.parameters()), optimizer(model.parameters())
    want, got = _stepper(eager, opt_e), _stepper(model, opt_m)
    if entry == "step jit":
        fn = aotgrad.jit(got)
    elif entry == "step capture":       # after one eager step: the optimizer's state exists
        want(data(-1)), got(data(-1))
        fn = aotgrad.capture(got, data(-1)).compile()
    else:
        fn = _stepper(_forward_entry(entry, model, data(0)), opt_m)
    out = []
    for i in range(STEPS):
        x = data(i)
        out.append(_same(want(x), fn(x)) and all(_same(a, b) for a, b in zip(eager.parameters(), model.parameters())))
    return out


TRAIN_ENTRIES = ["capture", "jit", "dynamo", "step jit", "step capture"]


# --- torchao float8 training (emulated: the float8 casts and scaled matmuls in plain ATen on CPU)

def _float8_mlp():
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    return float8.convert_to_float8_training(m, config=float8.Float8LinearConfig(emulate=True))


def _data(i):
    torch.manual_seed(100 + i)
    return torch.randn(8, 16)


@pytest.mark.parametrize("entry", TRAIN_ENTRIES)
def test_float8_training_is_bitwise_eager(entry):
    assert train_like_eager(_float8_mlp, entry, _data) == [True] * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["step jit", "step capture"])
def test_float8_whole_step_with_adamw_is_bitwise_eager(entry):
    """AdamW's foreach update of the float8 model's (plain) weights, in the same graph as the float8 matmuls."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)
    assert train_like_eager(_float8_mlp, entry, _data, adamw) == [True] * STEPS


def test_float8_graph_computes_in_float8():
    captured = aotgrad.capture(_float8_mlp(), _data(0))
    assert "float8_e4m3fn" in captured.joint.code and "float8_e5m2" in captured.joint.code
    assert "Float8TrainingTensor" not in captured.joint.code       # plain ATen ops on its inner tensors


# --- PyTorch's own test subclasses as parameters

def _with_param(wrap):
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
        m[0].weight = nn.Parameter(wrap(m[0].weight.detach()))
        return m
    return make


SUBCLASS_PARAMS = {
    "TwoTensor": lambda w: TwoTensor(w.clone(), w * 2),
    "WrapperSubclass": lambda w: WrapperSubclass(w.clone()),
    "ConstantExtraMetadataTensor": lambda w: ConstantExtraMetadataTensor(w.clone()),
}


@pytest.mark.parametrize("entry", TRAIN_ENTRIES)
@pytest.mark.parametrize("cls", list(SUBCLASS_PARAMS))
def test_torch_test_subclass_parameter_trains_bitwise(cls, entry):
    assert train_like_eager(_with_param(SUBCLASS_PARAMS[cls]), entry, _data) == [True] * STEPS


def _plain_out(x):
    """CustomTensorPlainOut's non-view ops return plain tensors (the sum of both inner results)."""
    return (CustomTensorPlainOut(x * 2, x + 1) * 3).sin()


@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_subclass_made_inside_returning_plain_tensors(entry):
    torch._dynamo.reset()
    check(None, make=lambda: (_plain_out, (torch.randn(3, requires_grad=True),), {}), compile=ENTRIES[entry].compile)


# --- jagged nested tensors: tests/core/test_subclass_nested.py


# --- what cannot be traced: typed refusals naming the subclass

_CLOSED = {"TwoTensor": lambda: nn.Parameter(TwoTensor(torch.randn(3), torch.randn(3))),
           "CustomTensorPlainOut": lambda: nn.Parameter(CustomTensorPlainOut(torch.randn(3), torch.randn(3)))}


@pytest.mark.parametrize("cls", list(_CLOSED))
def test_subclass_parameter_reached_through_a_closure_is_refused(cls):
    w = _CLOSED[cls]()      # not an input: its dispatch would bake its inner tensors in, its .grad stay None

    def f(x):
        return (x * w).sum()
    e = assert_refused(f, (torch.randn(3),))
    assert isinstance(e, UnsupportedError) and cls in str(e) and "test_subclass_targets.py" in str(e), e


@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_subclass_whose_gradient_is_plain_is_refused(entry):
    """CustomTensorPlainOut's ops return plain tensors, so eager's .grad of one is plain: the graph
    differentiates its inner tensors and has no map from a plain gradient onto them. (Called directly:
    a clone of one, as eager_check makes, is a plain tensor.)"""
    torch._dynamo.reset()
    w, x = CustomTensorPlainOut(torch.randn(3), torch.randn(3)).requires_grad_(), torch.randn(3)
    with pytest.raises(Exception) as info:
        ENTRIES[entry].compile(lambda w, x: (w * x).sin(), (w, x), {})(w, x)
    e = info.value
    e = e.inner_exception if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) else e
    assert isinstance(e, UnsupportedError) and "gradient of a CustomTensorPlainOut is a plain tensor" in str(e), e
    assert w.grad is None
