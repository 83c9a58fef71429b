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

import itertools

import torch
import torch.nn as nn

from tests.eager_check import _tensors, _weights

KINDS: dict = {}
USAGES: dict = {}
RESHAPING: set = set()      # patterns that call with other batch sizes: for entries that accept them


def kind(name):
    def register(make):
        KINDS[name] = make
        return make
    return register


def usage(name, reshapes=False):
    def register(run):
        USAGES[name] = run
        if reshapes:
            RESHAPING.add(name)
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


@kind("saved_exp_laid_out_by_a_decomposition")
def _():       # Inductor lays the output out again (cat with an empty operand keeps x.t()'s layout)
    return (lambda x: torch.cat([x.t(), x.t()[:0]]).exp(), (_rg(3, 4),), {})


@kind("integer_outputs")
def _():
    def f(x, w):
        y = x @ w
        return y.argmax(-1), (y > 0).sum(), y.exp()
    return f, (_rg(4, 3), _rg(3, 3)), {}


@kind("saved_exp_float64")
def _():
    return Lin(torch.exp).double(), (_rg(4, 3).double(),), {}


@kind("split_by_a_host_sync")
def _():
    def f(x, w):                # .item() runs eagerly between two graphed segments
        y = x @ w
        s = y.detach().abs().amax().item()
        return (y / (1 + s)).exp(), y.sigmoid()
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


def _floating(tensors):
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _state_of(fn, which):
    if not isinstance(fn, nn.Module):
        return []
    return _floating(fn.parameters() if which == "parameters" else fn.buffers())


def _written(what, how):
    """A ``write(out, a)`` for ``_write_between``: ``how`` on each floating tensor ``what(fn, a)``
    names, under ``no_grad`` (as an optimizer writes)."""
    def pattern(call, fn, args, kwargs):
        def write(out, a):
            with torch.no_grad():
                for t in what(fn, a):
                    how(t)
        return _write_between(call, fn, args, kwargs, write)
    return pattern


def _first_row(t):
    return t.view(-1)[:1].mul_(2)       # a view of the tensor, written


usage("input_view_written_before_backward")(_written(lambda fn, a: _floating(a), _first_row))
usage("parameter_view_written_before_backward")(
    _written(lambda fn, a: _state_of(fn, "parameters"), _first_row))
usage("buffer_written_before_backward")(_written(lambda fn, a: _state_of(fn, "buffers"), lambda t: t.add_(0.5)))


def _on_bases(a):
    """Each floating input as the first half of a fresh base twice its size (same shape, strides
    and offset: the guards see the same input), the bases returned as the leaves."""
    args, bases = [], []
    for t in a:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or isinstance(t, nn.Parameter):
            args.append(t)
            continue
        rest = torch.randn(t.numel(), dtype=t.dtype, device=t.device)
        base = torch.cat([t.detach().reshape(-1), rest]).requires_grad_(t.requires_grad)
        args.append(base[:t.numel()].view(t.shape))
        bases.append(base)
    return tuple(args), bases


