"""A compiled training step as data: what ``Captured`` and ``Compiled`` hold,
minus the live objects (the user's function, fake tensors, the tracing
session), so another process can rebuild a ``Compiled`` without tracing.

``dump_compiled`` writes the joint, forward and backward graphs, the analysis,
layout, descriptors, output structure and the guards' specs and conditions.
``load_compiled`` re-flattens the live call (cheap: no tracing), rebuilds the
guards from their specs, and compiles the stored partition with the named
backend.
"""
from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import replace

from ..frontend.flatten import flat_function, signature
from ..guards import cache
from ..guards import inputs as input_guards
from ..observe import Step
from ..partition import Partition
from ..stages import Captured, Modes, Setup
from ..ir.graphs import Unserializable, dump_graph, load_graph
from ..ir.values import FakeValues
from ..runtime.hooks import has_opaque_calls
from ..options import keywords_checked

# Backends that compile a graph without the fake example values a loaded graph lacks.
LOADABLE_BACKENDS = ("eager", None)


def dump_compiled(compiled) -> dict:
    """Everything ``load_compiled`` needs; raises ``Unserializable`` when some part is not data."""
    c = compiled.captured
    if c.setup.rebase is not None:
        raise Unserializable("inputs with synthetic bases (aliased, mutated inputs) are not cached")
    if has_opaque_calls(c):
        raise Unserializable("a function that registers hooks is not cached (the hooks are live Python objects)")
    part = compiled.partition
    g = c.guards
    return {
        "setup_descs": tuple(map(str, c.setup.input_descs)),
        "session": (c.setup.session.dynamic, c.setup.session.grad_enabled),
        "joint": dump_graph(c.joint),
        "partition": None if part is None else dump_partition(part),
        "analysis": replace(c.analysis, fake_outputs=(), out_spec=None),   # fake values only serve tracing
        "layout": c.layout,
        "guards": (g.specs, g.descs, g.conditions, g.numbers),
        "out_spec": c.out_spec,
        "descs": (c.input_descs, c.output_descs),
    }


def dump_partition(part) -> tuple:
    return (dump_graph(part.forward), dump_graph(part.backward), part.saved, part.n_saved_tensors, part.recomputed)


def load_partition(data, values: FakeValues | None = None) -> Partition:
    fw, bw, saved, n_saved, recomputed = data
    values = values if values is not None else FakeValues({**fw.get("symbols", {}), **bw.get("symbols", {})})
    return Partition(load_graph(fw, values), load_graph(bw, values), saved, n_saved, recomputed)


def _record_values(record: dict) -> FakeValues:
    """One ``FakeValues`` for a record's joint and partition: their symbols are the same."""
    graphs = [record["joint"], *(record["partition"] or ())[:2]]
    return FakeValues({k: v for g in graphs for k, v in g.get("symbols", {}).items()})


def load_compiled(record: dict, fn, args, kwargs, fw_compiler="eager", bw_compiler=None):
    """A ``Compiled`` for ``fn(*args, **kwargs)`` from ``record``, or None when the call
    does not flatten to the inputs the record was captured with."""
    sig, tensors, descs = signature(fn, args, kwargs)
    dynamic, grad_enabled = record["session"]
    setup = Setup(fn, sig, tuple(descs), flat_function(fn, sig), Modes(dynamic, grad_enabled), (), ())
    return compile_record(record, setup, fw_compiler, bw_compiler)


def compile_record(record: dict, setup: Setup, fw_compiler="eager", bw_compiler=None):
    """A ``Compiled`` of ``setup``'s call from ``record`` (its stored joint and partition: nothing is
    traced or partitioned), or None when ``setup``'s inputs are not those the record was captured with."""
    start = time.perf_counter()
    if tuple(map(str, setup.input_descs)) != record["setup_descs"]:
        return None
    setup = replace(setup, session=Modes(*record["session"]), fake_inputs=(), real_inputs=())
    guards = input_guards.build(*record["guards"])
    in_descs, out_descs = record["descs"]
    step = Step("load from disk cache", time.perf_counter() - start, {})
    values = _record_values(record)
    captured = Captured(setup, load_graph(record["joint"], values), record["analysis"], record["layout"], guards,
                        record["out_spec"], in_descs, out_descs, (step,))
    part = None if record["partition"] is None else load_partition(record["partition"], values)
    return captured.compile(fw_compiler, bw_compiler, stored(part))


def stored(part: Partition):
    """A partitioner that returns ``part``: it reads no node values, so a loaded joint's fake
    values are never rebuilt (that would make a fake mode and shape environment per load)."""
    def stored_partition(joint, layout):
        return part
    stored_partition.stored = True
    return stored_partition


@keywords_checked("compile_cached")
def compile_cached(captured, fw_compiler="eager", bw_compiler=None, partitioner="default", memory_budget=None):
    """``captured.compile(...)`` that reuses a partition stored on disk for the same
    (possibly user-edited) joint graph, layout and options: the staged path's cache."""
    key = staged_key(captured, fw_compiler, bw_compiler, partitioner, memory_budget)
    if key is not None and not captured.is_inference:
        start = time.perf_counter()
        data = cache.load("staged", key)
        if data is not None:
            part = load_partition(data)
            step = Step("load partition", time.perf_counter() - start, {"from": "disk cache"})
            compiled = captured.compile(fw_compiler, bw_compiler, stored(part))
            return replace(compiled, history=compiled.history + (step,))
    compiled = captured.compile(fw_compiler, bw_compiler, partitioner, memory_budget)
    if key is not None and compiled.partition is not None:
        cache.store("staged", key, dump_partition(compiled.partition))
    return compiled


def staged_key(captured, fw_compiler="eager", bw_compiler=None, partitioner="default",
               memory_budget=None) -> str | None:
    """The staged path's key: the joint graph as data (so an edit changes it), its layout, the options.

    ``None`` (not cached) for the default partition with no budget: it is one pass over the
    graph, cheaper than loading a stored one and re-deriving its fake values (gpt_small:
    0.08 s against 0.3 s); min-cut and budgets are worth storing.
    """
    if not cache.enabled() or not isinstance(partitioner, str) \
            or fw_compiler not in LOADABLE_BACKENDS or bw_compiler not in LOADABLE_BACKENDS:
        return None
    if partitioner == "default" and memory_budget is None:
        return None
    try:
        graph = hashlib.sha256(pickle.dumps(dump_graph(captured.joint), protocol=4)).hexdigest()
    except Unserializable:
        return None
    return cache.digest("staged", graph, captured.layout, fw_compiler, bw_compiler, partitioner, memory_budget)
