"""A repeated block's joint, traced once and stamped out per call.

A :class:`Template` is one block's joint graph (``(*state, *inputs, *tangents) ->
(*outputs, *grads)``) split in two: the forward nodes and the backward nodes (those
reached from a tangent). While the whole program is traced, each call of a block
that has a template becomes one ``aotgrad::block_fw`` node (outputs and the values
its backward reads) and, when autograd reaches it, one ``aotgrad::block_bw`` node;
:func:`inline_blocks` then replaces both by calls of the template's halves (its joint
partitioned once, ``partition/blocks.py``) where the template splits and its draws, if any, are
the trace's own (:func:`_draws_in_order`), else by copies of the template's nodes, the graph a
flat trace would have made::

    before: r = block_fw([w, x], 3); y = r[0] ... g = block_bw([w, x, t], 3)
    halves: r = block3_forward([w, x]); y = r[0]; s = r[1] ... g = block3_backward([w, s, t])
    copies: a = mm(x, w); y = relu(a) ... g = threshold_backward(t, y, 0) ...

The gradients of a block's own parameters do not pass through the joint's trace at all: a
``block_bw`` node returns only the gradients autograd must route on (its arguments'), and
:func:`inline_blocks` writes each parameter's gradient from the stamped backward straight into
the joint's output (see :class:`Direct`). Tracing a dozen more outputs per block through
functionalization, the proxy tracer and the autograd engine was a third of a deep model's trace.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import (
    FunctionalTensor, copy_node, detect_fake_mode, fake_cache_off, fresh_fakes, no_stack_traces, traced_call,
)
from ..ir.ops import is_random
from ..partition.blocks import call_backward, call_forward, item, partition_block
from ..passes import rng_positions
from ..passes.rng import positions, replays_or_rewinds
from ..passes.rng_layout import needs_memory_order
from ..runtime import regions
from .. import tracing

# key -> Template, read by the fake kernels while a capture traces. A registry, not scoped state:
# each key comes from blocks._keys once, so concurrent captures never share an entry.
TEMPLATES: dict = {}
# node number -> (call, bound, direct) of the block nodes a joint trace is making (Direct.calls); a
# registry for the same reason, and because the autograd engine may run a backward in its own thread.
CALLS: dict = {}

_LIB = torch.library.Library("aotgrad", "FRAGMENT")
# What else a call needs (which inputs are unseen, which gradients are written directly) is kept
# by call number in the joint's Direct (``calls``), not in the nodes: every int argument of a node
# costs the tracer as much as a tensor.
_LIB.define("block_fw(Tensor[] ins, int key, int call) -> Tensor[]")
_LIB.define("block_bw(Tensor[] ins, int key, int call) -> Tensor[]")
_calls = itertools.count()


def _never_run(ins, key, call):
    raise AssertionError("aotgrad::block_fw/block_bw run for real: the capture should have inlined them")


def _empty(ins, metas):
    return fresh_fakes(ins[0].fake_mode if ins else detect_fake_mode(), metas)


for _name in ("block_fw", "block_bw"):
    _LIB.impl(_name, _never_run, "CompositeExplicitAutograd")
def _bw_metas(key, call):
    direct = CALLS[call][2] if call in CALLS else None
    t = TEMPLATES[key]
    return [m for i, m in zip(t.grad_at, t.bw_metas) if direct is None or not direct[i]]


torch.library.register_fake("aotgrad::block_fw", lambda ins, key, call: _empty(ins, TEMPLATES[key].fw_metas), lib=_LIB)
torch.library.register_fake("aotgrad::block_bw", lambda ins, key, call: _empty(ins, _bw_metas(key, call)), lib=_LIB)


def _meta(node: fx.Node) -> tuple:
    v = node.meta["val"]
    return tuple(v.shape), tuple(v.stride()), v.dtype, v.device


@dataclass(frozen=True)
class Template:
    key: int
    n_in: int                # state tensors, then the call's tensor arguments
    out_spec: object         # pytree spec of the block's output
    n_out: int
    differentiable: tuple    # output positions autograd differentiates (tangents, in order)
    fw_nodes: tuple          # template nodes the forward copies, in graph order
    fw_outs: tuple           # the block's outputs
    bw_nodes: tuple          # they read the forward's copies of the values they need
    bw_ins: tuple            # primal placeholders, tangent placeholders
    bw_outs: tuple           # grads that are not None
    grad_at: tuple           # input position of each grad in bw_outs
    fw_metas: tuple
    bw_metas: tuple
    graph: fx.GraphModule    # keeps the nodes alive
    views: tuple = ()        # per block output: None (plain) or the OutputInfo of a view of a returned base
    random: tuple = ()       # the forward's random nodes, in draw order
    random_devices: tuple = ()
    summed: tuple = ()       # input positions with a gradient that the forward uses more than once
    copies: tuple = ()       # per input after the first n_in - len(copies): the position it repeats


def split(key: int, joint: fx.GraphModule, n_in: int, out_spec, differentiable, grad_of, views=(),
          first_argument: int = 0) -> Template:
    """The template of a block joint ``(*ins, *tangents) -> (*outs, *grads)``. An argument (an input
    from ``first_argument`` on) whose gradient the engine added up from several uses is taken once
    more per extra use (:func:`_separate`): each call passes it again, and each copy's gradient is
    one use's, so that the joint's engine adds them up in order, with whatever else reaches it."""
    ph = [n for n in joint.graph.nodes if n.op == "placeholder"]
    primals, tangents = ph[:n_in], ph[n_in:]
    outs = list(joint.graph.output_node().args[0])
    n_out = len(outs) - len(grad_of)
    fw_vals, grads = outs[:n_out], outs[n_out:]
    bw = set(tangents)
    for n in joint.graph.nodes:
        if n.op == "call_function" and any(a in bw for a in n.all_input_nodes):
            bw.add(n)
    body = [n for n in joint.graph.nodes if n.op not in ("placeholder", "output")]
    for n in body:      # constants named as this template's own, so copies in a joint never clash
        if n.op == "get_attr":
            name = f"_aotgrad_block{key}_{n.target}"
            setattr(joint, name, getattr(joint, n.target))
            n.target = name
    fw_nodes = tuple(n for n in body if n not in bw)
    bw_nodes = tuple(n for n in body if n in bw)
    fw_set = set(fw_nodes)
    bw_outs = tuple(g for g in grads if g is not None)
    grad_at = tuple(i for i, g in zip(grad_of, grads) if g is not None)
    assert all(v in fw_set or v in primals for v in fw_vals), "a block output depends on a tangent"
    fw_outs = tuple(fw_vals)
    random = tuple(n for n in fw_nodes if is_random(n))
    summed = tuple(i for i in grad_at if sum(_uses(u, primals[i]) for u in primals[i].users if u in fw_set) > 1)
    engine, counts = joint.meta.get("aotgrad engine sums") or (frozenset(), {})
    parts = {i: _summands(bw_outs[grad_at.index(i)], engine, counts.get(i, 0))
             for i in summed if i >= first_argument}
    parts = {i: p for i, p in parts.items() if p is not None}
    copies, extra = _separate(joint.graph, primals, parts)
    if parts:
        dropped = {a for p in parts.values() for a in p[0]}
        while any(u not in dropped and u.op != "output" for a in dropped for u in a.users):
            dropped = {a for a in dropped if all(u in dropped or u.op == "output" for u in a.users)}
        bw_nodes = tuple(n for n in bw_nodes if n not in dropped)
        bw_outs = tuple(parts[i][1][0] if i in parts else g for i, g in zip(grad_at, bw_outs)) + tuple(
            g for i in parts for g in parts[i][1][1:])
        grad_at = grad_at + tuple(range(n_in, n_in + len(copies)))
        summed = tuple(i for i in summed if i not in parts)
    return Template(key, n_in + len(copies), out_spec, n_out, tuple(differentiable), fw_nodes, fw_outs, bw_nodes,
                    tuple(primals) + tuple(extra) + tuple(tangents), bw_outs, grad_at,
                    tuple(_meta(v) for v in fw_outs), tuple(_meta(g) for g in bw_outs), joint, views,
                    random, tuple(rng_positions.node_device(n) for n in random), summed, copies)


def _summands(g: fx.Node, engine: frozenset, count: int):
    """``(the engine's additions, the gradients they add)`` of an input's gradient ``g``, the sum of
    ``count`` gradients, in the order the engine added them (``(a + b) + c``: ``a, b, c``); None
    unless ``count > 1`` and ``g`` is that many engine additions deep."""
    adds, parts = [], []
    for _ in range(count - 1):
        if not (g.op == "call_function" and g.target is torch.ops.aten.add.Tensor and g.name in engine
                and len(g.args) == 2 and not g.kwargs and all(isinstance(a, fx.Node) for a in g.args)):
            return None
        adds.append(g)
        parts.append(g.args[1])
        g = g.args[0]
    return (tuple(adds), (g, *reversed(parts))) if count > 1 else None


def _separate(graph: fx.Graph, primals: list, parts: dict) -> tuple:
    """One more placeholder (after the primals) per extra use of each input in ``parts``: ``(the
    position each repeats, the placeholders)``."""
    copies, extra = [], []
    last = primals[-1] if primals else None
    for i, (_, got) in parts.items():
        for k in range(1, len(got)):
            with graph.inserting_after(last):
                p = last = graph.placeholder(f"{primals[i].name}_use{k}")
            p.meta = dict(primals[i].meta)
            copies.append(i)
            extra.append(p)
    return tuple(copies), extra


def _uses(user: fx.Node, p: fx.Node) -> int:
    """How many of ``user``'s arguments are ``p``: ``x * x`` and ``cat([x, x])`` use ``x`` twice,
    and autograd adds the gradients of the two uses up as it does those of two ops."""
    seen: list = []
    fx.node.map_arg((user.args, user.kwargs), seen.append)
    return sum(a is p for a in seen)


class Direct:
    """The joint's inputs whose gradients block calls hand straight to the joint's output, and
    those the trace does not see at all.

    ``slots`` maps each input the joint differentiates (by the identity of its traced tensor) to
    its gradient's position in the joint's output, counted from the end (so never 0). A block
    call that receives such a tensor remembers the slot; its backward, when the joint's own
    ``autograd.grad`` runs it (``backward``), returns no gradient for it and :func:`inline_blocks`
    writes the stamped gradient into the slot. A tensor two block calls receive is ``contested``:
    autograd sums its gradients, as in a flat trace, so that it adds them in the same order.

    ``unseen`` maps stand-ins to input indices: a parameter or buffer only one block uses is not
    an input of the traced function (placeholders, functional wrappers and block arguments cost
    as much per tensor as the rest of a deep model's trace together); its block call binds the
    template to the joint's input by index. Anything else that reaches a stand-in (an op outside
    the blocks, a second call claiming its gradient) sets ``missed``: the joint is traced again
    with every input seen."""

    def __init__(self, slots: dict, unseen: dict | None = None):
        self.slots = slots
        self.unseen = unseen or {}
        self.claimed: set = set()
        self.contested: set = set()
        self.backward = False
        self.missed = False
        self.calls: dict = {}       # node number -> (call, bound, direct), for the fake kernel and inline_blocks
        self.rng: dict = {}         # forward call number -> stream positions of its random nodes
        self.origins: dict = {}     # forward call number -> the call it stands for (blocks.Reuse.call)
        self.flat: dict = {}        # call (origin) -> why a template cannot stand for it (FlatCall)

    def claim(self, ins) -> tuple:
        slots = tuple(self.slots.get(id(x), 0) for x in ins)
        for x, s in zip(ins, slots):
            if s:
                if s in self.claimed:
                    self.contested.add(s)
                    self.missed = self.missed or id(x) in self.unseen
                self.claimed.add(s)
        return slots

    def record(self, number: int, call: int, bound: tuple, direct: tuple) -> None:
        """A block node: its own number, its call's (the forward's), what it binds and returns."""
        self.calls[number] = CALLS[number] = (call, bound, direct)

    def forget(self) -> None:
        """Drop this trace's calls from the registry (inline_blocks reads them from ``calls``)."""
        for c in self.calls:
            CALLS.pop(c, None)

    def bound(self, ins) -> tuple:
        return tuple(self.unseen.get(id(x), -1) for x in ins)

    def at_backward(self, slots: tuple) -> tuple:
        return tuple(0 if s in self.contested else s for s in slots) if self.backward else (0,) * len(slots)

    def touches(self, args, kwargs) -> bool:
        """Whether an op's arguments include a stand-in (then ``missed``)."""
        ids = self.unseen
        for a in (*args, *kwargs.values()):
            if id(a) in ids or (type(a) in (list, tuple) and any(id(x) in ids for x in a)):
                self.missed = True
                return True
        return False


