"""The loader's checks of decoded graphs, before anything runs (docs/export-format.md, "Loading
is safe by construction"): every node calls what the operator allowlist admits
(:func:`.sandbox.refusal`), the manifest's operator table is exactly the graphs' operators, the
graphs fit together (the forward's saved values are the backward's inputs, the joint's inputs
are the guards') and every node's recorded value is what its operator computes from the values
before it, run on fake tensors. A step whose real inputs pass the guards then runs each operator
on tensors of the shapes, strides and dtypes it was checked with: a consistently edited shape is
an ``ExportFormatError`` here, never an error inside a running graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import types

import torch
import torch.fx as fx

from .._torch import OpOverload, data_dependent_errors
from ..ir.ops import returns_fresh
from ..errors import ExportFormatError
from ..ir.records import layout, reach
from ..ir.values import STORED, FakeValues, TensorMeta
from ..store import codec, sandbox

_UNKNOWN = object()     # a value only the data decides (``item()``): its dependents are not checked


def check_graphs(ops: dict, graphs: dict, specs, lay, part, analysis) -> None:
    """``graphs``: name -> decoded GraphModule (``joint``, and ``forward``/``backward`` for training)."""
    for name, gm in graphs.items():
        _check_nodes(name, gm)
    called = codec.op_schemas(graphs.values())
    if set(called) != set(ops):
        extra, missing = sorted(set(called) - set(ops)), sorted(set(ops) - set(called))
        raise ExportFormatError(f"the artifact's operator table does not list exactly the operators its graphs call "
                                f"(called but not listed: {extra[:5]}; listed but not called: {missing[:5]})")
    _check_wiring(graphs, specs, lay, part)
    _check_analysis(analysis, lay, specs, [n.meta.get(STORED) for n in _outputs(graphs["joint"])[:lay.n_fw]])
    # The forward's saved symbols (sizes or numbers only the data decides) are the backward's only
    # inputs that need not be tensors.
    symbols = set(part.saved[part.n_saved_tensors:]) if part is not None else set()
    values, computed = FakeValues({}, unbacked=True), {}     # one fake mode: the forward's symbols reach the backward
    # An admitted operator without a meta kernel (``multi_margin_loss_backward``) runs its real kernel
    # on zeros of the shapes verified so far (fake tensors' fallback): what the step will run on its inputs.
    values.mode().allow_fallback_kernels = True
    for name, gm in graphs.items():
        computed = _propagate(name, gm, values, {k: computed.get(k, _UNKNOWN) for k in symbols}
                              if name == "backward" else {})
        _check_extents(name, gm)


def _check_nodes(name: str, gm: fx.GraphModule) -> None:
    nodes = list(gm.graph.nodes)
    if not nodes or nodes[-1].op != "output" or sum(n.op == "output" for n in nodes) != 1:
        raise ExportFormatError(f"the artifact's {name} graph does not end in one output")
    for n in nodes:
        if n.op == "call_function":
            ok = n.target in sandbox.PY_FUNCTIONS or sandbox.refusal(n.target) is None
            if _name(n) == "aotgrad::set_rng_state.default":    # restores only a state this graph read
                state = n.args[0] if n.args else None
                ok = isinstance(state, fx.Node) and _name(state) == "aotgrad::rng_state.default" \
                    and state.args == n.args[1:] and not n.kwargs
        else:
            ok = n.op in ("placeholder", "output") or (n.op == "get_attr" and isinstance(
                getattr(gm, n.target, None), torch.Tensor))
        if not ok:
            raise ExportFormatError(f"node {n.name} of the artifact's {name} graph is a {n.op} of {n.target!r:.60}, "
                                    "which the format does not allow")


def _name(n: fx.Node) -> str | None:
    return sandbox.qualified_name(n.target) if n.op == "call_function" and n.target not in sandbox.PY_FUNCTIONS else None


def _placeholders(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _check_wiring(graphs: dict, specs, lay, part) -> None:
    joint = graphs["joint"]
    primals = _placeholders(joint)[:lay.n_primals]
    if len(_placeholders(joint)) != lay.n_primals + len(lay.tangent_of) \
            or len(_outputs(joint)) != lay.n_fw + len(lay.grad_of) \
            or not all(0 <= k < lay.n_fw for k in lay.tangent_of) \
            or not all(0 <= i < lay.n_primals for i in (*lay.grad_of, *lay.mutated)):
        raise ExportFormatError("the artifact's joint graph and layout disagree on its inputs and outputs")
    for node, spec in zip(primals, specs):
        want = TensorMeta(tuple(spec.size), tuple(spec.layout[:-1]), spec.layout[-1], spec.dtype, str(spec.device),
                          False)
        if not _same(node.meta.get(STORED), want):
            raise ExportFormatError(f"input {node.name} of the artifact's joint graph is recorded as "
                                    f"{node.meta.get(STORED)}, its guard says {want}")
    if part is not None:
        fw, bw, saved = graphs["forward"], graphs["backward"], list(part.saved)
        fw_out, bw_in = _outputs(fw), _placeholders(bw)
        if [n.name for n in _placeholders(fw)] != [n.name for n in primals] \
                or len(fw_out) != lay.n_fw + len(saved) or not 0 <= part.n_saved_tensors <= len(saved) \
                or [getattr(n, "name", None) for n in fw_out[lay.n_fw:]] != saved \
                or [n.name for n in bw_in] != saved + [n.name for n in _placeholders(joint)[lay.n_primals:]] \
                or len(_outputs(bw)) != len(lay.grad_of):
            raise ExportFormatError("the artifact's forward and backward graphs do not fit its joint graph "
                                    "(inputs, saved values or gradients)")
    recorded = {n.name: n.meta.get(STORED) for n in joint.graph.nodes}
    for name, gm in graphs.items():     # one node name, one value, in every graph
        for n in gm.graph.nodes:
            if n.op != "output" and n.name in recorded and not _same(n.meta.get(STORED), recorded[n.name]):
                raise ExportFormatError(f"node {n.name} has one value in the joint graph and another in the {name} graph")


def _check_analysis(analysis, lay, specs, fw_values: list) -> None:
    """The analysis the runtime's epilogue is generated from agrees with the layout and the graph: it
    writes each mutated input a value of its own size and dtype, takes each output from a position
    that exists, and the layout is the one ``records.layout`` derives from it."""
    infos, n_mut = analysis.outputs, len(analysis.mutated())
    plain = [o for o in infos if o.kind == "plain"]
    bounds = {"input": lay.n_primals, "input_view": lay.n_primals, "input_detached": lay.n_primals,
              "input_set": lay.n_primals, "intermediate_view": analysis.base_count}
    dtypes = tuple(types.SimpleNamespace(dtype=getattr(v, "dtype", torch.int64)) for v in fw_values)
    expected = layout(dataclasses.replace(analysis, fake_outputs=dtypes)) \
        if len(analysis.fw_requires_grad) == lay.n_fw == n_mut + len(plain) + analysis.base_count else None
    if expected != lay or not all(
            0 <= o.index < bounds[o.kind] if o.kind in bounds else
            # the same object as an earlier output (any output of its own: a view of an input returned
            # twice too), or a view of a plain one
            0 <= o.index < p and infos[o.index].kind not in ("output", "output_view") if o.kind == "output" else
            0 <= o.index < len(infos) and infos[o.index].kind == "plain" if o.kind == "output_view" else
            True for p, o in enumerate(infos)):
        raise ExportFormatError("the artifact's analysis of its inputs and outputs disagrees with its layout")
    if specs is not None and (len(specs) != len(analysis.inputs) or any(
            bool(info.requires_grad) != (bool(spec.requires_grad) or info.sets_requires_grad)
            for info, spec in zip(analysis.inputs, specs))):       # (``requires_grad_()`` inside: set before the graph)
        raise ExportFormatError("the artifact's input guards and its analysis disagree on which inputs require grad "
                                "(the graphs differentiate the analysis's)")
    if any(info.mutates_metadata != (info.new_meta is not None) for info in analysis.inputs):
        raise ExportFormatError("the artifact's analysis has a metadata mutation without its new metadata")
    if not all(0 <= i < lay.n_primals for i in analysis.eager_saved) \
            or not set(analysis.quiet_writes) <= {i for i, info in enumerate(analysis.inputs) if info.mutates_data}:
        raise ExportFormatError("the artifact's analysis names inputs eager saves or writes without a version bump "
                                "that are not among its inputs (or not written)")
    for k, i in enumerate(analysis.mutated()):
        info, v, spec = analysis.inputs[i], fw_values[k], specs[i]
        size = info.new_meta.size if info.mutates_metadata and info.new_meta is not None else tuple(spec.size)
        if not isinstance(v, TensorMeta) or v.shape != size or v.dtype != spec.dtype:
            raise ExportFormatError(f"the artifact's graph writes input {i} a value {v} that is not of its size "
                                    f"{size} and dtype {spec.dtype}")
    for k, o in analysis.plain():
        if k in lay.tangent_of and not o.requires_grad:     # the epilogue would detach what autograd must reach
            raise ExportFormatError(f"the artifact's output {k} has a tangent but is recorded with requires_grad=False")


def _same(a, b) -> bool:
    """Equal values, ``requires_grad`` aside (the partitioned graphs run without autograd)."""
    if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
        return (a.shape, a.stride, a.offset, a.dtype, a.device) == (b.shape, b.stride, b.offset, b.dtype, b.device)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _propagate(name: str, gm: fx.GraphModule, values: FakeValues, symbols: dict) -> dict:
    """Run ``gm`` on fake tensors from its recorded inputs (``symbols``: inputs that are numbers, by
    name); every recorded value must come out. Returns each node's value by name."""
    mode, env = values.mode(), {}
    for n in gm.graph.nodes:
        stored = n.meta.get(STORED)
        if n.op == "placeholder":
            if not isinstance(stored, TensorMeta) and n.name not in symbols:
                raise ExportFormatError(f"input {n.name} of the artifact's {name} graph has no recorded tensor value")
            env[n] = values.rebuild(stored) if isinstance(stored, TensorMeta) else symbols[n.name]
        elif n.op == "get_attr":
            env[n] = mode.from_tensor(getattr(gm, n.target))
        elif n.op == "call_function":
            env[n] = _run(name, n, env, mode, values)
        if n.op == "call_function" and not _dense(env[n]):
            raise ExportFormatError(f"node {n.name} of the artifact's {name} graph makes a sparse, quantized or "
                                    f"MKL-DNN tensor with {n.target}: a loaded step computes dense tensors only")
        if n.op != "output" and stored is not None and env[n] is not _UNKNOWN and not _matches(env[n], stored):
            if _offset_only(n, env[n], stored):
                env[n] = values.rebuild(stored)
                continue
            raise ExportFormatError(f"node {n.name} of the artifact's {name} graph is recorded as {stored}, but "
                                    f"{n.target} computes {_describe(env[n])} from the values before it")
    return {n.name: v for n, v in env.items()}


