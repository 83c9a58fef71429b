"""Fold view chains that end where they began.

A chain of view ops whose last value has the same dtype, sizes, strides and storage offset as a
value earlier in the chain reads the same memory as that value: ``t(t(w))`` is ``w``, a ``view`` or
``expand`` to the size it already has, ``unsqueeze`` then ``squeeze``, ``permute`` then its inverse.
The eager backend runs each as one Python call, and an autograd formula's backward is full of them
(``t(t(saved_t(w)))`` for every linear layer)::

    forward:  t = t(w); y = addmm(b, x, t)             forward:  t = t(w); y = addmm(b, x, t)
    backward: g_x = mm(g, t(t))                   ->   backward: g_x = mm(g, w)
              g_w = t(t(mm(t(g), x)))                          g_w = mm(t(g), x)

The pass runs on the joint graph before partitioning, so a chain the partition would cut (the
forward saves ``t(w)``, the backward transposes it back) folds too, and the forward saves ``w``.

What it keeps (only values and storage sharing are the same; the tensor object is not):

* a forward output (the user's tensor: eager returns it as a view, of that base), an argument of an
  op that writes in place or has no result (a check, ``aotgrad::retain_grad``), of a block call or
  of any other non-ATen target; a chain in an alias family some op writes in place;
* a gradient output folded onto a placeholder or onto a value the graph returns already, which
  would hand autograd one tensor in two places where eager hands it two views;
* a chain through ``as_strided`` (a layout spelled in numbers, not derived from the input's), and
  sizes or strides not provably equal: static ints, or symbolic sizes with identical expressions.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch import OpOverload
from ..ir.ops import aliases_input, mutated_args
from .cleanup import drop_dead, copy_module


FOLDED = "aotgrad views folded"       # joint.meta: capture folded it in place (fold_views_owned)


def fold_views(joint: fx.GraphModule, n_fw: int) -> fx.GraphModule:
    """A copy of ``joint`` (``n_fw`` forward outputs, then gradients) with its view chains folded;
    ``joint`` itself when there is none, or when capture folded it already."""
    if joint.meta.get(FOLDED):
        return joint
    plan = _plan(joint.graph, n_fw)
    if not plan:
        return joint
    gm = copy_module(joint)
    env = dict(zip(joint.graph.nodes, gm.graph.nodes))
    _fold(gm.graph, {env[n]: (env[base], out) for n, (base, out) in plan.items()})
    drop_dead(gm.graph)
    gm.recompile()
    return gm


def fold_views_owned(joint: fx.GraphModule, n_fw: int) -> int:
    """``fold_views`` in place, for capture's fresh joint (its dead nodes and code left to
    ``simplify_owned``): a compile of it then finds nothing more to fold and copies nothing.
    Returns how many views it folded."""
    plan = _plan(joint.graph, n_fw)
    _fold(joint.graph, plan)
    joint.meta[FOLDED] = True
    return len(plan)


def _fold(g: fx.Graph, plan: dict) -> None:
    out = g.output_node()
    for node, (base, fold_output) in plan.items():
        node.replace_all_uses_with(base, delete_user_cb=lambda u: u is not out and _reads_only(u)
                                   or u is out and fold_output)


def _plan(g: fx.Graph, n_fw: int) -> dict:
    """``{view node: (the value it equals, whether a gradient output may take that value)}``."""
    written = {_root(a) for n in g.nodes if isinstance(n.target, OpOverload)
               for a in _written(n) if isinstance(a, fx.Node)}
    outs = g.output_node().args[0]
    fw_outs = {o for o in outs[:n_fw] if isinstance(o, fx.Node)}
    returned = {o for o in outs if isinstance(o, fx.Node)}
    plan, taken = {}, set()
    for n in g.nodes:
        if not _is_view(n) or _root(n) in written:
            continue
        base = _same_as(n)
        if base is None:
            continue
        # A gradient may become its base only where that gives autograd a tensor no other output is.
        fold_output = (n not in fw_outs and base.op != "placeholder" and base not in returned and base not in taken)
        if fold_output and n in returned:
            taken.add(base)
        plan[n] = (base, fold_output)
    return plan


def _is_view(n: fx.Node) -> bool:
    t = n.target
    return (n.op == "call_function" and isinstance(t, OpOverload) and len(t._schema.returns) == 1
            and aliases_input(n) and not mutated_args(t) and isinstance(n.args[0], fx.Node)
            and not any(a.name == "stride" for a in t._schema.arguments)      # as_strided
            and isinstance(n.meta.get("val"), torch.Tensor) and isinstance(n.args[0].meta.get("val"), torch.Tensor))


def _root(n: fx.Node) -> fx.Node:
    """The value whose memory ``n`` reads (through views, multi-output ones included)."""
    while n.op == "call_function" and (n.target is operator.getitem or aliases_input(n)) and n.args \
            and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _written(n: fx.Node) -> list:
    names = set(mutated_args(n.target))
    if not names:
        return []
    schema = n.target._schema.arguments
    return [a for s, a in zip(schema, n.args) if s.name in names] + [v for k, v in n.kwargs.items() if k in names]


def _same_as(n: fx.Node) -> fx.Node | None:
    """The earliest value up ``n``'s view chain laid out as ``n`` is."""
    key, found, a = layout_key(n.meta["val"]), None, n.args[0]
    while True:
        if layout_key(a.meta["val"]) == key:
            found = a
        if not _is_view(a):
            return found
        a = a.args[0]


def layout_key(t: torch.Tensor) -> tuple:
    """What decides which memory a view reads and how (the conjugate and negative bits); a symbolic
    size as its expression (comparing two SymInts with ``==`` would add a guard)."""
    def exact(v):
        return v.node.expr if isinstance(v, torch.SymInt) else int(v)
    if t.layout != torch.strided:
        return (object(),)      # sparse or another layout: equal to nothing else
    return (t.dtype, t.device, tuple(map(exact, t.shape)), tuple(map(exact, t.stride())),
            exact(t.storage_offset()), t.is_conj(), t.is_neg())    # conj() is a view of the same layout


def _reads_only(user: fx.Node) -> bool:
    """A use that reads the value and nothing more: an ATen op with a result that writes nothing."""
    t = user.target
    return (user.op == "call_function" and isinstance(t, OpOverload) and t.namespace in ("aten", "prims")
            and bool(t._schema.returns) and not mutated_args(t))