class UnseenUsed(Exception):
    """An op outside the blocks read an input the trace does not see: the joint is traced again."""


class FlatCall(Exception):
    """The joint trace found block calls a template cannot stand for bit for bit: ``calls`` maps
    each (see ``blocks.Reuse.call``) to why; the joint is traced again with them flat. An output's
    gradient that is not contiguous (a permute after the block, the ``expand`` of a ``sum()``: the
    template's backward was traced for a contiguous one, and a matmul of another layout sums in
    another order), or an input the template uses twice that also reaches something else (the
    template sums the two uses' gradients before the rest is added; a flat trace adds all of them
    in the order they come). A trace finds them all (:attr:`Direct.flat`), so one more trace does."""

    def __init__(self, calls: dict):
        super().__init__(f"block calls {sorted(calls)}: {sorted(set(calls.values()))}")
        self.calls = calls


class SharedGradient(Exception):
    """A directly written gradient also has another contribution: the joint is traced again
    without direct gradients, so that autograd adds them up in a flat trace's order."""


class BlockFunction(torch.autograd.Function):
    """One call of a templated block: a ``block_fw`` node forward, a ``block_bw`` node backward.
    Each node carries a number of its own; the joint's :attr:`Direct.calls` maps it to its call
    (the forward's number), so a backward's copy reads the values of its forward's copy.
    ``bound`` and ``slots`` (per input) come from :meth:`Direct.bound`/:meth:`Direct.claim`; the
    inputs bound to unseen ones stay inputs of the Function (autograd knows what the block read)
    but not of its nodes."""
    aotgrad_writes_nothing = True       # no in-place writes for runtime.hooks to watch for
    aotgrad_returns_fresh = True        # never an input or a view of one (runtime.hooks.custom_view)

    @staticmethod
    def forward(ctx, key, origin, bound, slots, direct, *ins):
        t = TEMPLATES[key]
        ctx.key, ctx.call, ctx.bound, ctx.slots, ctx.direct = key, next(_calls), bound, slots, direct
        ctx.origin = origin
        passed = [x for x, b in zip(ins, bound) if b < 0]
        if direct is None:
            # The metadata pass (no joint traced): outputs of the right layout are all it needs.
            res = [FunctionalTensor.to_functional(f) for f in fresh_fakes(detect_fake_mode(), t.fw_metas)]
        else:
            direct.record(ctx.call, ctx.call, bound, (0,) * len(bound))
            direct.origins[ctx.call] = origin
            if t.random:    # the stamped copies draw here in eager's stream: take their places now
                direct.rng[ctx.call] = rng_positions.reserve(t.random_devices)
            res = _call(torch.ops.aotgrad.block_fw.default, passed, key, ctx.call, t.fw_metas)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(res) if i not in t.differentiable))
        ctx.save_for_backward(*passed)
        return tuple(res)

    @staticmethod
    def backward(ctx, *grads):
        t = TEMPLATES[ctx.key]
        if ctx.direct is not None and not ctx.direct.backward and any(b >= 0 for b in ctx.bound):
            # The program's own autograd.grad/backward: it needs the gradients of unseen inputs.
            ctx.direct.missed = True
            raise UnseenUsed("autograd inside the program reaches a block's unseen inputs")
        if any(g is not None and not g.is_contiguous() for g in grads):
            why = {ctx.origin: "an output's gradient is not contiguous (its template's backward takes a contiguous one)"}
            if ctx.direct is None:
                raise FlatCall(why)
            ctx.direct.flat.update(why)     # the trace goes on (to find the others), then is done again
            grads = tuple(g.contiguous() if g is not None else None for g in grads)
        held = list(ctx.saved_tensors)
        # The template's backward was traced for contiguous tangents (as the joint's are); its ops
        # (views, reshapes) assume that layout. A missing one is zeros.
        tangents = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                    for g, (shape, _, dtype, device) in ((grads[i], t.fw_metas[i]) for i in t.differentiable)]
        # A backward of its own number: the program's autograd.grad and the joint's may both run it.
        number, direct = next(_calls), (0,) * t.n_in
        if ctx.direct is not None:
            direct = ctx.direct.at_backward(ctx.slots)
            ctx.direct.record(number, ctx.call, ctx.bound, direct)
        got = _call(torch.ops.aotgrad.block_bw.default, held + tangents, ctx.key, number, _bw_metas(ctx.key, number))
        out: list = [None] * t.n_in
        for i, g in zip((i for i in t.grad_at if not direct[i]), got):
            out[i] = g
        return (None, None, None, None, None, *out)


