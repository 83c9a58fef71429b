"""Values the backward reads, made to cross from the forward in a smaller form it can expand exactly.

* **Max-pool indices as 1-byte window offsets.** ``max_pool2d_with_indices`` returns, per output
  element, the flat ``h * W + w`` position of the maximum (int64); its backward reads them. The
  position is always inside its window, so it is also the window offset ``r * kw + c`` (one byte
  for kernels of up to 127 elements), from which the backward recomputes the position::

      forward:  out, idx = max_pool2d_with_indices(x, ...); off = to_offsets(idx)   (runs in forward)
      backward: max_pool2d_with_indices_backward(g, x, ..., to_indices(off))

* **Dropout masks as bools.** Eager's dropout draws ``b = bernoulli(1 - p)`` (exactly 0.0 or 1.0)
  and multiplies by ``m = b / (1 - p)``; the backward multiplies by ``m`` again. It reads
  ``bool(b)`` instead and recomputes ``m`` from it: the same division of the same values, so the
  same bits, at a quarter of the bytes.

* **Softmax and log-softmax as Inductor writes them** (``decompose=True``, for a minimum cut):
  a row maximum, a row sum and pointwise ops, instead of one op whose output the backward reads.
  The cut then saves the small row statistics and the input, or what that is recomputed from,
  where it saved the output: a language model's loss upcasts its bf16 logits and saves their float
  log-softmax (twice the logits' bytes); it now saves nothing of vocabulary size but the bf16
  logits the caller holds anyway. Inductor applies the same decompositions to the graphs it
  compiles, so what the forward computes is unchanged.

Nodes that must run in the forward carry ``ir.ops.RUNS_IN_FORWARD``; the partitioners keep
them there and save them when the backward reads them. PyTorch's Inductor decomposes the joint so
that its partition saves the same (``_low_memory_max_pool2d_with_offsets``, a bool mask); the
Inductor backend runs this pass on our joint before partitioning, with ATen ops only.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch import copy_node, inductor_api
from ..ir.ops import RUNS_IN_FORWARD, draws_at_backward
from ..partition.blocks import inline_calls
from ..partition.default import descendants
from ..scoped import FX_TRACING
from .cleanup import copy_module
from .views import layout_key

_POOL = torch.ops.aten.max_pool2d_with_indices.default
_POOL_BW = torch.ops.aten.max_pool2d_with_indices_backward.default


def _pair(v, default):
    v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
    v = [v] if isinstance(v, int) else list(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _geometry(pool: fx.Node):
    """``(kernel, stride, padding, dilation)`` pairs of a max-pool node, or None when a size is symbolic."""
    names = ("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    a = {**dict(zip(names, pool.args)), **pool.kwargs}
    kernel = _pair(a["kernel_size"], None)
    geo = (kernel, _pair(a.get("stride"), kernel), _pair(a.get("padding"), 0), _pair(a.get("dilation"), 1))
    return geo if all(isinstance(v, int) for pair in geo for v in pair) else None


def _helpers(x_val, idx_val, geo):
    """``(to_offsets, to_indices)`` for one pooling's layout, as traceable functions."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geo
    width = x_val.shape[-1]
    oh, ow = idx_val.shape[-2:]

    def origins(device):
        h0 = torch.arange(oh, device=device, dtype=torch.int64).mul(sh).sub(ph).unsqueeze(-1)
        w0 = torch.arange(ow, device=device, dtype=torch.int64).mul(sw).sub(pw)
        return h0, w0

    def to_offsets(idx):
        h0, w0 = origins(idx.device)
        r = idx.div(width, rounding_mode="floor").sub(h0).div(dh, rounding_mode="floor")
        c = idx.remainder(width).sub(w0).div(dw, rounding_mode="floor")
        return r.mul(kw).add(c).to(torch.int8)

    def to_indices(off):
        h0, w0 = origins(off.device)
        off = off.to(torch.int64)
        h = off.div(kw, rounding_mode="floor").mul(dh).add(h0)
        w = off.remainder(kw).mul(dw).add(w0)
        return h.mul(width).add(w)
    return to_offsets, to_indices


def _traced(fn, args: list) -> fx.GraphModule:
    vals = [a.meta["val"] for a in args]
    with FX_TRACING, vals[0].fake_mode:
        return make_fx(fn, decomposition_table={})(*vals)


def _inline(graph: fx.Graph, fn, args: list, before: fx.Node, sub: fx.GraphModule | None = None) -> fx.Node:
    """``fn(*args)`` traced (on the args' values; ``sub``: traced already) and copied into ``graph``
    before ``before``."""
    sub = sub or _traced(fn, args)
    env = dict(zip(sub.graph.find_nodes(op="placeholder"), args))
    with graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "call_function":
                env[n] = copy_node(graph, n, env.__getitem__)
                env[n].meta.pop("stack_trace", None)
    return env[sub.graph.output_node().args[0]]


def compact_saved(joint: fx.GraphModule, n_primals: int, decompose: bool = False) -> fx.GraphModule:
    """A copy of ``joint`` with the rewrites (``joint`` itself when none applies; softmaxes and the NLL
    backward decomposed only if ``decompose``). A block's halves are opaque to the rewrites: their
    nodes are copied in first."""
    joint = inline_calls(joint)
    pools, masks = _pools(joint), _masks(joint, n_primals)
    decomposed = [n for n in joint.graph.nodes if n.target in _DECOMPOSED] if decompose else []
    if not pools and not masks and not decomposed:
        return joint
    new = copy_module(joint)
    by_name = {n.name: n for n in new.graph.nodes}
    for pool, idx, geo in pools:
        _pool_offsets(new.graph, by_name[pool.name], by_name[idx.name], geo)
    for draw, mask, uses in masks:
        _bool_mask(new.graph, by_name[draw.name], by_name[mask.name], [by_name[u.name] for u in uses])
    if decomposed:
        table = inductor_api()[2]()
        for n in decomposed:
            decomposition = _DECOMPOSED[n.target] or table.get(n.target)
            if decomposition is not None:
                _decompose(new.graph, by_name[n.name], decomposition)
    new.recompile()
    return new


