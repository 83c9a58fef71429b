"""Gradient accumulation into ``.grad`` as graph ops, and the pass that runs it early.

Eager's ``AccumulateGrad`` (grad mode off, dense tensors: the case captured here):
a later gradient is added into ``.grad`` in place; the first becomes ``.grad``
itself when nothing else holds it and it has the variable's strides, else a
copy in the variable's layout. The engine lifts the current ``.grad`` as an
input (its presence is part of the cache key), so in the graph that is
``variable_grad.add_(grad)``, or the copy plus one opaque ``set_grad`` call
(setting an attribute is not an ATen op) that ``steal_fresh_grads`` turns into
a hand-over when the copy is not needed.

``run_early`` moves each accumulation, with the hooks on the variable and the
post-accumulate-grad hooks, to just after the engine node that computed its
gradient: where eager runs it (``AccumulateGrad`` has the highest priority in
the engine's ready queue, so hooks keep eager's order) and where a
data-parallel reduction hook overlaps the rest of the backward. The capture's
own order is the engine's depth-first walk, which leaves some to the end.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._torch import OpOverload, is_non_overlapping_and_dense_or_false
from . import opaque

# node.meta keys: the engine node (index in capture order) that traced a graph node, and,
# for an AccumulateGrad engine node (pre-hooks, accumulation, post-accumulate hooks), the same.
ENGINE_NODE = "aotgrad_engine_node"
GROUP = "aotgrad_accumulation"


def traceable(*tensors) -> bool:
    """Dense, strided tensors only: sparse and mkldnn ``.grad`` rules stay with the opaque call."""
    return all(t is None or (t.layout == torch.strided and not t.is_mkldnn) for t in tensors)


def trace_first_grad(variable: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The value the first gradient becomes (under the capture's modes): a copy with the
    variable's strides, as eager's ``clone_obey_contract``; maybe elided later."""
    if is_non_overlapping_and_dense_or_false(variable):
        out = torch.empty_strided(variable.size(), variable.stride(), dtype=grad.dtype, device=grad.device)
        return out.copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def steal_fresh_grads(graph: fx.Graph) -> int:
    """Hand a freshly computed gradient to ``.grad`` without the copy, when eager would.

    Eager steals the incoming tensor if nothing else references it and its strides
    obey the variable's; here: the copy's source is an op's new output or a view of
    one (not an input), each link used by nothing else, with the variable's strides.
    """
    stolen = 0
    for node in list(graph.find_nodes(op="call_function", target=opaque.set_grad)):
        variable, value = node.args
        if value.target is not torch.ops.aten.copy_.default:
            continue
        empty, source = value.args
        if len(value.users) != 1 or len(empty.users) != 1 or not _fresh(source):
            continue
        want, have = variable.meta.get("val"), source.meta.get("val")
        if want is None or have is None or not _same_strides(want, have):
            continue
        node.replace_input_with(value, source)
        graph.erase_node(value)
        graph.erase_node(empty)
        stolen += 1
    return stolen


def _fresh(node: fx.Node) -> bool:
    """A new buffer nothing else reads: an op's output, or views of one, each used once."""
    while True:
        if node.op != "call_function" or len(node.users) != 1:
            return False
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        op = node.target
        if not isinstance(op, OpOverload) or op._schema.is_mutable:
            return False
        if not any(r.alias_info for r in op._schema.returns):
            return True
        node = node.args[0]   # a view: the buffer is its base's


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.stride(), b.stride()))


def run_early(graph: fx.Graph) -> int:
    """Move every accumulation group to just after the engine node that produced its
    gradient (that node's post hooks included), as eager's ready queue runs it.
    Groups that land at the same place keep their capture order. Returns how many moved."""
    groups: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if GROUP in n.meta:
            groups.setdefault(n.meta[GROUP], []).append(n)
    moved = 0
    for members in groups.values():
        order = {n: i for i, n in enumerate(graph.nodes)}
        inside = set(members)
        first = members[0]
        anchors = [a for n in members for a in n.all_input_nodes if a not in inside]
        anchor = max(anchors, key=order.__getitem__, default=None)
        if anchor is None or anchor.op == "placeholder":
            anchor = _last_placeholder(graph)
        anchor = _end_of_engine_node(anchor, first)
        if anchor.next is first:
            continue
        for n in members:
            anchor.append(n)
            anchor = n
        moved += 1
    return moved


def _end_of_engine_node(node: fx.Node, stop: fx.Node) -> fx.Node:
    """The last node, before ``stop``, of the engine node that traced ``node`` (and of
    any accumulation groups already placed right after it)."""
    step = node.meta.get(ENGINE_NODE)
    while node.next is not stop and node.next.op != "output" and (
            GROUP in node.next.meta or (step is not None and node.next.meta.get(ENGINE_NODE) == step)):
        node = node.next
    return node


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    last = None
    for n in graph.nodes:
        if n.op != "placeholder":
            return last
        last = n
    return last