def _call(op, ins: list, key: int, number: int, metas) -> list:
    """A ``block_fw``/``block_bw`` node of the joint's trace and its outputs (fresh values of ``metas``):
    recorded straight into the trace (``_torch.traced_call``), or else dispatched as any op. The node
    is replaced by the template's halves or copies, which have their own stack traces."""
    res = traced_call(op, ins, (key, number), metas) if DIRECT else None
    if res is None:
        with no_stack_traces(), fake_cache_off():
            res = op(ins, key, number)
    return res


DIRECT = True       # tests turn it off to compare the recorded block nodes with dispatched ones


def apply(t: Template, ins: list, origin) -> list:
    """The block's outputs for this call's state and arguments; ``origin`` names the call."""
    ins = [*ins, *(ins[i] for i in t.copies)]     # an argument used twice: once per use (split)
    direct = tracing.current().direct
    if direct is None:
        return list(BlockFunction.apply(t.key, origin, (-1,) * len(ins), (0,) * len(ins), None, *ins))
    return list(BlockFunction.apply(t.key, origin, direct.bound(ins), direct.claim(ins), direct, *ins))


def _is_block(n: fx.Node, op) -> bool:
    return n.op == "call_function" and n.target is op


def inline_blocks(gm: fx.GraphModule, recorded: dict, rng: dict, origins: dict, flat: dict) -> int:
    """Replace every ``block_fw``/``block_bw`` node by calls of its template's halves where they
    stand for it (``partition.blocks``: a forward node with one backward node, a template the halves
    can split), else by a copy of its template's nodes (in place); write the direct gradients into
    the output; returns how many. ``recorded``: the trace's :attr:`Direct.calls`; ``rng``: its
    :attr:`Direct.rng` (each call's random nodes' stream positions); ``origins``, ``flat``: its
    :attr:`Direct.origins`, :attr:`Direct.flat`. Raises :class:`SharedGradient`, :class:`FlatCall`."""
    fw_op, bw_op = torch.ops.aotgrad.block_fw.default, torch.ops.aotgrad.block_bw.default
    calls = [n for n in gm.graph.nodes if _is_block(n, fw_op) or _is_block(n, bw_op)]
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    flat = {**flat, **_summed_reaching_more(calls, recorded, origins, fw_op)}
    if flat:
        raise FlatCall(flat)
    backwards: dict = {}    # call number -> how many backward nodes it has
    for n in calls:
        if n.target is bw_op:
            call = recorded[n.args[2]][0]
            backwards[call] = backwards.get(call, 0) + 1
    in_order = _draws_in_order(gm, rng)
    forwards: dict = {}     # call number -> the forward copy's nodes, by template node
    kept: dict = {}         # call number -> (the halves, the call's inputs, the forward half's saved values)
    direct: dict = {}       # output slot -> the gradient's node
    for key in {n.args[1] for n in calls}:
        _hold_constants(gm, TEMPLATES[key])
    for n in calls:
        t = TEMPLATES[n.args[1]]
        primals = t.bw_ins[:t.n_in]
        call, unseen, slots = recorded[n.args[2]]
        bound = {p: inputs[b] for p, b in zip(primals, unseen) if b >= 0}
        passed = [p for p in primals if p not in bound]
        if n.target is fw_op:
            parts = halves(t) if KEEP and backwards.get(call) == 1 and (not t.random or in_order) else None
            if parts is not None:
                given = dict(zip(passed, n.args[0]))
                ins = [bound[p] if p in bound else given[p] for p in primals]
                kept[call] = (parts, ins, _keep_forward(gm.graph, n, parts, ins, rng.get(call)))
                continue
            forwards[call] = env = _stamp(gm.graph, n, bound, passed, t.fw_nodes, t.fw_outs, (t.key, "fw", call))
            if t.random:
                assert rng.get(call) is not None, "a block's random ops were stamped without stream positions"
                for node, at in zip(t.random, rng[call]):
                    rng_positions.tag(env[node], at)
            continue
        if call in kept:
            grads = _keep_backward(gm.graph, n, t, *kept[call], slots)
            for i, g in grads.items():
                assert slots[i] not in direct, "a contested gradient was written directly"
                direct[slots[i]] = g
            continue
        kept_grads = [g for i, g in zip(t.grad_at, t.bw_outs) if not slots[i]]
        env = _stamp(gm.graph, n, forwards[call], passed + list(t.bw_ins[t.n_in:]), t.bw_nodes, kept_grads,
                     (t.key, "bw", call))
        for i, g in zip(t.grad_at, t.bw_outs):
            if slots[i]:
                assert slots[i] not in direct, "a contested gradient was written directly"
                direct[slots[i]] = env[g]
    if direct:
        _write_direct(gm.graph, direct)
    if calls:
        gm.recompile()
    return len(direct)


