"""A backward for a call where some outputs got no gradient: their tangents are zeros made inside
the graph, just before their first use, instead of graph inputs.

Autograd hands a Function zeros for an output nobody differentiated (a model's logits, returned
beside the loss), made before the backward starts and held until it ends: on a language model, a
vocabulary-sized tensor alive through the backward's peak, which eager (no such output: the logits
die unused) never allocates. The compiled Function asks autograd for ``None`` instead
(``set_materialize_grads(False)``) and runs the graph this pass makes, once per set of missing
tangents: the same zeros, the same arithmetic, but alive only from their first use to their last
(and a compiler that fuses sees constants)::

    backward(saved, t_loss, t_logits):  g = nll_loss_backward(t_loss, ...); ...; d = add(t_logits, g)
    zeroed (t_logits missing):          g = nll_loss_backward(t_loss, ...); ...; z = zeros(...); d = add(z, g)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import FakeTensor, copy_graph, lazy_graph_module
from ..partition.default import descendants
from .cleanup import drop_dead


def zeroable(tangent: fx.Node) -> bool:
    """Whether the pass can make ``tangent`` in the graph: a plain tensor of static sizes (a symbolic
    size may name no value of the backward; a subclass is no ``zeros``)."""
    v = tangent.meta.get("val")
    return type(v) is FakeTensor and all(type(s) is int for s in v.shape)


def zero_tangents(bw: fx.GraphModule, n_tangents: int, missing: tuple) -> fx.GraphModule:
    """``bw`` (its last ``n_tangents`` inputs the tangents) without the tangents at positions
    ``missing``: each is contiguous zeros (what autograd materializes), made before its first use.
    A gradient that only missing tangents reach is None, not zeros: eager's backward never reaches
    that input (the outputs it feeds got no gradient), so its ``.grad`` stays None (an optimizer then
    skips it: no weight decay, no moment update). Its hooks still run, with None: the node's edge to it
    is fixed at the forward."""
    g, env = fx.Graph(), {}
    g.output(copy_graph(g, bw.graph, env))
    order = {n: i for i, n in enumerate(g.nodes)}
    tangents = g.find_nodes(op="placeholder")[-n_tangents:]
    _unreached_none(g, [tangents[i] for i in missing], [t for i, t in enumerate(tangents) if i not in missing])
    for i in missing:
        t = tangents[i]
        v = t.meta["val"]
        if t.users:
            with g.inserting_before(min(t.users, key=order.__getitem__)):
                z = g.call_function(torch.ops.aten.zeros.default, (list(v.shape),),
                                    {"dtype": v.dtype, "layout": torch.strided, "device": v.device,
                                     "pin_memory": False})
            z.meta["val"] = v
            t.replace_all_uses_with(z)
        g.erase_node(t)
    return lazy_graph_module(bw, g, type(bw).__name__)


def _unreached_none(g: fx.Graph, missing: list, present: list) -> None:
    """Each output that a missing tangent reaches and no present one does becomes None."""
    by_missing, by_present = descendants(missing), descendants(present)
    out = g.output_node()
    vals = out.args[0]
    if not isinstance(vals, (tuple, list)):
        return
    new = [None if isinstance(v, fx.Node) and v in by_missing and v not in by_present else v for v in vals]
    if new != list(vals):
        out.args = (type(vals)(new),)
        drop_dead(g)     # what only those gradients needed; collectives and random ops stay
