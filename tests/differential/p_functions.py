"""Randomness, activation checkpointing, custom autograd.Functions and hooks inside the program."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .programs import fn, program, r

R = "random"


@program("dropout", R, must_match=True)
def _(n=4):
    return fn(lambda x: F.dropout(x, 0.5, True) * 2, r(n, 8, rg=True))


@program("dropout_twice", R, must_match=True)
def _(n=4):
    return fn(lambda x: F.dropout(F.dropout(x, 0.3, True).sin(), 0.3, True), r(n, 8, rg=True))


@program("rand_like", R, must_match=True)
def _(n=4):
    return fn(lambda x: x * torch.rand_like(x), r(n, 3, rg=True))


@program("bernoulli", R, must_match=True)
def _(n=4):
    return fn(lambda x: torch.bernoulli(torch.full_like(x, 0.5)) * x, r(n, 3, rg=True))


@program("randn_factory", R)
def _(n=4):
    return fn(lambda x: x + torch.randn(n, 3), r(n, 3, rg=True))


@program("randperm_multinomial", R)
def _(n=4):
    return fn(lambda x: (x[torch.randperm(n)], torch.multinomial(x.softmax(0), 2)), r(n, rg=True))


@program("random_from_to", R, must_match=True)
def _(n=4):
    # aten.random.from: an overload named by a Python keyword, which fx's generated code must spell
    return fn(lambda x: (x * 1).random_(0, 10) * x + (x * 1).random_(5), r(n, 8, rg=True))


# A torch.Generator the program is given (an argument, a closure, a module's attribute): the graph
# draws from that object, and its state moves on as eager's does (``calls=2``: the second call draws anew).
# Export cannot write a generator (typed refusal); a dynamic capture cannot size a draw by a symbol on one.

@program("generator_argument", R, must_match=True, calls=2, may_refuse=("export", "capture_dynamic"))
def _(n=4):
    return fn(lambda x, g: x * torch.rand(x.shape, generator=g), r(n, 3, rg=True), torch.Generator().manual_seed(3))


@program("generator_closure_and_global_stream", R, must_match=True, calls=2, may_refuse=("export", "capture_dynamic"))
def _(n=4):
    g = torch.Generator().manual_seed(7)
    return fn(lambda x: x * torch.rand(x.shape, generator=g) + torch.rand(x.shape), r(n, 3, rg=True))


@program("generator_twice_and_another", R, must_match=True, calls=2, may_refuse=("export",))
def _(n=4):
    def f(x, g, h, k):
        noise = torch.empty_like(x).normal_(generator=g) + torch.bernoulli(torch.full_like(x, 0.5), generator=h)
        return x[torch.randperm(x.shape[0], generator=k)] * noise
    g = torch.Generator().manual_seed(3)
    return fn(f, r(n, 3, rg=True), g, g, torch.Generator().manual_seed(4))


class _NoisyBlock(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.lin, self.g = torch.nn.Linear(6, 6), g

    def forward(self, x):
        return self.lin(x) * torch.rand(x.shape, generator=self.g)


class _NoisyStack(torch.nn.Module):
    """Repeated blocks, each drawing from its own generator, or two of them alternating: twins whose
    templates must not share one block's generator."""
    def __init__(self, shared: bool, n: int = 4):
        super().__init__()
        gens = [torch.Generator().manual_seed(100 + i) for i in range(2 if shared else n)]
        self.blocks = torch.nn.ModuleList(_NoisyBlock(gens[i % len(gens)]) for i in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x).tanh()
        return x


@program("generator_per_block", R, "blocks", must_match=True, calls=2, may_refuse=("export", "capture_dynamic"))
def _(n=4):
    return fn(_NoisyStack(shared=False), r(n, 6, rg=True))


@program("generator_alternating_blocks", R, "blocks", must_match=True, calls=2, may_refuse=("export", "capture_dynamic"))
def _(n=4):
    return fn(_NoisyStack(shared=True), r(n, 6, rg=True))


def _fill_gapped_views(x):
    y = x * 1
    y[:, 1:].normal_()                  # a view with gaps: eager's kernel fills it element by element
    y.t()[1:, ::2].uniform_(-2, 2)
    z = (x * 1)[:, :5]
    z.exponential_()
    z.bernoulli_(0.3)
    (x * 1).t()[2:].random_(0, 7)       # drawn and thrown away: the stream still moves
    w = x.new_zeros(x.shape)[:, 1:]
    w.cauchy_()
    return y * x, z, w


@program("random_fills_gapped_views", R)     # export refuses aotgrad::fill_strided_* (typed)
def _(n=4):
    return fn(_fill_gapped_views, r(n, 8, rg=True))


