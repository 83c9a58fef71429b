"""A checked manifest, its graphs and tensors -> an ``Exported`` step, compiled by the usual runtime."""
from __future__ import annotations

import dataclasses
import math
import time
import types

import torch

from .._torch import OpOverload, pytree
from .. import errors
from ..ir.descriptors import Desc
from ..ir.records import Analysis, JointLayout
from ..inputs.flatten import Signature, Slot
from ..guards import inputs as input_guards
from ..guards.inputs import TensorSpec
from ..observe import Step
from ..partition import Partition
from ..runtime.modes import is_baked
from ..stages import Captured, Exported, Modes, Setup
from ..store import codec, sandbox
from . import verify

_ExportFormatError = errors.ExportFormatError


def build_exported(path: str, m: dict, graphs: dict, tensors: dict, state: dict | None, start: float) -> Exported:
    _check_ops(m["ops"])
    joint = codec.decode_graph(graphs["joint"], tensors, "graph/joint/")
    analysis, lay = _typed(m["analysis"], Analysis), _typed(m["layout"], JointLayout)
    if any(o.kind == "symbolic" for o in analysis.outputs):
        raise _ExportFormatError("the artifact's outputs include a number computed from symbolic sizes; an exported "
                                 "step is static")
    in_descs, out_descs = _typed_list(m["input_descs"], Desc), _typed_list(m["output_descs"], Desc)
    specs = _typed_list(m["guards"], TensorSpec)
    n_ph = sum(n.op == "placeholder" for n in joint.graph.nodes)
    if len(in_descs) != n_ph or len(specs) != lay.n_primals or len(analysis.inputs) != lay.n_primals:
        raise _ExportFormatError("the artifact's descriptors, guards and joint graph disagree on the inputs")
    module = _state_module(m["state"], tensors, state or {}, specs)
    sig = _signature(m, module)
    if len(sig.slots) + len(sig.tensor_pos) != lay.n_primals:
        raise _ExportFormatError("the artifact's call signature does not match its graph inputs")
    out_spec = _treespec(m["out_spec"])
    if hasattr(analysis, "out_spec"):
        analysis = dataclasses.replace(analysis, out_spec=out_spec)
    setup = _make(Setup, fn=module, signature=sig, input_descs=tuple(in_descs[:lay.n_primals]),
                  flat_fn=_no_code(m["name"]),
                  session=Modes(False, bool(m["grad_enabled"]), _modes(m["modes"]), ()), fake_inputs=(),
                  real_inputs=())
    guards = input_guards.build(specs, in_descs[:lay.n_primals], ())
    step = Step("load export", time.perf_counter() - start, {"path": path})
    captured = _make(Captured, setup=setup, joint=joint, analysis=analysis, layout=lay, guards=guards,
                     out_spec=out_spec, input_descs=tuple(in_descs), output_descs=tuple(out_descs),
                     history=(step,))
    part = _partition(m, graphs, tensors)
    _check_tensor_names(m, graphs, tensors)
    decoded = {"joint": joint} if part is None else {"joint": joint, "forward": part.forward, "backward": part.backward}
    verify.check_graphs(m["ops"], decoded, specs, lay, part, analysis)
    compiled = captured.compile(_checked_eager, None, "auto" if part is None else part)
    binding = None
    if m["kind"] == "step":
        from .held import bind
        binding = bind(module, m.get("step"), sig, tensors, m["name"], _item_only(joint, sig))
    return Exported(path, types.MappingProxyType({k: v for k, v in m.items() if k != "tensors"}), module, compiled,
                    binding)


def _item_only(joint, sig) -> frozenset:
    """The signature's tensor leaves the joint graph reads only with ``.item()``."""
    inputs = [n for n in joint.graph.nodes if n.op == "placeholder"][len(sig.slots):]
    return frozenset(pos for pos, n in zip(sig.tensor_pos, inputs) if n.users and all(
        isinstance(u.target, OpOverload) and sandbox.qualified_name(u.target) == "aten::_local_scalar_dense.default"
        for u in n.users))


def _checked_eager(gm, example_inputs):
    """The eager backend, where an operator's own check of a value (``bernoulli``'s ``p`` in [0, 1], an
    index in range: what no fake tensor sees at load) raises an ``ExportFormatError`` chained to ATen's."""
    from ..backends import eager
    guard_indices(gm)
    run, kind = eager(gm, example_inputs), getattr(gm.meta.get("aotgrad"), "kind", "joint")

    def checked(*args):
        try:
            return run(*args)
        except torch.linalg.LinAlgError:
            raise       # eager's own error for an input's values (a singular matrix): _linalg_check_errors
        except (RuntimeError, IndexError, ValueError) as e:
            raise errors.ExportFormatError(f"the loaded step's {kind} graph failed as it ran: {str(e)[:300]} (the "
                                           "artifact's graph asks an operator for a value it refuses, or an input's "
                                           "values are out of its range)") from e
    checked._boxed_call = getattr(run, "_boxed_call", False)
    return checked


