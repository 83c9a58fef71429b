"""Custom autograd.Functions, tensor hooks and retain_grad inside captured code, next
to eager under capture, jit, torch.compile(backend="aotgrad") and compiled autograd."""
import contextlib

import pytest
import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

import aotgrad
from aotgrad.errors import UnsupportedError
from tests.eager_check import as_is, check, check_training, check_usage, default_compile

F = torch.autograd.Function


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


ENTRIES = {
    "capture": default_compile,
    "jit": lambda fn, args, kwargs, **opts: aotgrad.jit(fn),
    "torch.compile": lambda fn, args, kwargs, **opts: torch.compile(fn, backend="aotgrad"),
}


def r(*shape, rg=True):
    return torch.randn(*shape, requires_grad=rg)


# ---------------------------------------------------------------- custom Functions

class Half(F):
    """Returns its input unchanged; the gradient is halved."""
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return 0.5 * g


class GradReverse(F):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class NoneForInput(F):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return None


class Dirty(F):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 3


class ArgMax(F):
    @staticmethod
    def forward(ctx, x):
        v, idx = x.max(-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x, idx)
        return v, idx

    @staticmethod
    def backward(ctx, gv, gi):
        x, idx = ctx.saved_tensors
        return torch.zeros_like(x).scatter(-1, idx[..., None], gv[..., None])


class Unmaterialized(F):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        out = torch.zeros_like(g1 if g1 is not None else g2)
        if g1 is not None:
            out = out + 2 * g1
        if g2 is not None:
            out = out + 3 * g2
        return out


class Once(F):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp() * 0.5


class SavesOutput(F):
    """Saves its output, keeps a float and a shape on ctx."""
    @staticmethod
    def forward(ctx, x):
        y = x.tanh()
        ctx.save_for_backward(y)
        ctx.k, ctx.shape = 1.5, x.shape
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return (g * (1 - y * y) * ctx.k).reshape(ctx.shape)


FUNCTIONS = {
    "returns_input": (lambda x: Half.apply(x), lambda: (r(3),)),
    "returns_input_used_inside": (lambda x, w: Half.apply(x) * w, lambda: (r(3), r(3))),
    "grad_reverse_of_intermediate_sliced": (lambda x: GradReverse.apply(x * 2)[1:], lambda: (r(4),)),
    "grad_reverse_in_model": (lambda x, w: (GradReverse.apply(x @ w).tanh() * w.sum()).sum(), lambda: (r(2, 3), r(3, 3))),
    "none_for_input_needing_grad": (lambda x: NoneForInput.apply(x), lambda: (r(3),)),
    "none_for_one_path": (lambda x, w: NoneForInput.apply(x) * w + x, lambda: (r(3), r(3))),
    "mark_dirty": (lambda x, w: Dirty.apply(x * 1) * w, lambda: (r(3), r(3))),
    "mark_dirty_on_input": (lambda x, w: Dirty.apply(x) * w, lambda: (r(3, rg=False), r(3))),
    "mark_non_differentiable": (lambda x: ArgMax.apply(x * 1), lambda: (r(2, 4),)),
    "set_materialize_grads_one_used": (lambda x: Unmaterialized.apply(x)[0], lambda: (r(3),)),
    "set_materialize_grads_both": (lambda x: Unmaterialized.apply(x), lambda: (r(3),)),
    "once_differentiable": (lambda x: Once.apply(x), lambda: (r(3),)),
    "saves_output_and_python_state": (lambda x: SavesOutput.apply(x), lambda: (r(2, 3),)),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_custom_function_matches_eager(name, entry):
    fn, args = FUNCTIONS[name]
    torch.manual_seed(0)
    check(fn, make=lambda: (args(), {}), compile=ENTRIES[entry])


@pytest.mark.parametrize("fn, grad", [(Half.apply, 0.5), (GradReverse.apply, -1.0)], ids=["return x", "x.view_as(x)"])
def test_returning_the_input_keeps_the_custom_backward_and_the_alias(fn, grad):
    def copying(gm, example_inputs):      # a backend whose outputs never alias its inputs
        return lambda *a: [o.clone() if isinstance(o, torch.Tensor) else o for o in gm(*a)]
    x = torch.ones(3, requires_grad=True)
    y = aotgrad.capture(fn, x).compile(fw_compiler=copying)(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), grad))
    assert y._base is x         # a view of the input, as eager's
    with torch.no_grad():
        x.add_(1)
    assert torch.equal(y, x)


class ZeroesSaved(F):
    @staticmethod
    def forward(ctx, x, w):
        ctx.x = x
        return x * w

    @staticmethod
    def backward(ctx, g):
        with torch.no_grad():
            ctx.x.zero_()
        return None, g