@program("fork_rng_inside", R)
def _(n=4):
    def f(x):
        with torch.random.fork_rng():
            torch.manual_seed(3)
            a = torch.rand_like(x)
        return x * a * torch.rand_like(x)
    return fn(f, r(n, 3, rg=True))


@program("manual_seed_inside", R)
def _(n=4):
    def f(x):       # seeds for real while traced: a refusal must put the global RNG back
        torch.manual_seed(3)
        return x * torch.rand_like(x)
    return fn(f, r(n, 3, rg=True))


def _block(x, w):
    return F.dropout((x @ w).tanh(), 0.5, True)


@program("checkpoint_dropout_one_region", R, "checkpoint")
def _(n=4):
    return fn(lambda x, w: checkpoint(_block, x, w, use_reentrant=False).sum(), r(n, 6, rg=True), r(6, 6, rg=True))


@program("checkpoint_dropout_two_regions", R, "checkpoint")
def _(n=4):
    def f(x, w1, w2):
        return checkpoint(_block, checkpoint(_block, x, w1, use_reentrant=False), w2, use_reentrant=False).sum()
    return fn(f, r(n, 6, rg=True), r(6, 6, rg=True), r(6, 6, rg=True))


@program("checkpoint_dropout_two_shapes", R, "checkpoint")
def _(n=4):
    def f(x, w1, w2):
        return checkpoint(_block, checkpoint(_block, x, w1, use_reentrant=False), w2, use_reentrant=False).sum()
    return fn(f, r(n, 6, rg=True), r(6, 5, rg=True), r(5, 3, rg=True))


@program("checkpoint_no_preserve_rng", R, "checkpoint")
def _(n=4):
    def f(x, w):
        return checkpoint(_block, x, w, use_reentrant=False, preserve_rng_state=False)
    return fn(f, r(n, 6, rg=True), r(6, 6, rg=True))


# Compiled autograd refuses an eager forward's checkpoint (saved-tensor hooks): its documented limit.
@program("checkpoint_deterministic", "checkpoint", must_match=True, may_refuse=("compiled_autograd",))
def _(n=4):
    def f(x, w):
        return checkpoint(lambda a, b: (a @ b).sin().cos(), x, w, use_reentrant=False)
    return fn(f, r(n, 6, rg=True), r(6, 6, rg=True))


@program("checkpoint_selective_policy", "checkpoint")
def _(n=4):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def f(x, w):
        return checkpoint(lambda a, b: (a @ b).sin() @ b, x, w, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))
    return fn(f, r(n, 6, rg=True), r(6, 6, rg=True))


# Reentrant checkpointing (``use_reentrant=True``): traced as the non-reentrant one (same masks, same RNG).
@program("checkpoint_reentrant_dropout", R, "checkpoint", must_match=True)
def _(n=4):
    return fn(lambda x, w: checkpoint(_block, x, w, use_reentrant=True).sum(), r(n, 6, rg=True), r(6, 6, rg=True))


@program("checkpoint_reentrant_no_preserve_rng", R, "checkpoint", must_match=True)
def _(n=4):
    def f(x, w):
        return checkpoint(_block, x, w, use_reentrant=True, preserve_rng_state=False) + torch.rand(())
    return fn(f, r(n, 6, rg=True), r(6, 6, rg=True))


# (symbolic sizes: the RNG pass refuses the inner region's draw replayed inside the outer's recompute)
@program("checkpoint_reentrant_nested", R, "checkpoint")
def _(n=4):
    def f(x, w1, w2):
        return checkpoint(lambda a: _block(checkpoint(_block, a, w1, use_reentrant=True), w2), x,
                          use_reentrant=True).sum()
    return fn(f, r(n, 6, rg=True), r(6, 6, rg=True), r(6, 6, rg=True))


class _ReentrantModule(torch.nn.Module):
    """A module's parameters inside the region. (Where no argument requires grad, eager's reentrant
    checkpoint gives them no gradient, and Dynamo, aot_eager too, gives them one: that case is
    tests/trust/test_rebound_and_reentrant.py's, through capture and jit.)"""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3), torch.nn.Tanh())
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.out(checkpoint(self.inner, x * 1.0, use_reentrant=True))


@program("checkpoint_reentrant_module", R, "checkpoint", "module", must_match=True)
def _(n=4):
    return fn(_ReentrantModule(), r(n, 6, rg=True))


class _CkptModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3), torch.nn.Tanh())

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


@program("checkpoint_submodule_in_forward", R, "checkpoint", "module")
def _(n=4):
    return fn(_CkptModule(), r(n, 6, rg=True))


# --- custom autograd.Functions ----------------------------------------------------

C = "function"


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return 0.5 * g


class MulDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = x.argmax(-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.sin(), idx

    @staticmethod
    def backward(ctx, g, _):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        out = torch.zeros(()) if ga is None else ga * 2
        return out + (0 if gb is None else gb * 3)


class SavesOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class NoneGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2, None


class RandomBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * torch.rand_like(g)


class StateBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float, name: str):
        ctx.k, ctx.name = k, name
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k * (2 if ctx.name == "double" else 1), None, None


class BackwardMutatesSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            x.mul_(2)
        return g.clone()


class OnceDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.pow(3)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x * x


class ViewOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view(-1)

    @staticmethod
    def backward(ctx, g):
        return g.view(ctx.shape) if hasattr(ctx, "shape") else g.view(-1, 3) * 1


@program("fn_scale_grad", C, must_match=True)
def _(n=4):
    return fn(lambda x: ScaleGrad.apply(x).sin(), r(n, 3, rg=True))


@program("fn_identity_custom_backward", C)
def _(n=4):
    return fn(lambda x: Identity.apply(x) * 1, r(n, 3, rg=True))


@program("fn_identity_returned", C)
def _(n=4):
    return fn(lambda x: Identity.apply(x), r(n, 3, rg=True))


@program("fn_mark_dirty", C)
def _(n=4):
    return fn(lambda x: MulDirty.apply(x.clone()) + 1, r(n, 3, rg=True))


@program("fn_mark_non_differentiable", C)
def _(n=4):
    return fn(lambda x: NonDiff.apply(x), r(n, 3, rg=True))


@program("fn_set_materialize_grads_false", C)
def _(n=4):
    return fn(lambda x: NoMaterialize.apply(x)[0].sum(), r(n, 3, rg=True))


@program("fn_saves_output", C, must_match=True)
def _(n=4):
    return fn(lambda x: SavesOutput.apply(x).sum(1), r(n, 3, rg=True))


@program("fn_returns_none_grad", C)
def _(n=4):
    return fn(lambda x, w: NoneGrad.apply(x, w), r(n, 3, rg=True), r(n, 3, rg=True))


@program("fn_rng_in_backward", C, R)
def _(n=4):
    return fn(lambda x: RandomBackward.apply(x).sin(), r(n, 3, rg=True))


@program("fn_non_tensor_state", C)
def _(n=4):
    return fn(lambda x: StateBackward.apply(x, 1.5, "double"), r(n, 3, rg=True))


@program("fn_backward_mutates_saved_input", C, "aotdispatch")
def _(n=4):
    return fn(lambda a, b: a * BackwardMutatesSaved.apply(b), r(3, n, rg=True), r(3, n))


@program("fn_once_differentiable", C)
def _(n=4):
    return fn(lambda x: OnceDiff.apply(x).sum(0), r(n, 3, rg=True))


@program("fn_returns_view", C)
def _(n=4):
    return fn(lambda x: ViewOut.apply(x) * 2, r(n, 3, rg=True))


# --- hooks and .grad inside the program --------------------------------------------

H = "hooks"


@program("register_hook_intermediate", H)
def _(n=4):
    def f(x):
        y = x * 2
        y.register_hook(lambda g: g * 3)
        return y.sin()
    return fn(f, r(n, 3, rg=True))


@program("register_hook_input", H)
def _(n=4):
    def f(x):
        x.register_hook(lambda g: g + 1)
        return (x * x).sum(0)
    return fn(f, r(n, 3, rg=True))


@program("retain_grad_intermediate", H)
def _(n=4):
    def f(x):
        y = x.sin()
        y.retain_grad()
        return y, (y * 2).sum()
    return fn(f, r(n, 3, rg=True))


@program("backward_inside", H, backward=False)
def _(n=4):
    def f(x, w):
        loss = (x @ w).sum()
        loss.backward()
        return loss.detach()
    return fn(f, r(n, 3), r(3, 2, rg=True))


@program("autograd_grad_inside", H)
def _(n=4):
    def f(x):
        (g,) = torch.autograd.grad((x ** 3).sum(), x, create_graph=True)
        return g.sum()
    return fn(f, r(n, 3, rg=True))


@program("read_grad_inside", H)
def _(n=4):
    def f(x):
        return x * 2 if x.grad is None else x * x.grad
    return fn(f, r(n, 3, rg=True))


# --- double backward: the loss adds the squared input gradients (create_graph=True) ------

DB = "double_backward"


@program("gradient_penalty_mlp", DB, double_backward=True, tol=(1e-5, 1e-5))
def _(n=4):
    m = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return fn(m, r(n, 3, rg=True))


@program("gradient_penalty_function", DB, double_backward=True, tol=(1e-5, 1e-5))
def _(n=4):
    return fn(lambda x, w: (x @ w).sigmoid().sum(1), r(n, 3, rg=True), r(3, 2, rg=True))


@program("hessian_vector_style", DB, double_backward=True, tol=(1e-5, 1e-5))
def _(n=4):
    return fn(lambda x: (x.sin() * x.pow(2)).sum(), r(n, rg=True))
