"""Grad mode and autocast regions inside the program, and the outer mode it is called under;
requires_grad and leaf-ness of what the program makes."""

import torch

from .programs import fn, program, r

G = "modes"


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@program("outer_no_grad_plain", G, outer=torch.no_grad, must_match=True)
def _(n=4):
    return fn(lambda x, w: (x @ w).relu(), r(n, 3), r(3, 2, rg=True))


@program("enable_grad_under_outer_no_grad", G, outer=torch.no_grad)
def _(n=4):
    def f(x, w):
        with torch.enable_grad():
            y = x @ w
        return y, y.detach() * 2
    return fn(f, r(n, 3), r(3, 2, rg=True))


@program("no_grad_inside", G, must_match=True)
def _(n=4):
    def f(x, w):
        with torch.no_grad():
            s = (x * w).sum()
        return x * w * s
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("no_grad_output", G)
def _(n=4):
    def f(x, w):
        with torch.no_grad():
            a = x * w
        return a, x * w
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("set_grad_enabled_false_inside", G)
def _(n=4):
    def f(x, w):
        torch.set_grad_enabled(False)
        a = x * w
        torch.set_grad_enabled(True)
        return a + (x * w)
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("enable_grad_inside_no_grad_inside", G)
def _(n=4):
    def f(x, w):
        with torch.no_grad():
            a = x * w
            with torch.enable_grad():
                b = x * w
        return a, b
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("is_grad_enabled_branch", G, outer=torch.no_grad)
def _(n=4):
    def f(x):
        return x * 2 if torch.is_grad_enabled() else x * 3
    return fn(f, r(n, 3, rg=True))


@program("inference_mode_inside", G)
def _(n=4):
    def f(x, w):
        with torch.inference_mode():
            s = x.sum()
        return w * s.item()
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("autocast_disabled_under_outer_bf16", G, "dtype", outer=bf16_autocast, tol=(1e-2, 1e-2))
def _(n=4):
    def f(x, w):
        with torch.autocast("cpu", enabled=False):
            return x.float() @ w
    return fn(f, r(n, 3), r(3, 2, rg=True))


@program("outer_bf16_autocast_matmul", G, "dtype", outer=bf16_autocast, tol=(1e-2, 1e-2))
def _(n=4):
    return fn(lambda x, w: (x @ w).relu() + x.sum(), r(n, 3), r(3, 3, rg=True))


@program("autocast_bf16_inside", G, "dtype", tol=(1e-2, 1e-2))
def _(n=4):
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y, y.float() * 2
    return fn(f, r(n, 3), r(3, 2, rg=True))


@program("autocast_mixed_regions", G, "dtype", tol=(1e-2, 1e-2))
def _(n=4):
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ w
            with torch.autocast("cpu", enabled=False):
                b = x @ w
        return a.float() + b
    return fn(f, r(n, 3), r(3, 3, rg=True))


# --- requires_grad / leaf-ness ---------------------------------------------------

L = "leafness"


@program("detach_output", L, must_match=True)
def _(n=4):
    return fn(lambda x: ((x * 2).detach(), x * 3), r(n, 3, rg=True))


@program("requires_grad__on_view_output", L)
def _(n=4):
    return fn(lambda a: a.view(-1).requires_grad_(True), r(n, 3))


@program("requires_grad__on_intermediate", L)
def _(n=4):
    def f(x, w):
        y = (x * 2).detach()
        y.requires_grad_(True)
        return y * w, y
    return fn(f, r(n, 3), r(n, 3, rg=True))


@program("factory_requires_grad_output", L)
def _(n=4):
    return fn(lambda x: (torch.ones(3, requires_grad=True), x * 2), r(n, 3, rg=True))


@program("factory_requires_grad_used", L)
def _(n=4):
    def f(x):
        w = torch.ones(3, requires_grad=True)
        return (w * x).sum(0)
    return fn(f, r(n, 3))


@program("no_grad_inputs_only", L, must_match=True)
def _(n=4):
    return fn(lambda x, y: x @ y, r(n, 3), r(3, 2))


@program("some_outputs_require_grad", L, "aotdispatch", must_match=True)
def _(n=4):
    def f(a, b):
        return a.sum() * 2, (b + 1) * 3
    return fn(f, r(n, 3, rg=True), r(n, 3))


@program("constant_output", L)
def _(n=4):
    return fn(lambda x: (x * 2, torch.tensor(1.0), torch.zeros(2)), r(n, rg=True))


@program("detach_then_requires_grad_in_place_op", L)
def _(n=4):
    def f(x):
        y = x.detach()
        return y, y * x
    return fn(f, r(n, 3, rg=True))


@program("outer_no_grad_enable_grad_new_leaf", L, outer=torch.no_grad)
def _(n=4):
    def f(x):
        with torch.enable_grad():
            w = torch.ones(3, requires_grad=True)
            return w * x
    return fn(f, r(n, 3))


# Global settings a program changes and leaves changed: eager leaves them so after every call; the
# compiled function runs no Python to repeat that, so each is refused, and the settings put back.
def _left(change):
    def f(x, w):
        change()
        return (x * w).tanh()
    return f


_LEFT_CHANGED = {
    "grad_mode_left_off": lambda: torch.set_grad_enabled(False),
    "deterministic_algorithms_left_on": lambda: torch.use_deterministic_algorithms(True),
    "default_dtype_left_float64": lambda: torch.set_default_dtype(torch.float64),
    "anomaly_mode_left_on": lambda: torch.set_anomaly_enabled(True),
    "matmul_precision_left_medium": lambda: torch.set_float32_matmul_precision("medium"),
    "autocast_entered_never_exited": lambda: torch.autocast("cpu", dtype=torch.bfloat16).__enter__(),
}
for _name, _change in _LEFT_CHANGED.items():
    program(_name, G)(lambda n=4, change=_change: fn(_left(change), r(n, 3), r(n, 3, rg=True)))


# On CPU these settings change no kernel it runs: eager's numbers. On CUDA the matmul ran in bf16 under
# "medium" in eager, and the compiled graph would run it under the caller's precision: refused there.
@program("settings_changed_and_put_back_inside", G)
def _(n=4):
    def f(x, w):
        torch.use_deterministic_algorithms(True)
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium")
        y = x @ w.t()
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(False)
        return y.tanh()
    return fn(f, r(n, 3), r(n, 3, rg=True))


# Called under anomaly detection: the engine checks each backward node's outputs for NaN, reading a
# value. The joint's trace has no values to check; the compiled backward's outputs are checked when
# it runs. A read of a value by the program's own backward stays data-dependent.
def anomaly():
    return torch.autograd.set_detect_anomaly(True)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + x.tanh()


class _Branching(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 if g.sum() > 0 else g * 3


@program("under_anomaly_mode", G, outer=anomaly, must_match=True)
def _(n=4):
    return fn(lambda x, w: _Scaled.apply((x @ w.t()).tanh()).sum(1), r(n, 3), r(3, 3, rg=True))


@program("backward_reads_a_value_under_anomaly_mode", G, outer=anomaly)
def _(n=4):
    return fn(lambda x, w: _Branching.apply(x * w).tanh(), r(n, 3), r(n, 3, rg=True))
