"""The ``torch.autograd.Function`` that runs a compiled forward and backward."""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .._torch import are_functorch_transforms_active
from .hooks import RUNNING, install_input_hooks
from .double_backward import keep_inputs, rng_states


class BackwardGraph(NamedTuple):
    """What compiled autograd needs to trace this backward into its own graph."""
    graph: object          # fx.GraphModule: (*saved_tensors, *saved_symbols, *tangents) -> grads
    n_primals: int
    tangent_of: tuple
    grad_of: tuple


def autograd_function(fw, bw, n_primals: int, n_fw: int, n_saved_tensors: int,
                      tangent_of: tuple, grad_of: tuple, name: str = "CompiledFunction",
                      bw_graph=None, double_backward=None, input_hooks=(), retained=(), returned=()):
    """An autograd.Function class whose forward runs ``fw`` and backward ``bw``.

    Saved intermediates carry no history (the forward graph runs without
    autograd), so differentiating ``bw`` would silently miss terms. Under
    ``create_graph=True`` the grads come from ``double_backward``, a pair
    ``(run(kept_inputs, rng_states, grad_outputs) -> grads, needs_rng)`` (see
    runtime/double_backward.py); without one they come from ``once_differentiable``
    and raise if differentiated. ``input_hooks`` are registered on the real inputs by
    every call, as the program registered them (runtime/hooks.py); ``retained``
    ``(slot, k)``: forward value ``k`` called retain_grad inside the program, and the
    backward's ``aotgrad::retain_grad`` node for ``slot`` sets its ``.grad``; ``returned``
    ``(k, i)``: forward value ``k`` is input ``i`` returned by a custom Function, returned
    as the input itself so autograd makes it a view of it, as eager does.

    ``fw(*primals) -> (*fw_values, *saved_tensors, *saved_symbols)``;
    ``bw(*saved_tensors, *saved_symbols, *tangents) -> grads of primals in grad_of``.
    """
    n_saved_end = n_fw + n_saved_tensors
    nondiff = tuple(k for k in range(n_fw) if k not in set(tangent_of))
    second_order, needs_rng = double_backward if double_backward is not None else (None, False)

    def forward(ctx, *primals):
        if second_order is not None:
            ctx.kept = keep_inputs(primals)
            ctx.rng = rng_states() if needs_rng else None
        if input_hooks:
            install_input_hooks(input_hooks, primals)
        outs = fw(*primals)
        ctx.save_for_backward(*outs[n_fw:n_saved_end])
        ctx.symbols = outs[n_saved_end:]
        fw_values = outs[:n_fw]
        if returned:
            fw_values = list(fw_values)
            for k, i in returned:
                fw_values[k] = primals[i]
        if retained:
            ctx.retained = {slot: weakref.ref(fw_values[k]) for slot, k in retained}
        if nondiff:
            ctx.mark_non_differentiable(*[fw_values[k] for k in nondiff])
        return tuple(fw_values)

    boxed = getattr(bw, "_boxed_call", False)

    def first_order(ctx, *grad_outputs):
        args = [*ctx.saved_tensors, *ctx.symbols, *(_contiguous(grad_outputs[k]) for k in tangent_of)]
        # Drop ctx's own references (unless the graph is retained) so a boxed backward
        # frees each saved activation at its last use, as eager autograd does.
        ctx.maybe_clear_saved_tensors()
        if retained:
            ctx.outer = {slot: grad_outputs[k] for slot, k in retained}
            RUNNING.append(ctx)
        try:
            grads = bw(args) if boxed else bw(*args)
        finally:
            if retained:
                RUNNING.pop()
        return _by_primal(grads, grad_of, n_primals)

    guarded = once_differentiable(first_order)

    def differentiable(ctx, *grad_outputs):
        return _by_primal(second_order(ctx.kept, ctx.rng, grad_outputs), grad_of, n_primals)

    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():     # only under create_graph=True
            return (guarded if second_order is None else differentiable)(ctx, *grad_outputs)
        return first_order(ctx, *grad_outputs)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        # Read by aotgrad/compiled_autograd to inline this backward into its graph.
        "_aotgrad_backward": None if bw_graph is None else
        BackwardGraph(bw_graph, n_primals, tuple(tangent_of), tuple(grad_of))})


def _by_primal(grads, grad_of, n_primals) -> tuple:
    full = [None] * n_primals
    for i, g in zip(grad_of, grads):
        full[i] = g
    return tuple(full)


def retaining(run, positions):
    """``run`` whose outputs at ``positions`` retain their grad, as the program asked inside."""
    def run_retaining(flat):
        outs = run(flat)
        for k in positions:
            outs[k].retain_grad()
        return outs
    return run_retaining


def fast_apply(fn_class):
    """``fn_class.apply`` without the Python-level wrapper (functorch bookkeeping,
    setup_context binding) that a Function with a plain ``forward(ctx, ...)`` does
    not need; the full path is kept for when functorch transforms are active."""
    c_apply = super(torch.autograd.Function, fn_class).apply
    full = fn_class.apply
    active = are_functorch_transforms_active

    def apply(flat):
        return full(*flat) if active() else c_apply(*flat)
    return apply


def _contiguous(g):
    # Traced tangents were contiguous; incoming grads (of a transposed output, say) may not be.
    return g if g.is_contiguous() else g.contiguous()
