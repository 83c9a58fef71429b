"""aotgrad as a torch.compile backend, compared with eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from tests.eager_check import check


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def dynamo(fn, args, kwargs, backend="aotgrad", **opts):
    return torch.compile(fn, backend=backend, **opts)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1)).log_softmax(-1)


def test_backend_by_name_trains_like_eager():
    check(Net(), (torch.randn(2, 3, 8, 8),), compile=dynamo, calls=2)


def test_configured_backend():
    check(Net(), (torch.randn(2, 3, 8, 8),), compile=dynamo, backend=aotgrad.backend(fw_compiler="eager"))


def test_dynamic_shapes():
    check(nn.Linear(4, 3), (torch.randn(5, 4),), compile=dynamo, dynamic=True)


def test_int_argument_recompiled_as_a_symbol():
    """Dynamo's second call with another int recompiles it as a SymInt graph input: outputs computed
    from it (a number, a view's size) are evaluated from that input (it used to be left unbound:
    'Cannot convert symbols to int')."""
    f = lambda x, k: (x.view(k, -1) * k, k + 1, x.reshape(-1, k).sum(1))  # noqa: E731
    compiled = torch.compile(f, backend="aotgrad")
    for k in (2, 3, 4, 6):
        check(f, (torch.randn(12, requires_grad=True), k), compile=lambda *a: compiled)


def test_graph_breaks():
    def f(x, w):
        y = (x * w).sin()
        print("graph break", end="\r")
        return (y * w).cos().sum()
    check(f, (torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)), compile=dynamo)


def test_eval_no_grad_inference():
    m = Net().eval()
    with torch.no_grad():
        check(m, (torch.randn(2, 3, 8, 8),), compile=dynamo)


def test_parameters_named_in_descriptors():
    seen = []

    def spy(gm, example_inputs):
        from aotgrad.frontend.dynamo import compile_graph
        call = compile_graph(gm, example_inputs)
        seen.append(call.compiled.captured.input_descs)
        return call
    m = nn.Linear(3, 2)
    torch.compile(m, backend=spy)(torch.randn(4, 3)).sum().backward()
    from aotgrad.ir.descriptors import ParamDesc
    assert ParamDesc("weight") in seen[0] and ParamDesc("bias") in seen[0]


@torch.library.custom_op("aotgrad_test::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


@scale.register_fake
def _(x):
    return torch.empty_like(x)


def _scale_backward(ctx, grad):
    # A size test only the backward makes: Dynamo never sees it, our joint trace does.
    return grad * 2 if grad.shape[0] > 4 else grad * 3


scale.register_autograd(_scale_backward)


def test_joint_trace_guards_reach_dynamo():
    f = torch.compile(lambda x: scale(x).sum(), backend="aotgrad", dynamic=True)
    for n, factor in ((8, 2.0), (6, 2.0), (3, 3.0)):
        x = torch.randn(n, requires_grad=True)
        f(x).backward()
        torch.testing.assert_close(x.grad, torch.full((n,), factor))


# Settings a function changes and leaves changed, each of which Dynamo puts in its graph as a setter call:
# every call leaves them as eager's does, also after the caller set them back between calls (the graph
# is reused then: the setting must be set again by the call, not left over from the compile).
LEFT = {"grad off": (torch.set_grad_enabled, True, False, torch.is_grad_enabled),
        "deterministic": (torch.use_deterministic_algorithms, False, True, torch.are_deterministic_algorithms_enabled),
        "default dtype": (torch.set_default_dtype, torch.float32, torch.float64, torch.get_default_dtype),
        "matmul precision": (torch.set_float32_matmul_precision, "highest", "medium",
                             torch.get_float32_matmul_precision)}


@pytest.mark.parametrize("name", list(LEFT))
def test_settings_left_changed_every_call(name):
    put, was, to, get = LEFT[name]

    def f(x, w):
        y = (x * w).tanh()
        put(to)
        return y * 2

    x, w = torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)
    compiled = torch.compile(f, backend="aotgrad")
    try:
        for _ in range(3):
            put(was)
            want = f(x, w)
            left_eager = get()
            put(was)
            got = compiled(x, w)
            assert get() == left_eager == to
            assert torch.equal(got.detach(), want.detach()) and got.requires_grad == want.requires_grad
    finally:
        put(was)