KEEP = True     # tests turn it off to compare calls of a block's halves with copies of its nodes
_HALVES: dict = {}      # template key -> its BlockParts, or None (a true cache: a template never changes)


def halves(t: Template):
    """The template's joint partitioned once (``partition.blocks.partition_block``), or None (also
    for draws that must fill a permuted layout in memory order: ``passes.rng_layout`` rewrites those
    in the flat graph, not in a half)."""
    if t.key not in _HALVES:
        _HALVES[t.key] = None if needs_memory_order(t.random) else partition_block(
            t.key, t.graph, t.bw_ins[:t.n_in], t.bw_ins[t.n_in:], t.fw_nodes, t.fw_outs, t.bw_nodes, t.bw_outs)
    return _HALVES[t.key]


def _draws_in_order(gm: fx.GraphModule, rng: dict) -> bool:
    """Whether every draw of the trace (its random nodes', and those each call reserved, ``rng``)
    takes a stream position of its own in the forward, with no pass ending rewound: then a call of a
    half draws eager's numbers in the forward graph, as its copies would (``passes.rng`` has nothing
    to share or restore). A checkpointed block's recomputation or a ``fork_rng`` around a block is
    copied instead."""
    reserved = [p for at in rng.values() if at is not None for p in at]
    drawn = positions([n for n in gm.graph.nodes if is_random(n)]) + [at for at, _ in reserved]
    return (all(at[1] == "fw" and phase == "fw" for at, phase in reserved)
            and not replays_or_rewinds(drawn, gm.meta.get(rng_positions.ENDS, {})))


