"""The ``torch.autograd.Function`` that runs a compiled forward and backward."""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .._torch import are_functorch_transforms_active, skipped_by_dynamo, traceable_subclass, without_dynamo
from .call import _is_view_op
from .hooks import RUNNING, install_input_hooks
from .modes import rng_states


def keep_inputs(primals) -> tuple:
    """What ``ctx`` keeps of the inputs: the inputs themselves (they live as long as the
    function's autograd node, as ``ctx.x = x`` in a custom Function does) and their
    versions, to notice an in-place write between the call and the second-order backward."""
    try:
        return primals, [p._version for p in primals]
    except AttributeError:      # sizes among the inputs (Dynamo passes SymInts/ints)
        return primals, [p._version if isinstance(p, torch.Tensor) else None for p in primals]


class BackwardGraph(NamedTuple):
    """What compiled autograd needs to trace this backward into its own graph."""
    graph: object          # fx.GraphModule: (*saved_tensors, *saved_symbols, *tangents) -> grads
    n_primals: int
    tangent_of: tuple
    grad_of: tuple


def autograd_function(fw, bw, n_primals: int, n_fw: int, n_saved_tensors: int,
                      tangent_of: tuple, grad_of: tuple, name: str = "CompiledFunction",
                      bw_graph=None, double_backward=None, input_hooks=(), retained=(), returned=(),
                      saved_views=(), reruns=False, zeroed=None, rewritten=()):
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
    as the input itself so autograd makes it a view of it, as eager does. ``saved_views``
    ``(k, i)``: saved tensor ``k`` is a view of primal ``i`` (``saved_input_views``). ``reruns``: eager's
    autograd saved nothing for this program, so a second backward through a call runs, as eager's does.
    ``zeroed``: ``missing -> backward`` taking only the tangents not at positions ``missing``
    (``passes.zero_tangents``); given, autograd hands ``None`` for an output with no gradient instead
    of zeros held through the whole backward. ``rewritten``: ``(line, saved)`` of a custom Function whose
    backward writes a tensor it holds (``Analysis.rewritten``): a second backward through a call raises.

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
        if zeroed is not None:
            ctx.set_materialize_grads(False)
        ctx.save_for_backward(*_saved(outs[n_fw:n_saved_end], primals, saved_views))
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

    def first_order(ctx, *grad_outputs):
        check_versions(ctx)
        # Where eager's nodes saved nothing (``a.add_(1)`` on a non-leaf every call writes again: each backward
        # goes through the earlier calls' nodes too) and this one saved nothing either, it runs again as they
        # do; otherwise reading ``ctx.saved_tensors`` of a released node raises eager's "backward through the
        # graph a second time".
        saved = ctx.saved_tensors if n_saved_tensors or not reruns else ()
        if rewritten:
            _once(ctx, *rewritten)
        tangents, run = [grad_outputs[k] for k in tangent_of], bw
        if zeroed is not None and any(t is None for t in tangents):
            run = zeroed(tuple(i for i, t in enumerate(tangents) if t is None))
            tangents = [t for t in tangents if t is not None]
        args = [*saved, *ctx.symbols, *map(_contiguous, tangents)]
        del saved, tangents     # held here, every saved activation would outlive its last use in the boxed backward
        # Drop ctx's own references (unless the graph is retained) so a boxed backward
        # frees each saved activation at its last use, as eager autograd does.
        ctx.maybe_clear_saved_tensors()
        if retained:
            ctx.outer = {slot: grad_outputs[k] for slot, k in retained}
            RUNNING.append(ctx)
        try:
            grads = run(args) if getattr(run, "_boxed_call", False) else run(*args)
        finally:
            if retained:
                RUNNING.pop()
        return _by_primal(grads, grad_of, n_primals)

    guarded = once_differentiable(first_order)

    def differentiable(ctx, *grad_outputs):
        check_versions(ctx)
        return _by_primal(second_order(ctx.kept, ctx.rng, grad_outputs), grad_of, n_primals)

    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():     # only under create_graph=True
            return (guarded if second_order is None else differentiable)(ctx, *grad_outputs)
        return first_order(ctx, *grad_outputs)

    skipped_by_dynamo()
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(without_dynamo(backward)),
        # Read by aotgrad/compiled_autograd to inline this backward into its graph.
        "_aotgrad_backward": None if bw_graph is None else
        BackwardGraph(bw_graph, n_primals, tuple(tangent_of), tuple(grad_of))})


