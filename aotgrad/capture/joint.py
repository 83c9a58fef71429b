"""Trace the joint forward+backward function into one functional ATen graph.

The joint function takes ``(*primals, *tangents)`` and returns
``(*forward_values, *grads)`` where the forward values are, in order, the new
values of data-mutated inputs, the plain outputs and the hidden bases of
outputs that are views of intermediates (see :mod:`aotgrad.ir.records`).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch import lazy_graph_modules, register_stack_trace_anchor
from ..ir.records import Analysis, JointLayout, forward_values
from ..runtime.modes import autocast_off
from ..frontend.flatten import module_state
from ..passes.rng_positions import backward_begins
from .block_graph import DIRECT, Direct
from .session import Session, traceable_ops, from_functional, functional_mode, to_functional


def joint_function(flat_fn, analysis: Analysis, lay: JointLayout, grad_enabled: bool,
                   direct_grads: bool = False):
    """``direct_grads``: repeated blocks hand their inputs' gradients straight to the output
    (see :class:`.block_graph.Direct`); the trace must go through :func:`.inline_blocks`."""
    def joint(*flat):
        primals, tangents = flat[:lay.n_primals], flat[lay.n_primals:]
        with functional_mode():
            f_ins = [to_functional(p) for p in primals]
            # Mutating a clone keeps the original value for autograd.grad to differentiate.
            call_ins = [f.clone() if info.mutates_data and info.requires_grad else f
                        for f, info in zip(f_ins, analysis.inputs)]
            n = len(lay.grad_of)
            direct = Direct({id(call_ins[i]): k - n for k, i in enumerate(lay.grad_of)
                             if call_ins[i] is f_ins[i]} if direct_grads else {})
            DIRECT.append(direct)
            try:
                with torch.set_grad_enabled(grad_enabled):
                    outs = flat_fn(*call_ins)
                fw = forward_values(call_ins, outs, analysis)
                grads = []
                if lay.grad_of:
                    backward_begins()
                    direct.backward = True
                    # The backward runs where .backward() is called, outside the caller's autocast
                    # (autocast regions are for the forward): its casts are the forward's alone.
                    with module_state(flat_fn, call_ins), autocast_off():
                        grads = torch.autograd.grad(
                            [fw[i] for i in lay.tangent_of], [f_ins[i] for i in lay.grad_of],
                            [to_functional(t) for t in tangents], allow_unused=True)
            finally:
                DIRECT.pop()
            return [from_functional(v) for v in fw] + [from_functional(g) for g in grads]
    return joint


def _anchor_user_frames(user_fn) -> None:
    """make_fx keeps stack frames of ``forward`` methods; also keep a plain user function's own frames."""
    if callable(user_fn) and hasattr(user_fn, "__code__"):
        register_stack_trace_anchor(user_fn)


def trace_joint(session: Session, flat_fn, fake_inputs, analysis: Analysis,
                lay: JointLayout, user_fn=None, direct_grads: bool = False) -> torch.fx.GraphModule:
    with session.fake_mode:
        tangents = [torch.empty_strided(analysis.fake_outputs[i].shape,
                                        _contiguous_strides(analysis.fake_outputs[i].shape),
                                        dtype=analysis.fake_outputs[i].dtype,
                                        device=analysis.fake_outputs[i].device)
                    for i in lay.tangent_of]
    fn = joint_function(flat_fn, analysis, lay, session.grad_enabled, direct_grads)
    _anchor_user_frames(user_fn)
    # Inside fake mode, factory ops (torch.rand(3)) become graph nodes instead of
    # running for real (which would bake a constant and consume the real RNG).
    # An explicit (empty) decomposition table: without one, torch >= 2.14.1 turns every
    # aten.detach into aten.alias, which the clean-up cannot tell from a user's alias.
    # A lazy graph module writes its Python code only when someone reads or runs it: capture edits
    # the joint and the partitioner builds new graphs from it, so that code would be written for nothing.
    with session.fake_mode, traceable_ops(), lazy_graph_modules():
        return make_fx(fn, decomposition_table={}, pre_dispatch=False, record_stack_traces=True,
                       _allow_non_fake_inputs=True)(*fake_inputs, *tangents)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc = acc * s
    return tuple(reversed(strides))
