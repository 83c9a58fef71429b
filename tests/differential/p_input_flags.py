"""``requires_grad_()`` on an input inside the function (``test_aotdispatch``'s
``test_input_inplace_requires_grad_true``): eager's caller's tensor requires grad afterwards, and the
outputs computed from it after the call have a history reaching it (its ``.grad`` fills). Each call
sets the flag on the caller's tensor before the graph runs, the graph traced with it differentiable.

Twins: used after (plain outputs), returned itself, returned as a view, read before and after the
flag (only what follows it is differentiable), inside ``no_grad`` (the flag, no history), a view of a
base that does not require grad, the tensor passed twice, an input that already requires grad (no-op),
and written after the flag (eager raises: a leaf that requires grad written in place). Refused:
the tensor passed twice (the graph takes the two apart), ``requires_grad_(False)`` (the trace's stand-in
is no leaf) and ``detach_()`` on an input. A ``capture().compile()`` step (and an exported one) called
again with the tensor its first call flagged sees a tensor that requires grad: another input
(``InputMismatchError``, as any change of ``requires_grad``); ``jit`` compiles once more.
"""
import torch

from .programs import fn, program, r

D = "aotdispatch"
F = "input_flags"

BODIES = {
    "used": lambda a, b: (a.mul(3), b.mul(4)),
    "returned": lambda a, b: (a, a * b),
    "returned_view": lambda a, b: (a.t(), a[1:] * b[1:]),
    "read_before_and_after": None,          # below: a value read before the flag stays constant
    "under_no_grad": None,
    "written_after": None,
}


def _read_before_and_after(a, b):
    before = a * 2                  # no history: a did not require grad yet
    a.requires_grad_()
    return before + a.sin() * b


def _under_no_grad(a, b):
    with torch.no_grad():
        a.requires_grad_()
        c = a * 2                   # no history under no_grad
    return c + b, a * b


def _written_after(a, b):
    a.requires_grad_()
    a.mul_(2)                       # eager: a leaf that requires grad used in an in-place operation
    return a + b


def _flagged(body):
    def f(a, b):
        a.requires_grad_(True)
        return body(a, b)
    return f


for _name, _body in BODIES.items():
    f = {"read_before_and_after": _read_before_and_after, "under_no_grad": _under_no_grad,
         "written_after": _written_after}.get(_name) or _flagged(_body)

    @program(f"requires_grad__{_name}", F, D, must_match=_name != "written_after",
             eager_raises=_name == "written_after")
    def _(n=3, f=f):
        return fn(f, r(n, 3), r(n, 3, rg=True))


@program("requires_grad__view_of_base", F, D, must_match=True)
def _(n=3):
    def f(a, b):
        a.requires_grad_()          # a is a view of a base that does not require grad
        return a * b
    return fn(f, r(n + 1, 3)[1:], r(n, 3, rg=True))


@program("requires_grad__already", F, D, must_match=True)
def _(n=3):
    def f(a, b):
        a.requires_grad_()          # a no-op: it requires grad already
        return a * b
    return fn(f, r(n, 3, rg=True), r(n, 3))


@program("requires_grad__passed_twice", F, D)
def _(n=3):
    def f(a, b):
        a.requires_grad_()          # b is a: eager's b requires grad from here too
        return a * 2, b * 3
    x = r(n, 3)
    return fn(f, x, x)      # refused: the graph takes a and b apart


@program("requires_grad__false_on_leaf", F, D)
def _(n=3):
    def f(a, b):
        a.requires_grad_(False)
        return a * b
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("requires_grad__detach_", F, D)
def _(n=3):
    def f(a, b):
        a.detach_()
        return a * b
    return fn(f, r(n, 3, rg=True).mul(1), r(n, 3, rg=True))
