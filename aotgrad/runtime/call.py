"""The per-call path of a compiled function: flatten the user's arguments,
check them against the input guards, run the graph, replay mutations,
rebuild outputs."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..errors import InputMismatchError
from .epilogue import apply_mutations, build_outputs


def make_call(captured, run):
    setup = captured.setup
    sig = setup.signature
    analysis = captured.analysis
    guards = captured.guards
    slots = tuple((s.module._parameters if s.is_param else s.module._buffers, s.attr) for s in sig.slots)
    const = tuple((i, v) for i, v in enumerate(sig.leaves) if i not in set(sig.tensor_pos))
    tensor_pos = sig.tensor_pos
    in_spec, out_spec = sig.in_spec, captured.out_spec
    needs_symbols = _needs_symbols(analysis)
    has_epilogue = any(i.mutates_data or i.mutates_metadata for i in analysis.inputs)
    simple_outputs = all(o.kind == "plain" for o in analysis.outputs) and not has_epilogue
    grad_guard = captured.is_inference and not setup.session.grad_enabled

    def call(*args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != in_spec:
            raise InputMismatchError(f"arguments have structure {spec}, captured with {in_spec}")
        for i, v in const:
            if leaves[i] != v:
                raise InputMismatchError(f"non-tensor argument {i} was {v!r} when captured, now {leaves[i]!r}")
        flat = [d[a] for d, a in slots] + [leaves[p] for p in tensor_pos]
        guards(flat)
        if grad_guard and torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            raise InputMismatchError("captured with grad disabled (an inference graph); call it under torch.no_grad() or capture with grad enabled")
        values = run(flat)
        if simple_outputs:
            return pytree.tree_unflatten(list(values), out_spec)
        symbols = guards.bind(flat) if needs_symbols else None
        apply_mutations(flat, values, analysis, symbols)
        return pytree.tree_unflatten(build_outputs(flat, values, analysis, symbols), out_spec)

    return call


def _needs_symbols(analysis) -> bool:
    metas = [o.view for o in analysis.outputs if o.view is not None]
    metas += [i.new_meta for i in analysis.inputs if i.new_meta is not None]
    return any(not m.is_static for m in metas)
