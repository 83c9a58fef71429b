"""A compiled training step as data: what ``Captured`` and ``Compiled`` hold,
minus the live objects (the user's function, fake tensors, the tracing
session), so another process can rebuild a ``Compiled`` without tracing.

``dump_compiled`` writes, through the one codec (:mod:`aotgrad.store.codec`), the joint, forward and
backward graphs, the analysis, layout, descriptors, output structure and the guards' specs and
conditions (symbolic sizes included: an entry may be dynamic). ``load_compiled`` re-flattens the live
call (cheap: no tracing), rebuilds the guards from their specs, and compiles the stored partition
with the named backend.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace

from .._torch import pytree
from ..inputs.flatten import flat_function, signature
from ..errors import ExportFormatError
from ..guards import inputs as input_guards
from ..guards.cache import digest
from ..observe import Step
from ..partition import Partition
from ..stages import Captured, Modes, Setup
from ..ir.graphs import Unserializable
from ..ir.records import Analysis, JointLayout
from ..ir.values import FakeValues
from ..runtime.hooks import has_opaque_calls
from ..runtime.call import unbound_size
from ..store import codec, disk, tensors as tensor_io
from ..store import schema     # also registers the stage metadata classes with the codec
from ..options import keywords_checked

# Backends that compile a graph without the fake example values a loaded graph lacks.
LOADABLE_BACKENDS = ("eager", None)


def dump_compiled(compiled) -> tuple:
    """``(document, tensors)``: everything ``load_compiled`` needs; raises ``Unserializable`` when some
    part is not data."""
    c = compiled.captured
    if c.setup.rebase is not None:
        raise Unserializable("inputs with synthetic bases (aliased, mutated inputs) are not cached")
    if has_opaque_calls(c):
        raise Unserializable("a function that registers hooks is not cached (the hooks are live Python objects)")
    if unbound_size(c.analysis, c.guards.bound, replayed=True) is not None:
        raise Unserializable("a view sized over symbols no input guard binds (replayed in process only)")
    part = compiled.partition
    g, tensors = c.guards, {}
    doc = {
        "setup_descs": list(map(str, c.setup.input_descs)),
        "session": codec.encode((c.setup.session.dynamic, c.setup.session.grad_enabled)),
        "joint": codec.encode_graph(c.joint, tensors, "joint/", symbolic=True),
        "partition": None if part is None else dump_partition(part, tensors),
        "analysis": codec.encode(schema.stored_analysis(c.analysis, symbolic=True)),
        "layout": codec.encode(c.layout),
        "guards": codec.encode((g.specs, g.descs, g.conditions, g.numbers)),
        "out_spec": codec.spec_text(c.out_spec),
        "descs": codec.encode((c.input_descs, c.output_descs)),
    }
    return doc, tensors


def dump_partition(part, tensors: dict) -> dict:
    return {"forward": codec.encode_graph(part.forward, tensors, "forward/", symbolic=True),
            "backward": codec.encode_graph(part.backward, tensors, "backward/", symbolic=True),
            "rest": codec.encode((part.saved, part.n_saved_tensors, part.recomputed))}


def load_partition(data: dict, tensors: dict, values: FakeValues | None = None) -> Partition:
    values = values if values is not None else _values(data["forward"], data["backward"])
    saved, n_saved, recomputed = codec.decode(data["rest"])
    return Partition(codec.decode_graph(data["forward"], tensors, "forward/", values, symbolic=True),
                     codec.decode_graph(data["backward"], tensors, "backward/", values, symbolic=True),
                     saved, n_saved, recomputed)


def _values(*graphs) -> FakeValues:
    """One ``FakeValues`` for graphs that share symbols (a joint and its partition)."""
    hints = {k: v for g in graphs if g is not None for k, v in g.get("symbols", {}).items()}
    return FakeValues(hints)


def load_compiled(record: tuple, fn, args, kwargs, fw_compiler="eager", bw_compiler=None):
    """A ``Compiled`` for ``fn(*args, **kwargs)`` from ``record`` (``dump_compiled``'s), or None when the
    call does not flatten to the inputs the record was captured with."""
    sig, tensors, descs = signature(fn, args, kwargs)
    dynamic, grad_enabled = codec.decode(record[0]["session"])
    setup = Setup(fn, sig, tuple(descs), flat_function(fn, sig), Modes(dynamic, grad_enabled), (), ())
    compiled = compile_record(record, setup, fw_compiler, bw_compiler)
    if compiled is not None:
        try:        # a stored guard that does not run on this call is a malformed record, not the call's error
            compiled.path.match(args, kwargs)
        except Exception as e:
            raise ExportFormatError(f"the stored input guards do not run ({type(e).__name__}: {e})") from e
    return compiled


def compile_record(record: tuple, setup: Setup, fw_compiler="eager", bw_compiler=None):
    """A ``Compiled`` of ``setup``'s call from ``record`` (its stored joint and partition: nothing is
    traced or partitioned), or None when ``setup``'s inputs are not those the record was captured with.
    A record that does not decode raises ``ExportFormatError`` (the caller compiles instead)."""
    start = time.perf_counter()
    doc, tensors = record
    if list(map(str, setup.input_descs)) != doc["setup_descs"]:
        return None
    setup = replace(setup, session=Modes(*codec.decode(doc["session"])), fake_inputs=(), real_inputs=())
    guards = input_guards.build(*codec.decode(doc["guards"], symbolic=True))
    in_descs, out_descs = codec.decode(doc["descs"])
    step = Step("load from disk cache", time.perf_counter() - start, {})
    part = doc["partition"]
    values = _values(doc["joint"], *((part["forward"], part["backward"]) if part else ()))
    joint = codec.decode_graph(doc["joint"], tensors, "joint/", values, symbolic=True)
    captured = Captured(setup, joint, _typed(doc["analysis"], Analysis), _typed(doc["layout"], JointLayout), guards,
                        pytree.treespec_loads(doc["out_spec"]), in_descs, out_descs, (step,))
    part = None if part is None else load_partition(part, tensors, values)
    return captured.compile(fw_compiler, bw_compiler, "auto" if part is None else part)   # None: inference


def _typed(data, cls):
    value = codec.decode(data, symbolic=True)
    if not isinstance(value, cls):
        raise ExportFormatError(f"a stored {cls.__name__} is malformed")
    return value


@keywords_checked("compile_cached")
def compile_cached(captured, fw_compiler="eager", bw_compiler=None, partitioner="default", memory_budget=None):
    """``captured.compile(...)`` that reuses a partition stored on disk for the same
    (possibly user-edited) joint graph, layout and options: the staged path's cache."""
    key = staged_key(captured, fw_compiler, bw_compiler, partitioner, memory_budget)
    if key is not None and not captured.is_inference:
        start = time.perf_counter()
        part = disk.load("staged", key, decode=load_partition)
        if part is not None:
            step = Step("load partition", time.perf_counter() - start, {"from": "disk cache"})
            compiled = captured.compile(fw_compiler, bw_compiler, part)
            return replace(compiled, history=compiled.history + (step,))
    compiled = captured.compile(fw_compiler, bw_compiler, partitioner, memory_budget)
    if key is not None and compiled.partition is not None:
        try:
            tensors: dict = {}
            disk.store("staged", key, dump_partition(compiled.partition, tensors), tensors)
        except Unserializable:
            pass        # a graph the format does not write: compiled, not cached
    return compiled


def staged_key(captured, fw_compiler="eager", bw_compiler=None, partitioner="default",
               memory_budget=None) -> str | None:
    """The staged path's key: the joint graph as data (so an edit changes it), its layout, the options.

    ``None`` (not cached) for the default partition with no budget: it is one pass over the
    graph, cheaper than loading a stored one and re-deriving its fake values (gpt_small:
    0.08 s against 0.3 s); min-cut and budgets are worth storing.
    """
    if not disk.enabled() or not isinstance(partitioner, str) \
            or fw_compiler not in LOADABLE_BACKENDS or bw_compiler not in LOADABLE_BACKENDS:
        return None
    if partitioner == "default" and memory_budget is None:
        return None
    try:
        constants: dict = {}
        doc = codec.encode_graph(captured.joint, constants, "", symbolic=True)
        blob, table = tensor_io.pack(constants)
        graph = hashlib.sha256(json.dumps([doc, table], sort_keys=True).encode() + blob).hexdigest()
    except Unserializable:
        return None
    return digest("staged", graph, captured.layout, fw_compiler, bw_compiler, partitioner, memory_budget)