def guard_indices(gm) -> None:
    """Before each call of a kernel that trusts an index tensor (``sandbox.INDEX_GUARDS``: max-pooling's
    and embedding's backward), a check that every index is in range: the artifact's graph computes that
    tensor, and a crafted one would write outside the gradient's storage."""
    for n in list(gm.graph.nodes):
        guard = sandbox.INDEX_GUARDS.get(sandbox.qualified_name(n.target)) if n.op == "call_function" \
            and isinstance(n.target, OpOverload) else None
        if guard is None:
            continue
        pos, bound = guard
        with gm.graph.inserting_before(n):
            checked = gm.graph.call_function(_in_range, (n.args[pos], n.args[bound] if isinstance(bound, int)
                                                         else (n.args[bound[0]], bound[1]), n.name))
        n.update_arg(pos, checked)
    gm.recompile()


def _in_range(index: torch.Tensor, bound, name: str) -> torch.Tensor:
    if not isinstance(bound, int):      # the product of a tensor's last sizes: one plane's elements
        t, dims = bound
        bound = math.prod(t.shape[-dims:])
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= bound):
        raise IndexError(f"{name}: an index of the artifact's graph is outside [0, {bound}) (min "
                         f"{int(index.min())}, max {int(index.max())}); the operator would write outside its result")
    return index


def _check_tensor_names(m: dict, graphs: dict, tensors: dict) -> None:
    """The tensor table holds the parameters' and buffers' values and the graphs' constants, nothing else."""
    used = {f"graph/{g}/{a}" for g in m["graphs"] for a in graphs[g]["attrs"]}
    used |= {f"state/{e['name']}" for e in m["state"]}
    if m["kind"] == "step":     # the training step's state argument (export.held)
        used |= {f"step/{i}" for i in m["signature"]["tensor_pos"]}
    if not set(tensors) <= used:
        raise _ExportFormatError(f"the artifact stores tensors no graph or parameter uses: {sorted(set(tensors) - used)[:5]}")


def _check_ops(ops) -> None:
    """Every operator the graphs call exists here with the schema it had when exported."""
    if not isinstance(ops, dict):
        raise _ExportFormatError("the artifact's operator table is malformed")
    for name, schema in ops.items():
        op = codec.resolve_target({"op": name})
        if str(op._schema) != schema:
            raise _ExportFormatError(f"operator {name} has schema {op._schema} in this torch, the artifact was "
                                     f"exported with {schema}; export it again with this torch")


def _modes(data) -> tuple:
    """The modes the step was traced under (``runtime.modes.baked``): it runs only under them."""
    value = codec.decode(data)
    if type(value) is list:
        value = tuple(value)
    if not is_baked(value):
        raise _ExportFormatError(f"the artifact's modes are malformed: {str(data)[:100]}")
    return value


def _typed(data, cls):
    value = codec.decode(data)
    if not isinstance(value, cls):
        raise _ExportFormatError(f"the artifact's {cls.__name__} is malformed")
    return value


def _typed_list(data, cls) -> list:
    values = codec.decode(data)
    if not isinstance(values, list) or not all(isinstance(v, cls) for v in values):
        raise _ExportFormatError(f"the artifact's list of {cls.__name__} is malformed")
    return values


def _treespec(text):
    try:
        return pytree.treespec_loads(text)
    except Exception as e:      # treespec_loads names no error type; it builds only registered types
        raise _ExportFormatError(f"the artifact's argument or output structure cannot be read here ({e})") from None