def _keep_forward(graph: fx.Graph, n: fx.Node, parts, ins: list, draws) -> list:
    """``n`` (a ``block_fw`` node) replaced by a call of the forward half; its saved values. ``draws``:
    the stream positions the call reserved for the template's random ops."""
    node, saved = call_forward(graph, parts, ins, before=n, draws=draws)
    for u in list(n.users):
        assert u.target is operator.getitem, "a block call's result is read other than by index"
        u.update_arg(0, node)       # the half returns the outputs first
    graph.erase_node(n)
    return saved


def _keep_backward(graph: fx.Graph, n: fx.Node, t: Template, parts, ins: list, saved: list, slots: tuple) -> dict:
    """``n`` (a ``block_bw`` node) replaced by a call of the backward half; the gradients written
    directly, by input position."""
    given = list(n.args[0])
    tangents = given[len(given) - parts.n_tangents:] if parts.n_tangents else []
    node = call_backward(graph, parts, ins, saved, tangents, before=n)
    returned = [j for j, i in enumerate(t.grad_at) if not slots[i]]     # what n returned, by the half's order
    for u in list(n.users):
        assert u.target is operator.getitem, "a block call's result is read other than by index"
        u.args = (node, returned[u.args[1]])
    graph.erase_node(n)
    return {i: item(graph, node, j) for j, i in enumerate(t.grad_at) if slots[i]}