def _pools(joint: fx.GraphModule) -> list:
    """``(pool, indices, geometry)`` of every max-pool whose indices only its backward reads."""
    pools = []
    for n in joint.graph.find_nodes(op="call_function", target=_POOL):
        idx = [u for u in n.users if u.target is operator.getitem and u.args[1] == 1]
        geo = _geometry(n)
        if len(idx) != 1 or geo is None or geo[0][0] * geo[0][1] > 127 or not idx[0].users \
                or any(u.target is not _POOL_BW for u in idx[0].users) \
                or any(isinstance(s, torch.SymInt) for s in (*n.args[0].meta["val"].shape, *idx[0].meta["val"].shape)):
            continue
        pools.append((n, idx[0], geo))
    return pools


def _pool_offsets(graph: fx.Graph, pool: fx.Node, idx: fx.Node, geo) -> None:
    to_offsets, to_indices = _helpers(pool.args[0].meta["val"], idx.meta["val"], geo)
    off = _inline(graph, to_offsets, [idx], idx.next)
    off.meta[RUNS_IN_FORWARD] = True
    for user in list(idx.users):
        if user.target is _POOL_BW:
            user.replace_input_with(idx, _inline(graph, to_indices, [off], user))


_BERNOULLI = torch.ops.aten.bernoulli.p
_DIV = torch.ops.aten.div.Scalar


def _masks(joint: fx.GraphModule, n_primals: int) -> list:
    """``(draw, mask, backward uses)`` of every ``mask = bernoulli(..., q) / q`` the backward reads."""
    backward = descendants(list(joint.graph.find_nodes(op="placeholder"))[n_primals:])     # of the tangents
    found = []
    for draw in joint.graph.find_nodes(op="call_function", target=_BERNOULLI):
        val = draw.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or draw in backward \
                or draws_at_backward(draw):     # it draws when backward() runs: never in the forward
            continue
        for mask in draw.users:
            if mask.target is _DIV and mask.args[0] is draw and mask.args[1] == draw.args[1] and mask not in backward:
                uses = [u for u in mask.users if u in backward]
                if uses:
                    found.append((draw, mask, uses))
    return found


def _bool_mask(graph: fx.Graph, draw: fx.Node, mask: fx.Node, uses: list) -> None:
    """The forward's uses read a mask made from the bool too, so that a partitioner recomputing
    the masked value in the backward needs only the bool (and the value masked)."""
    q, dtype = mask.args[1], mask.meta["val"].dtype

    def expand(k):
        return k.to(dtype).div(q)
    kept = _inline(graph, lambda b: b.to(torch.bool), [draw], mask)
    kept.meta[RUNS_IN_FORWARD] = True
    forward = _inline(graph, expand, [kept], mask)
    for user in uses:
        user.replace_input_with(mask, _inline(graph, expand, [kept], user))
    mask.replace_all_uses_with(forward)
    graph.erase_node(mask)


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """Inductor's decomposition (``torch._decomp``'s) with its ``scatter(zeros_like(self), ..., -1.0)``
    written as the pointwise ``where(class == target, -1.0, 0.0)`` that Inductor's own joint-graph pass
    makes of it (the same values): fused into its consumer, no class-sized buffer is made, and
    ``self`` (the log-probabilities) is read for its shape alone."""
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == 1:      # mean
        grad_output = grad_output / total_weight
    if self.dim() == 1 and target.dim() > 0:
        target = target[0]
    target = target.unsqueeze(channel_dim)
    safe_target = torch.where(target != ignore_index, target, 0)
    classes = torch.arange(self.shape[channel_dim], device=self.device)
    classes = classes.view([-1 if d == channel_dim else 1 for d in range(self.dim())])
    grad_input = torch.where(safe_target == classes, -1.0, 0.0).to(self.dtype)
    if grad_input.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        shape = [1] * self.dim()
        shape[channel_dim] = weight.shape[0]
        grad_output = grad_output * weight.reshape(shape)
    grad_output = torch.where(target != ignore_index, grad_output, 0)
    return grad_input * grad_output


_aten = torch.ops.aten
# Op -> its decomposition (None: Inductor's).
_DECOMPOSED = {_aten._softmax.default: None, _aten._log_softmax.default: None,
              _aten._softmax_backward_data.default: None, _aten._log_softmax_backward_data.default: None,
              _aten.nll_loss_backward.default: _nll_loss_backward}


def _decompose(graph: fx.Graph, node: fx.Node, decomposition) -> None:
    """``node`` replaced by ``decomposition`` traced on its arguments, where that gives its value in
    its layout (the graphs around it were traced on that layout)."""
    at = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]

    def call(*vals):
        args = list(node.args)
        for i, v in zip(at, vals):
            args[i] = v
        return decomposition(*args, **node.kwargs)
    args = [node.args[i] for i in at]
    sub = _traced(call, args)
    out = sub.graph.output_node().args[0]
    if not isinstance(out, fx.Node) or layout_key(out.meta["val"]) != layout_key(node.meta["val"]):
        return
    node.replace_all_uses_with(_inline(graph, call, args, node, sub))
    graph.erase_node(node)
