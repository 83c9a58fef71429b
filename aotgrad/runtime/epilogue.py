"""After the graph ran: replay input mutations on the real inputs and build
the user's outputs, regenerating outputs that alias inputs or intermediates
as real views."""
from __future__ import annotations

import sympy
import torch

from ..analysis.metadata import Analysis, ViewMeta


def _symbol_map(symbols) -> dict:
    return {sympy.Symbol(k, integer=True, positive=True): v for k, v in symbols.items()} | \
        {sympy.Symbol(k, integer=True): v for k, v in symbols.items()}


def _concrete(x, symbols):
    if isinstance(x, (int, float)):
        return x
    return int(x.xreplace(_symbol_map(symbols)))


def view_args(meta: ViewMeta, symbols):
    if symbols is None:
        return meta.size, meta.stride, meta.offset
    return (tuple(_concrete(s, symbols) for s in meta.size),
            tuple(_concrete(s, symbols) for s in meta.stride), _concrete(meta.offset, symbols))


def as_view(base: torch.Tensor, meta: ViewMeta, requires_grad: bool, symbols):
    if base.requires_grad and not requires_grad:
        base = base.detach()        # e.g. ``x.detach()``: shares storage, no autograd link
    return base.as_strided(*view_args(meta, symbols))


def apply_mutations(flat, values, analysis: Analysis, symbols) -> None:
    """Write the graph's new values into the real inputs, as eager's in-place ops would."""
    k = 0
    for i, info in enumerate(analysis.inputs):
        if not (info.mutates_data or info.mutates_metadata):
            continue
        x = flat[i]
        if info.mutates_metadata:
            with torch.no_grad():
                x.as_strided_(*view_args(info.new_meta, symbols))
        if info.mutates_data:
            if info.mutation_needs_autograd and torch.is_grad_enabled() and values[k].requires_grad:
                x.copy_(values[k])
            else:
                with torch.no_grad():
                    x.copy_(values[k])
            k += 1


def build_outputs(flat, values, analysis: Analysis, symbols) -> list:
    """The user's flat outputs from the graph's forward values."""
    infos = analysis.outputs
    n_mut = len(analysis.mutated())
    n_plain = sum(info.kind == "plain" for info in infos)
    plain = iter(values[n_mut:n_mut + n_plain])
    bases = values[n_mut + n_plain:]
    outs = [next(plain) if info.kind == "plain" else None for info in infos]
    for j, info in enumerate(infos):
        kind = info.kind
        if kind == "input":
            outs[j] = flat[info.index]
        elif kind == "input_view":
            outs[j] = as_view(flat[info.index], info.view, info.requires_grad, symbols)
        elif kind == "output_view":
            outs[j] = as_view(outs[info.index], info.view, info.requires_grad, symbols)
        elif kind == "intermediate_view":
            outs[j] = as_view(bases[info.index], info.view, info.requires_grad, symbols)
        elif kind == "constant":
            outs[j] = info.value
        elif kind == "symbolic":
            outs[j] = info.value[0](info.value[1].xreplace(_symbol_map(symbols)))
    for j, info in enumerate(infos):
        if info.kind == "output":
            outs[j] = outs[info.index]
    return outs