def _hold_constants(gm: fx.GraphModule, t: Template) -> None:
    """The template's constant tensors (``torch.tensor([])`` in the block) as attributes of ``gm``,
    under the names :func:`split` gave them: one tensor for every copy (a graph never writes a constant)."""
    for node in t.fw_nodes + t.bw_nodes:
        if node.op == "get_attr" and not hasattr(gm, node.target):
            setattr(gm, node.target, getattr(t.graph, node.target))


def _summed_reaching_more(calls: list, recorded: dict, origins: dict, fw_op) -> dict:
    """The block calls (origins, with why) whose input that their template uses twice (and so sums
    the gradients of) is read by anything but that call's own block nodes."""
    own: dict = {}      # call number -> its block_fw and block_bw nodes
    for n in calls:
        own.setdefault(recorded[n.args[2]][0], set()).add(n)
    found = {}
    for n in calls:
        t = TEMPLATES[n.args[1]]
        if n.target is not fw_op or not t.summed:
            continue
        call, unseen, _ = recorded[n.args[2]]
        passed = [i for i, b in enumerate(unseen) if b < 0]    # template input positions the node takes
        if any(i in t.summed and any(u not in own[call] and not _reads_layout_only(u) for u in x.users)
               for x, i in zip(n.args[0], passed)):
            found[origins[call]] = ("an input it uses twice reaches more than the block (the template would "
                                    "sum its two gradients before the others)")
    return found


