"""Repeated blocks kept as calls: a block's joint partitioned once, its halves called per layer.

Block reuse (``capture/block_graph.py``) traces a repeated block's joint once (a template). A
call of a template whose halves :func:`partition_block` can split becomes two nodes of the
captured joint, each a call of one half, instead of a copy of the template's nodes::

    r = block3_forward(x, w1, w2)        # -> (*outputs, *saved)
    y = r[0]; s = r[1] ...
    g = block3_backward(w1, s, t)        # (*saved, *tangents) -> (*grads)
    gx = g[0]; gw1 = g[1] ...

The whole program's partitioner then sees two nodes per layer, not a hundred; the saved values
are the block's own (what its backward half reads), and the forward and backward graphs call one
Python function per half for every layer (:class:`BlockPart`, compiled on first use). A saved value
that is one of the block's inputs, or a view of one (``t(w)``), is not returned by the forward
half: the backward half takes the input itself and makes the view again, so that the program's
partitioner saves the caller's tensor, as in a flat trace.

A forward half may draw random numbers (dropout): each call carries the stream positions its draws
take (``RNG_CALL``), and a call of a half that draws is random itself (``ir.ops.is_random``),
so it runs in eager's order, even unused.

Whatever needs the flat graph (another partitioner, another compiler, the export format) calls
:func:`inline_calls`, which copies each half's nodes in place of its call (tagged for
``runtime.regions``, so a backend still compiles a block once): the same operators on the same
values, so the same bits.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import OpOverload, append_node, copy_node
from ..ir.ops import RNG_CALL, RNG_META, RNG_PHASE, aliases_input, has_side_effect, is_random, mutated_args
from ..runtime.regions import TAG
from .default import ancestors, extract, is_sym


class BlockPart:
    """One half of a repeated block's partitioned joint, as the target of its call nodes. Calling it
    runs the half (a straight-line Python function, compiled once for every call)."""

    def __init__(self, key: int, kind: str, gm: fx.GraphModule):
        self.key, self.kind, self.gm = key, kind, gm
        # Its calls draw from the RNG, so they run in eager's order, even unused (ir.ops.is_random).
        self.aotgrad_draws = any(is_random(n) for n in gm.graph.nodes)
        self.__name__ = self.__qualname__ = f"block{key}_{kind}"
        self.__module__ = __name__
        self._fn = None

    _boxed_call = True      # empties the list it is given: each input dies at its last use inside the half

    def __call__(self, args: list):
        fn = self._fn
        if fn is None:
            from ..runtime.codegen import python_function
            fn = self._fn = python_function(self.gm, self.__name__, boxed=True)
        return fn(args)

    def __repr__(self) -> str:
        return self.__name__


@dataclass(frozen=True)
class BlockParts:
    """A template's two halves. ``saved``: per input of the backward half before the tangents,
    ``("input", i)`` (the block's input ``i``) or ``("saved", k)`` (the forward half's output
    ``n_out + k``)."""
    forward: BlockPart      # (*inputs) -> (*outputs, *saved values)
    backward: BlockPart     # (*saved, *tangents) -> (*grads, in the template's grad_at order)
    n_out: int
    saved: tuple
    n_tangents: int


def is_call(n: fx.Node) -> bool:
    return n.op == "call_function" and type(n.target) is BlockPart


def has_calls(gm: fx.GraphModule) -> bool:
    return any(type(n.target) is BlockPart for n in gm.graph.nodes)


def partition_block(key: int, gm: fx.GraphModule, primals, tangents, fw_nodes, fw_outs, bw_nodes,
                    bw_outs) -> BlockParts | None:
    """The halves of a template's joint (its nodes in ``gm``), partitioned as the default
    partitioner would (the forward half computes what the outputs need, the backward half the
    rest; the forward half draws the template's random numbers, in its order); None where a call of
    the halves could differ from the template's copied nodes: a random op in the backward, another
    op that must run in order, a write, a symbolic size, an output that is an input or a view of
    one, a constant that requires grad (the capture refuses those where it sees them)."""
    body = (*fw_nodes, *bw_nodes)
    primal_set = set(primals)
    random = [n for n in fw_nodes if is_random(n)]
    if (any(is_random(n) for n in bw_nodes) or any(_writes(n) or _symbolic(n) for n in body)
            or any(has_side_effect(n) and not is_random(n) for n in body)
            or len(set(fw_outs)) < len(fw_outs) or any(_input_alias(o, primal_set) for o in fw_outs)
            or any(_grad_constant(gm, n) for n in body)):
        return None
    need = ancestors([*fw_outs, *random]) & set(fw_nodes)     # every draw, even one nothing reads
    # Unpacking a multi-output op is free; saving its parts beats saving the tuple (as partition.default).
    need |= {n for n in fw_nodes if n.target is operator.getitem and n.args[0] in need}
    stop = need | primal_set
    bw_set = ancestors(bw_outs, stop=stop) - stop - set(tangents)
    grads = set(bw_outs)
    saved = [n for n in (*primals, *fw_nodes) if n in stop and (n in grads or any(u in bw_set for u in n.users))]
    # A view of an input is made again in the backward half from the input itself.
    for n in list(saved):
        if n not in primal_set and _input_alias(n, primal_set):
            chain = ancestors([n], stop=primal_set) - primal_set
            bw_set |= chain
            saved.remove(n)
            saved.extend(p for p in ancestors([n]) & primal_set if p not in saved)
    order = {n: i for i, n in enumerate((*primals, *fw_nodes))}
    saved.sort(key=order.__getitem__)
    fresh = [n for n in saved if n not in primal_set]
    spec = tuple(("input", primals.index(n)) if n in primal_set else ("saved", fresh.index(n)) for n in saved)
    fw = extract(gm, list(primals), need, [*fw_outs, *fresh], f"Block{key}Forward")
    bw = extract(gm, [*saved, *tangents], bw_set, list(bw_outs), f"Block{key}Backward")
    return BlockParts(BlockPart(key, "forward", fw), BlockPart(key, "backward", bw), len(fw_outs), spec,
                      len(tangents))


def _writes(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, OpOverload) and bool(mutated_args(t))


def _symbolic(n: fx.Node) -> bool:
    v = n.meta.get("val")
    if is_sym(n):
        return True
    vals = v if isinstance(v, (list, tuple)) else (v,)
    return any(isinstance(x, torch.Tensor) and not all(type(s) is int for s in (*x.shape, *x.stride()))
               for x in vals)


def _input_alias(n, primals: set) -> bool:
    """Whether ``n`` is one of ``primals`` or a chain of views of one."""
    while isinstance(n, fx.Node) and n not in primals and (aliases_input(n) or n.target is operator.getitem):
        n = n.args[0]
    return isinstance(n, fx.Node) and n in primals


def _grad_constant(gm: fx.GraphModule, n: fx.Node) -> bool:
    t = getattr(gm, n.target, None) if n.op == "get_attr" else None
    return isinstance(t, torch.Tensor) and t.requires_grad


def call_forward(graph: fx.Graph, parts: BlockParts, ins: list, before: fx.Node, draws=None) -> tuple:
    """A call of the forward half before ``before``: ``(node, saved)``, the saved values as getitem
    nodes (the outputs, first in its result, are taken by the caller's getitem nodes). ``draws``:
    the stream position of each of the half's random ops, in its order (``RNG_CALL``)."""
    vals = _output_vals(parts.forward.gm)
    with graph.inserting_before(before):
        node = graph.call_function(parts.forward, (list(ins),))
        node.meta["val"] = vals
        if parts.forward.aotgrad_draws:
            assert draws is not None, "a call of a block's half that draws has no stream positions"
            node.meta[RNG_CALL] = tuple(draws)
        saved = []
        for k in range(len(vals) - parts.n_out):
            saved.append(item(graph, node, parts.n_out + k))
    return node, saved


def call_backward(graph: fx.Graph, parts: BlockParts, ins: list, saved: list, tangents: list,
                  before: fx.Node) -> fx.Node:
    """A call of the backward half before ``before``; its grads are ``item(node, j)``."""
    args = [ins[i] if kind == "input" else saved[i] for kind, i in parts.saved]
    with graph.inserting_before(before):
        node = graph.call_function(parts.backward, (args + list(tangents),))
        node.meta["val"] = _output_vals(parts.backward.gm)
    return node


def item(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    """``node[i]``, right after ``node`` (made as a copied node is: its arguments need no checks)."""
    with graph.inserting_after(node):
        g = append_node(graph, "call_function", "getitem", operator.getitem, (node, i), {})
    g.meta["val"] = node.meta["val"][i]
    return g


def _output_vals(gm: fx.GraphModule) -> list:
    return [o.meta.get("val") if isinstance(o, fx.Node) else None for o in gm.graph.output_node().args[0]]


def inline_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every call of a block half replaced by a copy of the half's nodes (a new module;
    ``gm`` itself when it calls none)."""
    if not has_calls(gm):
        return gm
    g = fx.Graph()
    env: dict = {}
    outs: dict = {}     # call node -> the copies of its half's outputs
    number: dict = {}   # forward call node -> its position, which numbers its backward's copies too
    constants: dict = {}
    for k, n in enumerate(gm.graph.nodes):
        if n.target is operator.getitem and n.args[0] in outs:
            env[n] = outs[n.args[0]][n.args[1]]
        elif is_call(n):
            k = number.setdefault(n, k) if n.target.kind == "forward" else _forward_number(n, number, k)
            outs[n] = _stamp(g, n, [env[a] for a in n.args[0]], k, constants)
        else:
            env[n] = copy_node(g, n, env.__getitem__)
            if n.op == "get_attr":
                constants[n.target] = getattr(gm, n.target)
    flat = fx.GraphModule(constants, g, class_name=type(gm).__name__)
    flat.meta.update(gm.meta)
    return flat


def _forward_number(node: fx.Node, number: dict, own: int) -> int:
    """The number of the forward call whose saved values the backward call ``node`` reads: one layer's
    forward copies, the forward copies a partitioner recomputes in the backward and the backward
    copies are then one run for ``runtime.regions`` (a backend compiles each layer's backward as one
    region, not as pieces split where recomputed and backward nodes alternate). Its own forward call
    is the last one of its template it reads: the block's inputs, outputs of earlier layers, come
    from earlier calls. ``own`` where it reads none."""
    read = [number[a.args[0]] for a in node.args[0] if isinstance(a, fx.Node) and a.target is operator.getitem
            and a.args[0] in number and a.args[0].target.key == node.target.key]
    return max(read, default=own)


def _stamp(g: fx.Graph, node: fx.Node, args: list, call: int, constants: dict) -> list:
    """Copies of the nodes of the half ``node`` calls, reading ``args``, tagged as call ``call`` of
    its template for ``runtime.regions`` and, each random op, with the position the call drew it at
    (the call's ``RNG_CALL``, where known: a graph decoded from the disk cache has none); the copies
    of its outputs."""
    part = node.target
    tag = (part.key, "fw" if part.kind == "forward" else "bw", call)
    draws = iter(node.meta.get(RNG_CALL, ()))
    src = part.gm
    env = dict(zip(src.graph.find_nodes(op="placeholder"), args))
    for n in src.graph.nodes:
        if n.op == "get_attr":      # a template's constant, under the template's own name
            constants[n.target] = getattr(src, n.target)
        if n.op in ("get_attr", "call_function"):
            env[n] = c = copy_node(g, n, env.__getitem__)
            c.meta[TAG] = tag
            if is_random(n):        # the call's position, not the one the template's own trace gave it
                c.meta.pop(RNG_META, None)
                c.meta.pop(RNG_PHASE, None)
                if (at := next(draws, None)) is not None:
                    c.meta[RNG_META], c.meta[RNG_PHASE] = at
    return [env[o] if isinstance(o, fx.Node) else o for o in src.graph.output_node().args[0]]
