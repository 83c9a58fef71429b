"""After the graph ran: replay input mutations on the real inputs and build
the user's outputs, regenerating outputs that alias inputs or intermediates
as real views (``epilogue`` generates this as code per analysis)."""
from __future__ import annotations

import sympy
import torch

from .._torch import set_version_counter
from ..generated import compile_source
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


def epilogue(analysis: Analysis, traced_with_grad: bool = True):
    """``(flat, values, symbols) -> outputs``: after the graph ran, write its new values into
    the real inputs as eager's in-place ops would, then build the user's flat outputs from the
    graph's forward values. Generated as straight-line code for this analysis (one line per
    mutated input and per output, no per-call dispatch on kinds), shown in tracebacks.
    ``traced_with_grad``: grad mode was enabled when the function was traced."""
    lines, scope = ["def epilogue(flat, values, symbols):"], {"_with_grad": traced_with_grad,
        "_meta": _write_metadata, "_data": _write_data, "_detached": _detached, "as_view": as_view,
        "_as_traced": _as_traced, "Tensor": torch.Tensor, "_symbol_map": _symbol_map}
    k = 0
    for i, info in enumerate(analysis.inputs):
        if info.mutates_metadata:
            scope[f"m{i}"] = info.new_meta
            lines.append(f"    _meta(flat[{i}], m{i}, symbols)")
        if info.mutates_data:
            lines.append(f"    _data(flat[{i}], values[{k}], {bool(info.mutation_needs_autograd)})")
            k += 1
    lines += _output_lines(analysis, scope)
    exec(compile_source("\n".join(lines), "epilogue"), scope)
    return scope["epilogue"]


def _output_lines(analysis: Analysis, scope: dict) -> list:
    infos = analysis.outputs
    n_mut = len(analysis.mutated())
    plain = [j for j, info in enumerate(infos) if info.kind == "plain"]
    lines = [f"    o{j} = values[{n_mut + p}]" for p, j in enumerate(plain)]
    base = n_mut + len(plain)
    for j, info in enumerate(infos):
        scope[f"i{j}"], kind = info, info.kind
        value = {"input": lambda: f"flat[{info.index}]",
                 "input_detached": lambda: f"_detached(flat[{info.index}], i{j}.view, symbols)",
                 "input_view": lambda: f"as_view(flat[{info.index}], i{j}, symbols)",
                 "output_view": lambda: f"as_view(o{info.index}, i{j}, symbols)",
                 "intermediate_view": lambda: f"as_view(values[{base + info.index}], i{j}, symbols)",
                 "constant": lambda: f"i{j}.value",
                 "symbolic": lambda: f"i{j}.value[0](i{j}.value[1].xreplace(_symbol_map(symbols)))",
                 "output": lambda: "None"}.get(kind)
        if value is not None:
            lines.append(f"    o{j} = {value()}")
    for j, info in enumerate(infos):
        if info.kind == "output":
            lines.append(f"    o{j} = o{info.index}")
        else:
            rg, leaf = bool(info.requires_grad), bool(info.is_leaf)
            lines.append(f"    if isinstance(o{j}, Tensor) and (o{j}.requires_grad != {rg}"
                         f"{f' or o{j}.grad_fn is not None' if rg and leaf else ''}):")
            lines.append(f"        o{j} = _as_traced(o{j}, i{j}, _with_grad)")
    return lines + [f"    return [{''.join(f'o{j}, ' for j in range(len(infos)))}]"]


def _write_metadata(x: torch.Tensor, meta: ViewMeta, symbols) -> None:
    with torch.no_grad():
        size, stride, offset = view_args(meta, symbols, x)
        version = x._version
        x.set_(x.untyped_storage(), offset, size, stride)   # as_strided_ would make x a view
        # Eager's t_() ran before the forward saved x for the backward; this replay runs
        # after, so it must not look like a write to what the backward reads.
        _set_version(x, version)


def _write_data(x: torch.Tensor, value: torch.Tensor, needs_autograd: bool) -> None:
    if value is x:      # the graph wrote it (passes/input_writes.py)
        return
    if needs_autograd and torch.is_grad_enabled() and value.requires_grad:
        x.copy_(value)
    else:
        with torch.no_grad():
            x.copy_(value)


def _set_version(t: torch.Tensor, version: int) -> None:
    set_version_counter(t, version)


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


def _as_traced(t: torch.Tensor, info, traced_with_grad: bool) -> torch.Tensor:
    """``requires_grad`` as the trace saw it, where the graph's autograd cannot give it:
    a non-differentiable output that shares storage with a differentiable one (``y.detach()``
    next to ``y``) is detached; an output that requires grad but reaches no input that does
    (``requires_grad_()`` inside, ``torch.ones(3, requires_grad=True)``) becomes a leaf that
    requires grad, or a non-leaf computed from one, as in eager. (A leaf made inside and returned
    gets no ``.grad`` from the other outputs' backward: the graph differentiates its inputs only.)
    A function traced with grad and called under ``no_grad`` keeps the graph's non-leaf outputs
    as they are, without history, as eager's are."""
    if not info.requires_grad:
        return t.detach()
    if info.is_leaf:
        return t.detach().requires_grad_() if t._base is None else t.requires_grad_()
    if traced_with_grad and not torch.is_grad_enabled():
        return t
    with torch.enable_grad():       # called under no_grad with an enable_grad region inside
        return t.detach().requires_grad_().clone()
