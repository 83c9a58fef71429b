"""After the graph ran: replay input mutations on the real inputs and build
the user's outputs, regenerating outputs that alias inputs or intermediates
as real views."""
from __future__ import annotations

import sympy
import torch

from ..ir.records import Analysis, ViewMeta


def _symbol_map(symbols) -> dict:
    return {sympy.Symbol(k, integer=True, positive=True): v for k, v in symbols.items()} | \
        {sympy.Symbol(k, integer=True): v for k, v in symbols.items()}


def _concrete(x, symbols):
    if isinstance(x, (int, float)):
        return x
    return int(x.xreplace(_symbol_map(symbols)))


def view_args(meta: ViewMeta, symbols, base: torch.Tensor):
    """``as_strided`` arguments of ``meta`` (a ``ViewMeta.relative``) on ``base``."""
    if symbols is None:
        return meta.size, meta.stride, base.storage_offset() + meta.offset
    return (tuple(_concrete(s, symbols) for s in meta.size),
            tuple(_concrete(s, symbols) for s in meta.stride),
            base.storage_offset() + _concrete(meta.offset, symbols))


def as_view(base: torch.Tensor, info, symbols):
    """Output ``info`` regenerated as a real view of ``base``: its view ops replayed, or ``as_strided``."""
    if base.requires_grad and not info.requires_grad:
        base = base.detach()        # e.g. ``x.detach()``: shares storage, no autograd link
    if info.replay is not None:
        return info.replay.apply(base)
    return base.as_strided(*view_args(info.view, symbols, base))


def apply_mutations(flat, values, analysis: Analysis, symbols) -> None:
    """Write the graph's new values into the real inputs, as eager's in-place ops would."""
    k = 0
    for i, info in enumerate(analysis.inputs):
        if not (info.mutates_data or info.mutates_metadata):
            continue
        x = flat[i]
        if info.mutates_metadata:
            with torch.no_grad():
                size, stride, offset = view_args(info.new_meta, symbols, x)
                version = x._version
                x.set_(x.untyped_storage(), offset, size, stride)   # as_strided_ would make x a view
                # Eager's t_() ran before the forward saved x for the backward; this replay runs
                # after, so it must not look like a write to what the backward reads.
                _set_version(x, version)
        if info.mutates_data:
            if info.mutation_needs_autograd and torch.is_grad_enabled() and values[k].requires_grad:
                x.copy_(values[k])
            else:
                with torch.no_grad():
                    x.copy_(values[k])
            k += 1


def _set_version(t: torch.Tensor, version: int) -> None:
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:           # torch < 2.12 takes one tensor
        torch._C._autograd._unsafe_set_version_counter(t, version)


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
        elif kind == "input_detached":
            outs[j] = _detached(flat[info.index], info.view, symbols)
        elif kind == "input_view":
            outs[j] = as_view(flat[info.index], info, symbols)
        elif kind == "output_view":
            outs[j] = as_view(outs[info.index], info, symbols)
        elif kind == "intermediate_view":
            outs[j] = as_view(bases[info.index], info, symbols)
        elif kind == "constant":
            outs[j] = info.value
        elif kind == "symbolic":
            outs[j] = info.value[0](info.value[1].xreplace(_symbol_map(symbols)))
    for j, info in enumerate(infos):
        if info.kind == "output":
            outs[j] = outs[info.index]
        elif isinstance(outs[j], torch.Tensor) and (outs[j].requires_grad != info.requires_grad or (
                info.requires_grad and info.is_leaf and outs[j].grad_fn is not None)):
            outs[j] = _as_traced(outs[j], info)
    return outs


def _detached(x: torch.Tensor, meta: ViewMeta, symbols) -> torch.Tensor:
    out = x.detach()
    size, stride, offset = view_args(meta, symbols, x)
    if (tuple(out.shape), out.stride(), out.storage_offset()) != (tuple(size), tuple(stride), offset):
        out.set_(out.untyped_storage(), offset, size, stride)     # detached after a metadata change
    return out


def eager_layout(fw, analysis, fw_gm):
    """``fw`` whose plain outputs are not views where eager's are not: functionalization turns an
    in-place metadata change of an intermediate (``y.t_()``) into a view op, and an autograd view
    of a graph temporary would come back where eager returns a tensor of its own. Detached, it
    keeps its storage, strides and version counter.
    (Not covered: an output eager writes in place with its input's strides, ``x.index_add_`` on a
    transposed ``x``, is laid out by the functional op; functionalization reports those strides too.)"""
    made = fw_gm.graph.find_nodes(op="output")[0].args[0]
    unview = tuple(k for k, o in analysis.plain() if not o.is_view and _is_view_op(made[k]))
    if not unview:
        return fw

    def call(*args):
        outs = list(fw(*args))
        for k in unview:
            if outs[k]._is_view():
                outs[k] = outs[k].detach()
        return outs
    call._boxed_call = getattr(fw, "_boxed_call", False)
    return call


def _is_view_op(node) -> bool:
    schema = getattr(getattr(node, "target", None), "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _as_traced(t: torch.Tensor, info) -> torch.Tensor:
    """``requires_grad`` as the trace saw it, where the graph's autograd cannot give it:
    a non-differentiable output that shares storage with a differentiable one (``y.detach()``
    next to ``y``) is detached; an output that requires grad but reaches no input that does
    (``requires_grad_()`` inside, ``torch.ones(3, requires_grad=True)``) becomes a leaf that
    requires grad, or a non-leaf computed from one, as in eager. (A leaf made inside and returned
    gets no ``.grad`` from the other outputs' backward: the graph differentiates its inputs only.)"""
    if not info.requires_grad:
        return t.detach()
    if info.is_leaf:
        return t.detach().requires_grad_() if t._base is None else t.requires_grad_()
    with torch.enable_grad():       # called under no_grad with an enable_grad region inside
        return t.detach().requires_grad_().clone()
