"""Repeated regions of a compiled graph: one repeated block's copies, found so that a backend
compiles the block once and calls it per copy.

Block reuse (``capture/block_graph.py``) stamps a template's nodes out once per call and tags each
copy (``meta[TAG]``: template, forward or backward, call). Partitioning keeps the tags, so the
forward and backward graphs hold runs of consecutive nodes of one copy each. A run is compiled
once for all the runs it is *equal* to, and equality is checked here, node by node, not assumed
from the tags: the same operators with the same constants (floats by their bits, ``True`` is not
``1``), the same wiring among the run's own nodes, its inputs used in the same places (two uses of
one input are one input in each run), the same nodes read after it, and, for compilers that
specialise on them (``layouts``), the same sizes, strides, offsets, dtypes and devices of every
value. Runs that are equal to no other stay inline::

    graph:   a = mm(x, w0); b = relu(a)   c = mm(b, w1); d = relu(c)   e = sum(d)
    regions: Region(nodes=[a, b], inputs=[x, w0], outputs=[b]), Region([c, d], [b, w1], [d])
             with one ``key``: the code for ``[a, b]`` serves both.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.fx as fx

TAG = "aotgrad_block"       # node.meta[TAG]: (template key, "fw" or "bw", call number) of a stamped copy
MIN_NODES = 4               # shorter runs cost more as a call than inline
ENABLED = True              # tests turn it off to compare with the inline code
DONE = "aotgrad regions"    # graph.meta[DONE]: "{k} for {copies} copies", set by the code that used them


@dataclass(frozen=True)
class Region:
    nodes: tuple        # the run, in graph order
    inputs: tuple       # nodes outside the run it reads, in order of first use
    outputs: tuple      # its nodes read after it
    key: int            # runs of one key compute the same function of their inputs

    def graph(self) -> fx.Graph:
        """The run as a graph of its own: ``(*inputs) -> (*outputs)``."""
        from .._torch import copy_node
        g = fx.Graph()
        env = {x: g.placeholder(f"in{i}") for i, x in enumerate(self.inputs)}
        for x, p in zip(self.inputs, env.values()):
            if "val" in x.meta:
                p.meta["val"] = x.meta["val"]
        for n in self.nodes:
            env[n] = copy_node(g, n, env.__getitem__)
        g.output(tuple(env[o] for o in self.outputs))
        return g


def repeated(graph: fx.Graph, layouts: bool = False) -> list[Region]:
    """The runs of ``graph`` that at least one other run equals, in graph order."""
    runs = _runs(graph)
    keys: dict = {}
    found = []
    for nodes in runs:
        sig = signature(nodes, layouts)
        if sig is None:
            continue
        inputs, outputs, shape = sig
        found.append((nodes, inputs, outputs, shape))
        keys[shape] = keys.get(shape, 0) + 1
    numbers: dict = {}
    out = []
    for nodes, inputs, outputs, shape in found:
        if keys[shape] > 1:
            out.append(Region(tuple(nodes), inputs, outputs, numbers.setdefault(shape, len(numbers))))
    return out


def used(gm: fx.GraphModule, found: list) -> None:
    """Note on ``gm`` (its ``meta[DONE]``, read into the compile step's history) the regions its code
    calls compiled blocks for."""
    if found:
        gm.meta[DONE] = f"{len({r.key for r in found})} for {len(found)} copies"


def _runs(graph: fx.Graph) -> list[list[fx.Node]]:
    runs, tag, run = [], None, []
    for n in graph.nodes:
        t = n.meta.get(TAG) if n.op == "call_function" else None
        t = t and t[::2]        # one call's backward holds forward values it recomputes (views)
        if t is not None and t == tag:
            run.append(n)
            continue
        if len(run) >= MIN_NODES:
            runs.append(run)
        tag, run = t, ([n] if t is not None else [])
    if len(run) >= MIN_NODES:
        runs.append(run)
    return runs


def signature(nodes: list, layouts: bool):
    """``(inputs, outputs, shape)`` of a run; ``shape`` is equal for two runs exactly when the code
    of one computes the other from its own inputs. None for a run holding a symbolic value."""
    local = {n: i for i, n in enumerate(nodes)}
    inputs: dict = {}
    body = []

    def ref(a):
        t = type(a)
        if t is fx.Node:
            i = local.get(a)
            if i is not None:
                return ("n", i)
            if a not in inputs:
                inputs[a] = len(inputs)
            return ("in", inputs[a])
        if t is int or t is str or a is None:
            return a
        if t is tuple or t is list or isinstance(a, (list, tuple)):
            return (t, tuple(ref(x) for x in a))
        if isinstance(a, dict):
            return (dict, tuple((k, ref(v)) for k, v in a.items()))
        return constant(a)
    try:
        for n in nodes:
            row = (n.target, ref(n.args), ref(n.kwargs))
            body.append((row, _layout(n) if layouts else None))
        outputs = tuple(n for n in nodes if any(u not in local for u in n.users))
        ins = tuple(inputs)
        edge = tuple(_layout(x) for x in ins) if layouts else len(ins)
        return ins, outputs, (tuple(body), edge, tuple(local[o] for o in outputs))
    except _Symbolic:
        return None


class _Symbolic(Exception):
    pass


def constant(a):
    """A hashable stand-in equal for equal constants only: ``True`` is not ``1``, ``-0.0`` not ``0.0``."""
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Symbolic
    if type(a) is float:
        return ("f", struct.pack("<d", a))      # 0.0 vs -0.0, a NaN's bits
    try:
        hash(a)
    except TypeError:
        return ("id", id(a))
    return (type(a), a)     # bool, dtype, device, layout, memory_format, an op


def _layout(n: fx.Node):
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        layout = (*v.shape, *v.stride(), v.storage_offset())
        if any(not isinstance(s, int) for s in layout):
            raise _Symbolic
        return (layout, v.dtype, v.device, v.requires_grad)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Symbolic
    return type(v)