def _offset_only(n: fx.Node, value, stored) -> bool:
    """A new tensor (not a view) recorded at another storage offset than fake tensors compute: the
    offset of a fresh result is its kernel's business (``aten.copy`` on a slice clones the slice's
    whole storage and keeps its offset; traced through functionalization it is recorded at 0). What
    follows it is checked from the recorded value."""
    return returns_fresh(n.target) and isinstance(stored, TensorMeta) and isinstance(value, torch.Tensor) \
        and _matches(value, dataclasses.replace(stored, offset=value.storage_offset()))


def _run(name, n, env, mode, values):
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
    stored = n.meta.get(STORED)
    if _has_unknown((args, kwargs)):
        return values.rebuild(stored) if isinstance(stored, TensorMeta) else _UNKNOWN
    try:
        with mode, _quiet():
            return n.target(*args, **kwargs)
    except data_dependent_errors():
        return values.rebuild(stored) if isinstance(stored, TensorMeta) else _UNKNOWN
    except Exception as e:      # noqa: BLE001  (whatever the op raises, the file is what is wrong)
        raise ExportFormatError(f"node {n.name} of the artifact's {name} graph cannot run {n.target} on the values "
                                f"before it ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None


@contextlib.contextmanager
def _quiet():
    """The fake mode logs each failing op with its traceback; here a failure is a refusal we report."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _has_unknown(v) -> bool:
    if v is _UNKNOWN:
        return True
    if isinstance(v, (tuple, list)):
        return any(map(_has_unknown, v))
    if isinstance(v, dict):
        return any(map(_has_unknown, v.values()))
    return False


def _dense(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.layout == torch.strided and not v.is_quantized and not v.is_mkldnn
    return all(map(_dense, v)) if isinstance(v, (tuple, list)) else True


def _matches(value, stored) -> bool:
    if isinstance(stored, TensorMeta):      # a dense tensor: no sparse, quantized or MKL-DNN one
        return isinstance(value, torch.Tensor) and _dense(value) and _same(TensorMeta(
            tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype, str(value.device), False),
            stored)
    if isinstance(stored, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(stored) and all(map(_matches, value, stored))
    return True     # a number or None: nothing recorded to compare


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} {tuple(v.shape)} strides {v.stride()}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(map(_describe, v)) + ")"
    return type(v).__name__


# --- explicit strides ------------------------------------------------------------------------------
# An operator given a view's sizes and strides (``as_strided``, ``_reshape_alias``, their ``_copy`` and
# ``_scatter`` forms) reads where they say; ``_reshape_alias``'s kernel checks nothing, and the fake
# kernels compute their own strides. Each such view must lie inside the storage its input lives in.

def _strided_view(op):
    """The view operator whose ``size``/``stride`` arguments ``op`` takes (``op`` itself, or the view a
    ``_copy``/``_scatter`` form applies to its first argument), or None."""
    if not isinstance(op, OpOverload):
        return None
    ns, _, base = op._schema.name.partition("::")
    for suffix in ("_copy", "_scatter", ""):
        if base.endswith(suffix):
            view = getattr(getattr(getattr(torch.ops, ns), base[:len(base) - len(suffix)], None), op._overloadname, None)
            if isinstance(view, OpOverload) and view._schema.returns and view._schema.returns[0].alias_info is not None \
                    and {"size", "stride"} <= {a.name for a in view._schema.arguments}:
                return view
    return None


def _check_extents(name: str, gm: fx.GraphModule) -> None:
    """Every explicitly strided view in ``gm`` lies within its input's storage: an input's storage is
    its recorded extent (the guards pin it), a fresh result's its own, a view's its input's."""
    storage: dict = {}      # (node, output index) -> bytes of the storage that value lives in
    for n in gm.graph.nodes:
        stored = n.meta.get(STORED)
        outs = stored if isinstance(stored, (tuple, list)) else (stored,)
        for i, v in enumerate(outs):
            if isinstance(v, TensorMeta):
                storage[n, i] = _aliased(n, i, storage) or reach(v.shape, v.stride, v.offset) * v.dtype.itemsize
        view = _strided_view(n.target) if n.op == "call_function" else None
        if view is not None:
            _check_view(name, n, view, storage)


def _aliased(n: fx.Node, i: int, storage: dict) -> int | None:
    """The storage bytes of the input ``n``'s output ``i`` is a view of (None: a fresh tensor)."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:
        return storage.get((n.args[0], n.args[1])) if isinstance(n.args[0], fx.Node) else None
    if not isinstance(n.target, OpOverload) or i >= len(n.target._schema.returns):
        return None
    alias = n.target._schema.returns[i].alias_info
    for arg, value in zip(n.target._schema.arguments, n.args):
        if alias is not None and arg.alias_info is not None and set(arg.alias_info.before_set) & set(
                alias.before_set) and isinstance(value, fx.Node):
            return storage.get((value, 0))
    return None


def _check_view(name: str, n: fx.Node, view, storage: dict) -> None:
    args = dict(zip((a.name for a in n.target._schema.arguments), n.args)) | dict(n.kwargs)
    base = next(iter(args.values()), None)
    meta = base.meta.get(STORED) if isinstance(base, fx.Node) else None
    size, stride, offset = args.get("size"), args.get("stride"), args.get("storage_offset")
    if not isinstance(meta, TensorMeta) or not _int_list(size) or not _int_list(stride) \
            or len(size) != len(stride) or (offset is not None and type(offset) is not int):
        raise ExportFormatError(f"node {n.name} of the artifact's {name} graph calls {n.target} with sizes, "
                                "strides or an offset that are not static integers")
    offset = meta.offset if offset is None else offset
    low = offset + sum((k - 1) * st for k, st in zip(size, stride) if st < 0)
    high = reach(size, stride, offset)
    if min(size, default=1) < 0 or (0 not in size and (low < 0 or high * meta.dtype.itemsize > storage[base, 0])):
        raise ExportFormatError(f"node {n.name} of the artifact's {name} graph calls {n.target} with sizes "
                                f"{list(size)}, strides {list(stride)} and offset {offset}, which reach outside the "
                                f"{storage[base, 0]} bytes of its input's storage")


def _int_list(v) -> bool:
    return isinstance(v, (list, tuple)) and all(type(x) is int for x in v)