def version_checks(fn_class, watched: tuple):
    """``after(flat, values)`` for ``make_call``: once a call has written its inputs back, the version of
    each input in ``watched`` (saved by eager's autograd, not by the compiled forward as itself: an input
    the program writes, whose new value the graph saves) goes on the call's backward node, and its
    backward raises eager's error if one was written since. None when nothing is watched."""
    if not watched:
        return None
    node_class = fn_class._backward_cls

    def after(flat, values):
        node = next((v.grad_fn for v in values if isinstance(v, torch.Tensor) and type(v.grad_fn) is node_class),
                    None)
        if node is not None:
            node.aotgrad_versions = [(flat[i], flat[i]._version) for i in watched if not flat[i].is_inference()]
    return after


def check_versions(ctx) -> None:
    """Eager's version-counter check for the inputs ``version_checks`` watches."""
    for t, version in getattr(ctx, "aotgrad_versions", ()):
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}], an input of the compiled function, is at version {t._version}; "
                f"expected version {version} instead. Hint: the input was written in place after the call that "
                "saved it for the backward (as eager autograd raises).")


def _once(ctx, line, saved: bool) -> None:
    """A custom backward in the program wrote a tensor it holds: eager's next backward through the call
    (``retain_graph=True``) raises reading it, a saved one, or reads its written value, where the compiled
    backward would read the forward's."""
    if not getattr(ctx, "aotgrad_ran", False):
        ctx.aotgrad_ran = True
    elif saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor the custom autograd.Function at {line} saved, written by its backward when it ran before "
            "(as eager autograd raises).")
    else:
        from ..errors import UnsupportedError
        raise UnsupportedError(
            "a second backward through a call whose custom autograd.Function's backward wrote a tensor it keeps "
            "on ctx: eager's reads the written value, the compiled backward the forward's", user_line=line)


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


def saved_input_views(fw_gm, n_fw: int, n_saved: int, relaid=frozenset()) -> tuple:
    """``(k, i)`` for each saved tensor ``k`` the forward graph makes by view ops from its input
    ``i`` (a weight's ``t()``). A backend may hand it back as a tensor of its own over the input's
    memory (Inductor's ``reinterpret_tensor``), without the input's version counter. An input in
    ``relaid`` (the epilogue changes its layout or storage: ``t_()``, ``set_()``) counts when it is
    saved itself too: the backward reads it as the graph had it, an alias taken before the epilogue."""
    phs = {p: i for i, p in enumerate(fw_gm.graph.find_nodes(op="placeholder"))}
    found = []
    for k, node in enumerate(fw_gm.graph.find_nodes(op="output")[0].args[0][n_fw:n_fw + n_saved]):
        view = node
        while getattr(view, "op", None) == "call_function" and _is_view_op(view):
            view = view.args[0]
        if view in phs and (view is not node or phs[view] in relaid):
            found.append((k, phs[view]))
    return tuple(found)


def _saved(tensors, primals, saved_views) -> list:
    """What the backward reads, made to share eager's version counters: a saved view of an input is
    an alias of the caller's tensor, and no saved tensor is a view made under ``no_grad`` (this
    forward runs without grad), whose base written in place would raise another error than eager's
    version-counter one ("one of the variables needed for gradient computation has been modified")."""
    tensors = list(tensors)
    for k, i in saved_views:
        t, p = tensors[k], primals[i]
        if t._base is p or t._base is not None and t._base is p._base:
            continue        # a view of the caller's tensor already (the eager backend's ``t()``): its counter
        if t.dtype == p.dtype and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            tensors[k] = p.detach().as_strided(t.shape, t.stride(), t.storage_offset())
    return [t.detach() if isinstance(t, torch.Tensor) and t._base is not None else t for t in tensors]


def _contiguous(g):
    # Traced tangents were contiguous; incoming grads (of a transposed output, say) may not be.
    if type(g) is not torch.Tensor and traceable_subclass(g):
        _subclass_tangent(g)
    return g if g.is_contiguous() else g.contiguous()


def _subclass_tangent(g):
    """A plain output's incoming gradient is a subclass (the loss mixed it with a TwoTensor): the backward
    was traced for a plain one, and compiled kernels would read the subclass's missing storage."""
    from ..errors import UnsupportedError, caller_line
    raise UnsupportedError(
        f"the gradient reaching a plain output of the compiled function is a {type(g).__name__} (the loss "
        f"combined that output with a {type(g).__name__}): its backward was traced for a plain gradient; "
        "make the output itself that subclass, or combine the outputs after .backward()", user_line=caller_line())