def _base_written(half):
    def pattern(call, fn, args, kwargs):
        kept = []
        for k in range(3):
            a, bases = _on_bases(_fresh(args, k))
            out = call(*a, **kwargs)
            with torch.no_grad():
                for b in bases:         # the half the input does not cover: same version counter
                    (b if half is None else b[b.numel() // 2:]).mul_(2)
            _loss(out).backward()
            kept.append((out, bases, [b.grad for b in bases]))
        return kept
    return pattern


usage("input_base_written_before_backward")(_base_written(None))
usage("input_base_written_elsewhere_before_backward")(_base_written("other half"))


def _grads(fn, a):
    return [None if t.grad is None else t.grad.clone() for t in _leaves(fn, a)]


@usage("forwards_then_backwards_in_every_order")
def _(call, fn, args, kwargs):
    kept, k = [], 0
    for n in (2, 3):
        for order in itertools.permutations(range(n)):
            calls = [_fresh(args, k + j) for j in range(n)]
            outs = [call(*a, **kwargs) for a in calls]
            k += n
            for j in order:
                _loss(outs[j]).backward()
            kept.append((outs, [_grads(fn, a) for a in calls]))
    return kept


@usage("three_forwards_then_one_backward")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(2):
        calls = [_fresh(args, 3 * k + j) for j in range(3)]
        outs = [call(*a, **kwargs) for a in calls]
        sum(_loss(o) for o in outs).backward()
        kept.append((outs, [_grads(fn, a) for a in calls]))
    return kept


@usage("no_grad_call_between_forward_and_backward")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        out = call(*_fresh(args, 3 * k), **kwargs)
        with torch.no_grad():
            between = call(*_fresh(args, 3 * k + 1), **kwargs)
        after = call(*_fresh(args, 3 * k + 2), **kwargs)
        _loss(out).backward()
        _loss(after).backward()
        kept.append((out, between, after))
    return kept


@usage("retain_graph_across_two_forwards")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(2):
        first, second = (_loss(call(*_fresh(args, 2 * k + j), **kwargs)) for j in range(2))
        second.backward(retain_graph=True)
        first.backward(retain_graph=True)
        second.backward()
        first.backward()
        kept.append(_grads(fn, ()))
    return kept


@usage("backward_after_the_graph_was_freed")
def _(call, fn, args, kwargs):
    loss = _loss(call(*_fresh(args, 0), **kwargs))
    loss.backward(retain_graph=True)
    loss.backward()
    call(*_fresh(args, 1), **kwargs)    # a replay after the backward that freed the graph
    loss.backward()                     # eager: "Trying to backward through the graph a second time"


@usage("same_inputs_called_twice")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        a = _fresh(args, k)             # the same tensors twice: an input at a stable address
        first, second = call(*a, **kwargs), call(*a, **kwargs)
        _loss(second).backward()
        _loss(first).backward()
        kept.append((first, second, _grads(fn, a)))
    return kept


@usage("same_inputs_written_between_calls")
def _(call, fn, args, kwargs):
    kept = []
    for k in range(3):
        a = _fresh(args, k)
        first = call(*a, **kwargs)
        with torch.no_grad():
            for t in _floating(a):
                t.add_(1)
        second = call(*a, **kwargs)
        _loss(second).backward()
        _loss(first).backward()         # eager raises where ``first`` saved an input
        kept.append((first, second))
    return kept


# --- patterns calling with other batch sizes (entries that accept new shapes) ---------

def _resized(args, k, n):
    """``_fresh(args, k)`` with the batch (the first input, of two or more dimensions) ``n`` rows long."""
    a = list(_fresh(args, k))
    x = a[0]
    if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) and x.dim() >= 2:
        shape = (n, *x.shape[1:])
        v = (torch.randn(shape, dtype=x.dtype, device=x.device) + k if x.is_floating_point()
             else x[:1].expand(shape).clone())
        a[0] = v.requires_grad_(x.requires_grad)
    return tuple(a)


@usage("other_batch_sizes_interleaved", reshapes=True)
def _(call, fn, args, kwargs):
    sizes, kept = (4, 6, 4, 5, 6), []
    calls = [_resized(args, k, n) for k, n in enumerate(sizes)]
    outs = []
    for a in calls:             # each replay of an earlier shape's recording may reuse later ones' memory
        outs.append(call(*a, **kwargs))
    for j in (1, 4, 0, 3, 2):
        _loss(outs[j]).backward()
    kept.append((outs, [_grads(fn, a) for a in calls]))
    return kept


@usage("other_batch_size_between_retained_backwards", reshapes=True)
def _(call, fn, args, kwargs):
    kept = []
    for k in range(2):
        small = _loss(call(*_resized(args, 3 * k, 4), **kwargs))
        small.backward(retain_graph=True)
        big = _loss(call(*_resized(args, 3 * k + 1, 6), **kwargs))
        again = _loss(call(*_resized(args, 3 * k + 2, 4), **kwargs))
        big.backward()
        small.backward()
        again.backward()
        kept.append(_grads(fn, ()))
    return kept