class CountsInBackward(F):
    @staticmethod
    def forward(ctx, x, count):
        ctx.save_for_backward(count)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (count,) = ctx.saved_tensors
        count.add_(1)
        return g * 2, None


class DoublesSaved(F):
    """Saves ``exp(x)``, a temporary, and doubles it in its backward."""
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y * x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        y.mul_(2)
        return g * y


class TriplesGradient(F):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        g.mul_(3)           # backward(t) hands eager's backward the caller's t: t is written
        return g


WRITING_BACKWARDS = {
    "zeroes_saved_input": (lambda x, w: ZeroesSaved.apply(x, w).sum(), lambda: (torch.ones(3), r(3))),
    "writes_gradient_of_output": (lambda x: TriplesGradient.apply(x), lambda: (r(3),)),
    "add_in_backward": (lambda x, c: CountsInBackward.apply(x, c).sum(), lambda: (r(3), torch.zeros(()))),
    "add_in_backward_and_forward": (lambda x, c: CountsInBackward.apply(x, c.add_(1)).sum(),
                                    lambda: (r(3), torch.zeros(()))),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", list(WRITING_BACKWARDS))
def test_backward_writing_what_it_was_given_is_refused(name, entry):
    fn, args = WRITING_BACKWARDS[name]
    a = args()
    before = [t.detach().clone() for t in a]
    refused = (UnsupportedError, torch._dynamo.exc.BackendCompilerFailed)    # Dynamo wraps backend errors
    with pytest.raises(refused, match="backward of custom autograd.Function .* writes in place") as info:
        ENTRIES[entry](fn, a, {})(*a)
    assert "test_functions_hooks.py" in str(info.value)
    assert all(torch.equal(t, b) for t, b in zip(a, before))     # the refused capture wrote nothing


# ---------------------------------------------------------------- hooks and retain_grad

def _logged_program():
    """``(fn, log)``: a hook on an intermediate that scales its gradient and one on an input, both logging."""
    log = []

    def fn(x, w):
        y = x * w
        y.register_hook(lambda g: log.append(("y", round(g.sum().item(), 4))) or g * 2)
        x.register_hook(lambda g: log.append(("x", round(g.sum().item(), 4))))
        return (y.sin() * w).sum()
    return fn, log


def _hook_backends():
    return {"eager backward": dict(), "compiled_autograd": dict(backward_context=lambda: aotgrad.compiled_autograd("eager"))}


@pytest.mark.parametrize("backward", list(_hook_backends()))
@pytest.mark.parametrize("entry", [*ENTRIES, "eager forward"])
def test_hooks_run_each_backward_in_eager_order(entry, backward):
    if entry == "eager forward" and backward == "eager backward":
        pytest.skip("eager against itself")
    logs = []

    def make():
        fn, log = _logged_program()
        logs.append(log)
        torch.manual_seed(0)
        return fn, (r(3), r(3)), {}
    check(None, make=make, compile=as_is if entry == "eager forward" else ENTRIES[entry], calls=3,
          **_hook_backends()[backward])
    eager, compiled = logs
    # x's hook was registered by each of the 3 calls, y's belongs to the graph backpropagated
    assert compiled == eager and len(eager) == 4
    assert all(isinstance(v, float) for _, v in compiled)


class HookedModel(nn.Module):
    """Registers hooks on its own parameter in forward: eager adds one more every call."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.seen = []

    def forward(self, x):
        self.fc1.weight.register_hook(lambda g: g * 0.5)
        self.fc2.weight.register_post_accumulate_grad_hook(lambda p: self.seen.append(p.grad.sum().item()))
        h = self.fc1(x).relu()
        h.register_hook(lambda g: g.clamp(-0.05, 0.05))
        return self.fc2(h).pow(2).mean()


@pytest.mark.parametrize("backward", list(_hook_backends()))
@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_hooks_on_parameters_registered_every_call_like_eager(entry, backward):
    models = []

    def make():
        torch.manual_seed(0)
        m = HookedModel()
        models.append(m)
        return m, (torch.randn(5, 4),)
    compile = ENTRIES[entry]
    check_training(make, steps=3, compile=lambda m, a, k: compile(m, a, k), **_hook_backends()[backward])
    eager, compiled = models
    assert len(eager.seen) == 1 + 2 + 3 and compiled.seen == pytest.approx(eager.seen)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_retain_grad_on_a_non_leaf_input(entry):
    def fn(a, w):
        a.retain_grad()
        return (a * w).tanh().sum()
    results = []
    for compile in (as_is, ENTRIES[entry]):
        torch.manual_seed(0)
        x, w = r(3), r(3)
        a = x * 2
        f = compile(fn, (a, w), {})
        for _ in range(2):
            f(a, w).backward(retain_graph=True)
        results.append(a.grad)
    torch.testing.assert_close(results[1], results[0])


def test_retain_grad_on_an_unreturned_intermediate_is_harmless():
    def fn(x):
        y = x.exp()
        y.retain_grad()
        return y.sum()
    check(fn, (r(3),))


@pytest.mark.parametrize("backward", list(_hook_backends()))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_retain_grad_on_a_returned_intermediate(entry, backward):
    """y's gradient comes from inside the program (z) and from the caller (y's own use)."""
    def fn(x, w):
        y = x * w
        y.retain_grad()
        z = (y.sin() * w).sum()
        return y, z
    context = _hook_backends()[backward].get("backward_context")
    results = []
    for compile in (as_is, ENTRIES[entry]):
        torch.manual_seed(0)
        x, w = r(3), r(3)
        f = compile(fn, (x, w), {})
        for step in range(2):
            y, z = f(x, w)
            with context() if context and compile is not as_is else contextlib.nullcontext():
                (z + (y * y).sum()).backward()
        assert y.retains_grad
        results.append((y.grad, x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a)


def test_removing_a_hook_inside_is_refused():
    def fn(x):
        h = x.register_hook(lambda g: g * 2)
        h.remove()
        return x.sin().sum()
    with pytest.raises(UnsupportedError, match="removing a hook") as info:
        aotgrad.capture(fn, r(3))
    assert "h.remove()" in str(info.value)


def test_hooks_on_inputs_of_an_inference_capture_are_refused():
    def fn(x):
        x.register_hook(lambda g: g * 2)
        return x.sin()
    with torch.no_grad(), pytest.raises(UnsupportedError, match="without grad"):
        aotgrad.capture(fn, r(3)).compile()


def test_a_hooked_function_is_not_stored_on_disk():
    from aotgrad.runtime.hooks import has_opaque_calls
    fn, _ = _logged_program()
    captured = aotgrad.capture(fn, r(3), r(3))
    assert has_opaque_calls(captured)
    from aotgrad.ir.graphs import Unserializable, dump_graph
    with pytest.raises(Unserializable):
        dump_graph(captured.joint)


def test_none_gradient_under_compiled_autograd():
    """A custom backward's None for an input that needs grad: refused by name where the
    compiled-autograd graph would add it, fine where the graph does not read it."""
    def run(grad_of_x_only):
        x, w = r(3), r(3)
        with aotgrad.compiled_autograd("eager"):
            y = NoneForWeight.apply(x, w).sum()
            if grad_of_x_only:
                return torch.autograd.grad(y, x)[0], x
            y.backward()
    g, x = run(grad_of_x_only=True)
    torch.testing.assert_close(g, torch.ones_like(x))
    with pytest.raises(UnsupportedError, match="NoneForWeight returned None for input 1") as info:
        run(grad_of_x_only=False)
    assert "y.backward()" in str(info.value)


class NoneForWeight(F):
    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g, None


class ScratchInBackward(F):
    """Its backward writes into a temporary the forward made: invisible outside, so allowed."""
    @staticmethod
    def forward(ctx, x):
        ctx.scratch = x.detach() * 1
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.scratch.mul_(g)
        return g * 2 + ctx.scratch


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_backward_writing_a_temporary_matches_eager(entry):
    check(lambda x: ScratchInBackward.apply(x.sin()), make=lambda: ((r(3),), {}), compile=ENTRIES[entry])


def _twice(call, fn, args, kwargs):
    out = call(*args)
    loss = (out * torch.arange(1.0, 4.0)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return out, args[0].grad


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_second_backward_through_a_written_saved_tensor_raises_like_eager(entry):
    """Eager's second backward finds the saved tensor its first one wrote at a new version and raises."""
    def make():
        return lambda x: DoublesSaved.apply(x), (r(3),), {}
    assert isinstance(check_usage(make, _twice, compile=ENTRIES[entry]), RuntimeError)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_second_backward_through_a_written_scratch_is_refused(entry):
    """Eager's second backward reads the scratch its first one wrote; the compiled one would read the
    forward's: the first backward is eager's, the second refused before it runs."""
    fn, x = lambda x: ScratchInBackward.apply(x.sin()), r(3)
    out = ENTRIES[entry](fn, (x,), {})(x)
    loss = (out * torch.arange(1.0, 4.0)).sum()
    loss.backward(retain_graph=True)
    x_e = x.detach().clone().requires_grad_()
    (fn(x_e) * torch.arange(1.0, 4.0)).sum().backward()
    assert torch.allclose(x.grad, x_e.grad)
    with pytest.raises(UnsupportedError, match="second backward") as info:
        loss.backward()
    assert "test_functions_hooks.py" in str(info.value)
    assert torch.allclose(x.grad, x_e.grad)
