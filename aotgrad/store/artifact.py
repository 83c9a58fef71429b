"""``Captured -> artifact on disk -> Exported``: a training step that runs without the model's code.

The artifact (see ``docs/export-format.md``) is a zip of a JSON manifest, graphs as JSON and
tensors as raw bytes. ``export`` writes what ``compile_parts`` needs beyond the user's
function: the joint and partitioned graphs, the analysis (mutations, aliases), the joint
layout, the input guards' specs, the call signature and the parameter/buffer specs and values.
``loader.load`` checks it all, then (``rebuild``) builds a ``Captured`` whose setup holds a stand-in module with
the parameters and buffers under their names, and compiles the stored partition with the
same runtime as ``Captured.compile``.
"""
from __future__ import annotations

import json
import zipfile

import torch

from .._torch import pytree
from .. import errors
from . import codec, tensors as tensor_io
from . import schema     # also registers the stage metadata classes with the codec
from ..ir.graphs import Unserializable
from ..ir.records import reached_bytes
from ..partition.blocks import inline_calls
from .manifest import FORMAT, VERSION


def export(captured, path: str, *, values: bool = True, partitioner="default", memory_budget=None) -> str:
    """Write ``captured`` (partitioned by ``partitioner``) to ``path``; ``values=False`` leaves the
    parameter and buffer values out (``aotgrad.load(path, state=...)`` then takes them)."""
    try:
        manifest, graphs, named = _manifest(captured, partitioner, memory_budget, values)
    except Unserializable as e:
        raise errors.UnsupportedError(f"cannot export this capture: the export format does not define {e}",
                                      user_line=errors.caller_line()) from None
    blob, manifest["tensors"] = tensor_io.pack(named)
    manifest["tensors_sha256"] = tensor_io.digest(blob)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("manifest.json", json.dumps(manifest, indent=1))
        for name, graph in graphs.items():
            z.writestr(f"graphs/{name}.json", json.dumps(graph))
        z.writestr("tensors.bin", blob)
    return path


def _manifest(captured, partitioner, memory_budget, values: bool):
    from .. import partition
    _refuse(captured)
    named: dict = {}
    sig = captured.setup.signature
    # The format lists every operator a loaded step runs and checks each node's value: repeated
    # blocks are written as copies of their halves' nodes, not calls (the disk cache keeps the calls).
    joint = inline_calls(captured.joint)
    part = None if captured.is_inference else partition.get(partitioner, memory_budget)(joint, captured.layout)
    gms = {"joint": joint} if part is None else {"joint": joint, "forward": part.forward, "backward": part.backward}
    graphs = {k: codec.encode_graph(gm, named, f"graph/{k}/") for k, gm in gms.items()}
    state = _state_specs(captured, named if values else None)
    step = _step(captured, named if values else None)
    manifest = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__, "aotgrad": _aotgrad_version(),
        "name": captured.setup.flat_fn.__name__, "kind": "inference" if part is None else "training",
        "grad_enabled": bool(captured.setup.session.grad_enabled),
        "modes": codec.encode(list(_modes(captured))), "values": values, "state": state,
        "signature": {"in_spec": codec.spec_text(sig.in_spec, "argument"), "leaves": codec.encode(list(sig.leaves)),
                      "tensor_pos": list(sig.tensor_pos), "same": [list(p) for p in sig.same or ()]},
        "out_spec": codec.spec_text(captured.out_spec),
        "input_descs": codec.encode(list(captured.input_descs)),
        "output_descs": codec.encode(list(captured.output_descs)),
        "analysis": codec.encode(schema.stored_analysis(captured.analysis, symbolic=False)),
        "layout": codec.encode(captured.layout),
        "guards": codec.encode([_static(s) for s in captured.guards.specs]),
        "partition": None if part is None else {"saved": list(part.saved), "n_saved_tensors": part.n_saved_tensors,
                                                "recomputed": list(part.recomputed)},
        "graphs": sorted(graphs), "ops": codec.op_schemas(gms.values()),
    }
    if step is not None:
        manifest["kind"], manifest["step"] = "step", step
    return manifest, graphs, named


def _modes(captured) -> tuple:
    """The modes the capture was traced under. A loaded step runs under no torch function mode (its
    graph calls the operators, which no mode intercepts): one traced under such modes is not exported."""
    baked, functions = captured.setup.session.baked, captured.setup.session.function_modes
    if baked is None or functions is None:
        raise errors.UnsupportedError("cannot export this capture: the modes it was traced under (autocast, inference "
                               "mode, the default dtype) are not known (it was loaded from the disk cache); "
                               "capture it again", user_line=errors.caller_line())
    if functions:
        raise errors.UnsupportedError(f"cannot export this capture: it was traced under torch function modes "
                                      f"({', '.join(functions)}), which a loaded step cannot enter; capture it "
                                      "outside them", user_line=errors.caller_line())
    return baked


