"""Double backward through a compiled function (``create_graph=True``): a WGAN-GP
gradient-penalty step and a Hessian-vector product, next to eager, under every entry point."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad.errors import UnsupportedError
from tests.eager_check import check, check_training


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


ENTRIES = {
    "capture": lambda model, args: aotgrad.capture(model, *args).compile(),
    "jit": lambda model, args: aotgrad.jit(model),
    "torch.compile": lambda model, args: torch.compile(model, backend="aotgrad"),
}


class Critic(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.ln = nn.LayerNorm(16)
        self.dropout = dropout

    def forward(self, x):
        h = F.leaky_relu(self.ln(self.fc1(x)), 0.2)
        h = F.dropout(torch.tanh(self.fc2(h)), self.dropout, self.training)
        return self.fc3(h * F.softplus(h))


def wgan_gp_loss(critic, real, fake, eps):
    """The critic's WGAN-GP loss, one critic call on the whole batch: the penalty
    differentiates the critic's input gradient."""
    mixed = eps * real + (1 - eps) * fake
    batch = torch.cat([real, fake, mixed]).requires_grad_()
    score = critic(batch)
    (grad,) = torch.autograd.grad(score[16:].sum(), batch, create_graph=True)
    penalty = ((grad[16:].norm(2, dim=1) - 1) ** 2).mean()
    return score[8:16].mean() - score[:8].mean() + 10 * penalty


class GPStep(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.critic = Critic(dropout)
        self.__dict__["score"] = self.critic      # what scores samples: the critic, or it compiled

    def forward(self, real, fake, eps):
        return wgan_gp_loss(self.score, real, fake, eps)


def _gp_make(dropout):
    def make():
        torch.manual_seed(0)
        return GPStep(dropout), (torch.randn(8, 6), torch.randn(8, 6), torch.rand(8, 1))
    return make


def _compiled_step(entry):
    def compile(model, args, kwargs, **opts):
        batch = torch.cat(args[:2] + (args[1],)).requires_grad_()
        model.__dict__["score"] = ENTRIES[entry](model.critic, (batch,))
        return model
    return compile


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3, betas=(0.0, 0.9))     # WGAN-GP's usual settings


def _batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), torch.rand(8, 1, generator=g)


@pytest.mark.parametrize("entry, dropout", [(e, 0.3) for e in ENTRIES] + [("capture", 0.0)])
def test_wgan_gp_step_trains_like_eager(entry, dropout):
    """With dropout the second-order re-run must draw the forward's masks (RNG state kept per call)."""
    check_training(_gp_make(dropout), steps=3, batches=_batches, compile=_compiled_step(entry), optimizer=_adam)


@pytest.mark.parametrize("entry", [pytest.param("eager", marks=pytest.mark.slow), "capture"])
def test_wgan_gp_step_under_compiled_autograd(entry):
    compile = (lambda model, args, kwargs: model) if entry == "eager" else _compiled_step(entry)
    check_training(_gp_make(0.0), steps=2, batches=_batches, compile=compile, optimizer=_adam,
                   backward_context=lambda: aotgrad.compiled_autograd("eager"))


def _hvp_make(entry):
    def make():
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3), nn.Softplus())
        x, v = torch.randn(4, 5), [torch.randn_like(p) for p in model.parameters()]

        def hvp(x, *v):
            loss = hvp.model(x).pow(2).sum()
            params = list(model.parameters())
            grads = torch.autograd.grad(loss, params, create_graph=True)
            return [h * 1 for h in torch.autograd.grad(grads, params, v)]   # not views, as eager's
        hvp.model = model
        return hvp, (x, *v), {}
    return make


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_hessian_vector_product_matches_eager(entry):
    def compile(fn, args, kwargs):
        fn.model = ENTRIES[entry](fn.model, args[:1])
        return fn
    check(None, make=_hvp_make(entry), compile=compile, backward=False)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_input_hessian_of_a_function(entry):
    """Second derivative w.r.t. the input of a plain function, through a compiled backward."""
    def f(x, w):
        return (torch.sin(x * w) * x.exp()).sum(-1)

    def make():
        torch.manual_seed(2)
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)

        def second(x, w):
            (gx,) = torch.autograd.grad(second.f(x, w).sum(), x, create_graph=True)
            return gx, gx.pow(2).sum()
        second.f = f
        return second, (x, w), {}

    def compile(fn, args, kwargs):
        fn.f = ENTRIES[entry](fn.f, args)
        return fn
    check(None, make=make, compile=compile)


def test_double_backward_of_a_function_that_reads_what_it_writes_is_refused():
    def f(x, buf):
        buf.add_(1)
        return (x * buf).sin().sum()
    x, buf = torch.randn(4, requires_grad=True), torch.zeros(4)
    step = aotgrad.capture(f, x, buf).compile()
    y = step(x, buf)
    with pytest.raises(UnsupportedError, match="create_graph=True.*writes to") as info:
        torch.autograd.grad(y, x, create_graph=True)
    assert "test_double_backward.py" in str(info.value)
    (g,) = torch.autograd.grad(step(x, buf), x)      # first order is unaffected
    torch.testing.assert_close(g, torch.cos(x * buf) * buf)


def test_double_backward_after_an_in_place_change_of_the_input_is_refused():
    x = torch.randn(4, requires_grad=True)
    step = aotgrad.capture(lambda x: (x * 2).sin(), x).compile()
    a = x * 1
    y = step(a).sum()
    with torch.no_grad():
        a.mul_(3)
    with pytest.raises(UnsupportedError, match="modified in place"):
        torch.autograd.grad(y, a, create_graph=True)


class BatchNormCritic(nn.Module):
    """Writes its running statistics in training: the gradients never read them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_gradient_penalty_through_a_batchnorm_critic(entry):
    def make():
        torch.manual_seed(0)
        step = GPStep()
        step.critic = BatchNormCritic()
        step.__dict__["score"] = step.critic
        return step, (torch.randn(8, 6), torch.randn(8, 6), torch.rand(8, 1))
    # SGD: fc1's bias gets a ~0 gradient through BatchNorm, which Adam would blow up to noise-sized steps
    check_training(make, steps=3, batches=_batches, compile=_compiled_step(entry),
                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))


def test_the_first_second_order_backwards_of_two_threads_at_once():
    """The second-order re-run is built on the first ``create_graph=True`` backward (a step that never
    takes one does not load it): two threads taking their first at once, on one compiled function,
    each get eager's second-order gradient for their own input."""
    import threading

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))

    def penalty(f, x):
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), x)[0]

    xs = [torch.randn(4, 5, requires_grad=True) for _ in range(2)]
    want = [penalty(model, x) for x in xs]
    for _ in range(10):
        step = aotgrad.capture(model, xs[0]).compile()
        got, errors, barrier = [None, None], [], threading.Barrier(2)

        def run(i):
            try:
                barrier.wait(timeout=30)
                got[i] = penalty(step, xs[i])
            except Exception as e:     # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