def _make(cls, **fields):
    """``cls(**fields)`` keeping only the fields this version of the stage class has."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in names})


def _no_code(name: str):
    def flat_fn(*flat):
        raise errors.UnsupportedError("create_graph=True through an exported step needs the model's code to "
                                      "re-run the forward, and the artifact holds only graphs; run the gradient "
                                      "penalty with the model itself", user_line=errors.caller_line())
    flat_fn.__name__ = name if isinstance(name, str) and name.isidentifier() else "exported"
    return flat_fn


def _state_module(entries, tensors: dict, given: dict, specs) -> torch.nn.Module:
    """A module holding each parameter and buffer under its name (and its tied aliases)."""
    root = torch.nn.Module()
    if not isinstance(entries, list) or len(entries) > len(specs):
        raise _ExportFormatError("the artifact's parameter and buffer table is malformed")
    for e, spec in zip(entries, specs):
        name = e.get("name") if isinstance(e, dict) else None
        if not isinstance(name, str) or not codec._DOTTED.match(name) or e.get("kind") not in ("param", "buffer"):
            raise _ExportFormatError(f"the artifact's parameter and buffer table has a malformed entry {e!r:.60}")
        if (e.get("dtype"), e.get("shape"), e.get("requires_grad")) != (
                str(spec.dtype).removeprefix("torch."), list(spec.size), spec.requires_grad) \
                or type(e["requires_grad"]) is not bool or not isinstance(e.get("aliases", []), list):
            raise _ExportFormatError(f"the artifact's entry for {name!r} disagrees with its input guard "
                                     f"({spec.dtype}, size {tuple(spec.size)}, requires_grad={spec.requires_grad})")
        t = _value(name, tensors, given, spec)
        if e["kind"] == "param" and not isinstance(t, torch.nn.Parameter):
            t = torch.nn.Parameter(t, requires_grad=bool(e["requires_grad"]))
        for alias in [name, *e.get("aliases", [])]:
            if not isinstance(alias, str) or not codec._DOTTED.match(alias):
                raise _ExportFormatError(f"parameter alias {alias!r:.60} is not a dotted name")
            _place(root, alias, t, e["kind"] == "param")
    return root


def _value(name: str, tensors: dict, given: dict, spec) -> torch.Tensor:
    value = given.get(name, tensors.get(f"state/{name}"))
    if value is None:
        raise errors.ExportFormatError(f"the artifact holds no value for {name!r} (exported with values=False); "
                                       "pass aotgrad.load(path, state={name: tensor, ...})")
    if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype or tuple(value.shape) != tuple(spec.size) \
            or value.device != spec.device:
        raise errors.ExportFormatError(f"the value for {name!r} is not a {spec.dtype} tensor of size "
                                       f"{tuple(spec.size)} on {spec.device}, as exported")
    if name not in given:
        if value.stride() != tuple(spec.layout[:-1]) or spec.layout[-1] != 0:
            raise errors.ExportFormatError(f"the stored value of {name!r} has strides {value.stride()}, its input guard "
                                           f"says {tuple(spec.layout[:-1])} at offset {spec.layout[-1]}")
        return value
    if value.stride() != tuple(spec.layout[:-1]):     # the graph assumed the exported layout
        return torch.empty_strided(spec.size, spec.layout[:-1], dtype=spec.dtype, device=spec.device).copy_(value)
    return value        # the caller's own tensor: the step trains it in place


def _place(root: torch.nn.Module, name: str, t, is_param: bool) -> None:
    *path, last = name.split(".")
    owner = root
    for p in path:
        if p not in owner._modules:
            owner.add_module(p, torch.nn.Module())
        owner = owner._modules[p]
    if is_param:
        owner.register_parameter(last, t)
    else:
        owner.register_buffer(last, t)


def _signature(m: dict, module: torch.nn.Module) -> Signature:
    sig = m["signature"]
    leaves, pos, in_spec = codec.decode(sig["leaves"]), sig["tensor_pos"], _treespec(sig["in_spec"])
    if not isinstance(leaves, list) or not isinstance(pos, list) or len(leaves) != in_spec.num_leaves \
            or pos != sorted(set(pos)) or not all(type(p) is int and 0 <= p < len(leaves) and leaves[p] is None
                                                  for p in pos) \
            or not all(type(v) in (bool, int, float, str, torch.dtype, torch.device, type(None)) for v in leaves):
        raise _ExportFormatError("the artifact's call signature is malformed")
    names = tuple(e["name"] for e in m["state"])
    same = sig.get("same", [])      # (an artifact written before it: distinct arguments, as its capture checked)
    n_flat = len(names) + len(pos)
    if not isinstance(same, list) or not all(isinstance(p, list) and len(p) == 2 and all(type(k) is int for k in p)
                                             and 0 <= p[1] < p[0] < n_flat for p in same):
        raise _ExportFormatError("the artifact's call signature is malformed")
    slots = []
    for name, e in zip(names, m["state"]):
        owner_name, _, attr = name.rpartition(".")
        slots.append(Slot(module.get_submodule(owner_name) if owner_name else module, attr, e["kind"] == "param"))
    return Signature(in_spec, tuple(leaves), tuple(pos), names, tuple(slots), same=tuple(map(tuple, same)))


def _partition(m: dict, graphs: dict, tensors: dict):
    p = m["partition"]
    if p is None:
        return None
    if "forward" not in graphs or "backward" not in graphs:
        raise _ExportFormatError("the artifact is a training step without forward and backward graphs")
    return Partition(codec.decode_graph(graphs["forward"], tensors, "graph/forward/"),
                     codec.decode_graph(graphs["backward"], tensors, "graph/backward/"),
                     tuple(p["saved"]), int(p["n_saved_tensors"]), tuple(p["recomputed"]))