def _refuse(captured) -> None:
    from ..runtime.hooks import has_opaque_calls
    if captured.setup.rebase is not None:
        raise Unserializable("inputs that alias each other and are mutated (synthetic bases)")
    if captured.setup.signature.unwrap is not None:
        raise Unserializable("tensor subclass inputs, or plain inputs whose gradient is a subclass (a class is "
                             "live Python code)")
    if has_opaque_calls(captured):
        raise Unserializable("tensor hooks, retain_grad or a custom Function returning its input (live Python code)")
    for spec in captured.guards.specs:
        _static(spec)
    for leaf in captured.setup.signature.leaves:
        if leaf is not None and type(leaf) not in (bool, int, float, str, torch.dtype, torch.device):
            raise Unserializable(f"a non-tensor argument of type {type(leaf).__name__} (only numbers, strings, "
                                 "dtypes and devices are written by value)")


def _static(spec):
    if spec is None or not all(isinstance(v, int) for v in (*spec.size, *spec.layout)):
        raise Unserializable("symbolic sizes (a dynamic capture): capture with dynamic=False to export")
    return spec


def _state_specs(captured, named: dict | None) -> list:
    """Name, kind, tied aliases and requires_grad of each lifted parameter and buffer, and its value."""
    sig, fn = captured.setup.signature, captured.setup.fn
    aliases: dict = {}
    if isinstance(fn, torch.nn.Module):
        first = {}
        for name, t in [*fn.named_parameters(remove_duplicate=False), *fn.named_buffers(remove_duplicate=False)]:
            aliases.setdefault(first.setdefault(id(t), name), []).append(name)
    state = []
    for name, slot in zip(sig.state_names, sig.slots):
        t = (slot.module._parameters if slot.is_param else slot.module._buffers)[slot.attr]
        if named is not None and t.numel() and t.untyped_storage().nbytes() < reached_bytes(t):
            raise Unserializable(f"the {'parameter' if slot.is_param else 'buffer'} `{name}`, whose storage is freed "
                                 "or smaller than its size (untyped_storage().resize_(0), FSDP-style): its values "
                                 "cannot be written; export after they are allocated again, or with values=False")
        state.append({"name": name, "kind": "param" if slot.is_param else "buffer",
                      "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "requires_grad": t.requires_grad,
                      "aliases": aliases.get(name, [name])[1:]})
        if named is not None:
            named[f"state/{name}"] = t
    return state


def _step(captured, named: dict | None) -> dict | None:
    """A whole training step (``inputs.step``): its state argument's tensors (each ``.grad``, each
    optimizer's per-parameter state, the learning rates) go into ``named`` as ``step/<leaf>``; the
    manifest names each optimizer's class and its groups' parameters (the hyperparameters are the
    signature's constants). The step must leave its state in the structure it takes, or the loaded
    step could not run twice."""
    b = captured.step
    if b is None:
        return None
    if b.hooked():
        raise Unserializable(f"a training step that runs gradient hooks of {', '.join(b.hooked()[:3])} (Python the "
                             "loaded step would not have); remove the hooks before exporting")
    if named is None:
        raise Unserializable("a whole training step without values (its optimizer state is part of the step); "
                             "export it with values=True")
    state = b.gather()
    leaves, spec = pytree.tree_flatten(state)
    if spec != captured.setup.signature.in_spec.children()[0].children()[0]:
        raise Unserializable("a training step whose optimizer state or .grad changed structure since it was "
                             "captured; capture it again")
    after = pytree.tree_structure((state["grad"], {k: o["state"] for k, o in state["optimizer"].items()}))
    if after != captured.out_spec.children()[1]:
        raise Unserializable("a training step that leaves its state in another structure than it takes (.grad "
                             "None before and set after, or optimizer state it creates): the loaded step could "
                             "not run twice; capture after one eager step, with zero_grad inside the step")
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor):
            named[f"step/{i}"] = t
    return {"optimizers": [{"key": key, "class": type(opt).__name__, "module": type(opt).__module__,
                            "groups": [{"params": [b.names[i] for i in idx], "tensor_lr": isinstance(g["lr"], torch.Tensor)}
                                       for g, idx in zip(opt.param_groups, index)]}
                           for key, opt, index in zip(b.keys, b.optimizers, b.opt_index)],
            "parameters": list(b.names)}


def _aotgrad_version() -> str:
    try:
        from importlib.metadata import version
        return version("aotgrad")
    except Exception:       # running from a source tree that is not installed
        return "unknown"


__all__ = ["export", "FORMAT", "VERSION"]