def _reads_layout_only(n: fx.Node) -> bool:
    """A node that reads its first argument's sizes alone (``rand_like(x)``, ``x.size(0)``): no
    gradient comes back through it."""
    return n.op == "call_function" and getattr(n.target, "_overloadpacket", None) in _LAYOUT_ONLY


_LAYOUT_ONLY = {getattr(torch.ops.aten, name) for name in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset")}


def _write_direct(graph: fx.Graph, direct: dict) -> None:
    out = graph.output_node()
    vals = list(out.args[0])
    for slot, g in direct.items():
        if vals[slot] is not None:      # also used outside the blocks: autograd added a gradient
            raise SharedGradient
        vals[slot] = g
    out.args = (type(out.args[0])(vals),)


def _stamp(graph: fx.Graph, call: fx.Node, env: dict, params, nodes, outs, tag) -> dict:
    """Copy ``nodes`` before ``call`` with ``params`` bound to the call's inputs and other nodes to
    their copies in ``env``, each tagged ``regions.TAG: tag`` (a backend compiles equal copies once);
    the call's users read the copies. Returns the copies by template node."""
    env = {**env, **dict(zip(params, call.args[0]))}
    with graph.inserting_before(call):
        for n in nodes:
            env[n] = c = copy_node(graph, n, env.__getitem__)
            c.meta[regions.TAG] = tag
    for u in list(call.users):
        assert u.target is operator.getitem, "a block call's result is read other than by index"
        u.replace_all_uses_with(env[outs[u.args[1]]])
        graph.erase_node(u)
    graph.erase_node(call)
    return env
