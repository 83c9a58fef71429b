"""Usage patterns: what a user does around a compiled function between calls, compared with eager
through ``tests.eager_check.check_usage``. Written against the cudagraphs backend, whose replays
write the same memory every call, but valid for any entry point.

``KINDS``: programs, one per kind of output (plain; intermediates only the backward reads;
saved by the backward as well: ``exp``,
``sigmoid``, ``tanh``, ``softmax``; a view of an intermediate; aliasing an input; integer; an
input returned, or written in place and returned; a module's state updated in place). ``USAGES``: patterns, each
``usage(call, fn, args, kwargs) -> kept`` returning what the user kept, uncopied: outputs kept
across calls, writes to an input, a parameter or an output between forward and backward, two
forwards before one backward (also under a saved-tensor pack hook), ``retain_graph=True`` twice (and across a later call), gradients
kept across steps (``.grad`` and ``torch.autograd.grad``), interleaved forwards and backwards.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.eager_check import _tensors, _weights

KINDS: dict = {}
USAGES: dict = {}


def kind(name):
    def register(make):
        KINDS[name] = make
        return make
    return register


def usage(name):
    def register(run):
        USAGES[name] = run
        return run
    return register


class Lin(nn.Module):
    """``out(self.lin(x))``: parameters read in place, the input saved by the backward."""

    def __init__(self, out, n=3):
        super().__init__()
        self.lin, self.out = nn.Linear(n, n), out

    def forward(self, x):
        return self.out(self.lin(x))


def _rg(*shape):
    return torch.randn(*shape, requires_grad=True)


for _name, _out in {"exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
                    "softmax": lambda h: torch.softmax(h, -1), "relu": torch.relu}.items():
    kind(f"saved_{_name}")(lambda out=_out: (Lin(out), (_rg(4, 3),), {}))


@kind("plain")
def _():
    return (lambda x, w: (x @ w + 1, x.t() * 2, (x * 2).sum(0).expand(5, 3)), (_rg(4, 3), _rg(3, 3)), {})


@kind("mutated_input_returned")
def _():
    def f(x, w):
        x.mul_(2)
        return x, (x * w).exp()
    return f, (torch.randn(4, 3), _rg(3)), {}


@kind("saved_intermediates_only")
def _():
    return (lambda x, w: ((x @ w).sin() * (x * 2).cos(),), (_rg(4, 3), _rg(3, 3)), {})


@kind("saved_output_and_its_double")
def _():
    def f(x, w):
        y = (x * w).exp()
        return y, y * 2
    return f, (_rg(4, 3), _rg(3)), {}


@kind("view_of_saved_intermediate")
def _():
    return (lambda x, w: ((x @ w).tanh().t(), (x @ w).exp()[1:]), (_rg(4, 3), _rg(3, 3)), {})


@kind("aliases_input")
def _():
    return (lambda x, w: (x.view(-1), x.t(), (x * w).sigmoid()), (_rg(4, 3), _rg(3)), {})


@kind("input_returned")
def _():
    return (lambda x, w: (w, x, (x * w).exp()), (torch.randn(4, 3), _rg(3)), {})


@kind("integer_outputs")
def _():
    def f(x, w):
        y = x @ w
        return y.argmax(-1), (y > 0).sum(), y.exp()
    return f, (_rg(4, 3), _rg(3, 3)), {}


@kind("buffers_updated_in_place")
def _():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()), (_rg(4, 3),), {}


# --- patterns ------------------------------------------------------------------------

def _fresh(args, k):
    """The arguments of a ``k``-th call: new values, same shapes, dtypes and requires_grad."""
    def new(a):
        if not isinstance(a, torch.Tensor) or isinstance(a, nn.Parameter):
            return a
        v = torch.randn_like(a, requires_grad=False) + k if a.is_floating_point() else a.clone()
        return v.requires_grad_(a.requires_grad)
    return tuple(new(a) for a in args)


def _loss(out):
    """A fixed weighting of the outputs that require grad (one seed for eager and compiled)."""
    terms = [(o * w).sum() for o, w in zip(_tensors(out), _weights(out, 0)) if w is not None]
    return torch.stack(terms).sum()


def _leaves(fn, args):
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    return params + [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf]


def _zero(fn, args):
    for t in _leaves(fn, args):
        t.grad = None


@usage("outputs_kept_across_calls")
def _(call, fn, args, kwargs):
    return [call(*_fresh(args, k), **kwargs) for k in range(4)]


@usage("outputs_and_grads_kept_across_steps")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        _zero(fn, args)
        a = _fresh(args, k)
        out = call(*a, **kwargs)
        _loss(out).backward()
        kept.append((out, [t.grad for t in _leaves(fn, a)]))
    return kept


@usage("grads_accumulated_and_kept")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):                      # no zero_grad: .grad accumulates in place, as kept
        a = _fresh(args, k)
        _loss(call(*a, **kwargs)).backward()
        kept.append([t.grad for t in _leaves(fn, args)])
    return kept


@usage("autograd_grad_kept_across_steps")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        a = _fresh(args, k)
        out = call(*a, **kwargs)
        kept.append((out, torch.autograd.grad(_loss(out), _leaves(fn, a), allow_unused=True)))
    return kept


@usage("two_forwards_then_one_backward")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        outs = [call(*_fresh(args, 2 * k + j), **kwargs) for j in range(2)]
        (_loss(outs[0]) + _loss(outs[1])).backward()
        kept.append(outs)
    return kept


@usage("two_forwards_under_a_pack_hook_keeping_views")
def _(call, fn, args, kwargs):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.view_as(t), lambda t: t):
        return USAGES["two_forwards_then_one_backward"](call, fn, args, kwargs)


@usage("three_forwards_backwards_interleaved")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(2):
        o1 = call(*_fresh(args, 3 * k), **kwargs)
        o2 = call(*_fresh(args, 3 * k + 1), **kwargs)
        _loss(o2).backward()
        o3 = call(*_fresh(args, 3 * k + 2), **kwargs)
        _loss(o1).backward()
        _loss(o3).backward()
        kept.append((o1, o2, o3, [t.grad.clone() for t in _leaves(fn, args)]))
    return kept


@usage("retain_graph_twice")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        out = call(*_fresh(args, k), **kwargs)
        loss = _loss(out)
        loss.backward(retain_graph=True)
        loss.backward()
        kept.append(out)
    return kept


@usage("retained_graph_used_after_a_later_call")
def _(call, fn, args, kwargs):
    kept = []
    old = None
    for k in range(3):
        out = call(*_fresh(args, k), **kwargs)
        loss = _loss(out)
        loss.backward(retain_graph=True)
        if old is not None:
            old.backward(retain_graph=True)     # its saved tensors survived this call's replay
        old = loss
        kept.append(out)
    return kept


def _write_between(call, fn, args, kwargs, write):
    kept = []
    for k in range(3):
        a = _fresh(args, k)
        out = call(*a, **kwargs)
        write(out, a)
        _loss(out).backward()
        kept.append(out)
    return kept


@usage("input_written_before_backward")
def _(call, fn, args, kwargs):
    def write(out, a):
        with torch.no_grad():
            for t in a:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.mul_(2)
    return _write_between(call, fn, args, kwargs, write)


@usage("parameter_stepped_before_backward")
def _(call, fn, args, kwargs):
    def write(out, a):
        with torch.no_grad():
            for p in (fn.parameters() if isinstance(fn, nn.Module) else ()):
                p.sub_(0.1)
    return _write_between(call, fn, args, kwargs, write)


@usage("output_written_before_backward")
def _(call, fn, args, kwargs):
    def write(out, a):
        with torch.no_grad():
            for o in _tensors(out):
                if o.is_floating_point():
                    o.mul_(2)
    return _write_between(call, fn, args, kwargs, write)
