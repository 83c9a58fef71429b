"""Trace the joint forward+backward function into one functional ATen graph.

The joint function takes ``(*primals, *tangents)`` and returns
``(*forward_values, *grads)`` where the forward values are, in order, the new
values of data-mutated inputs, the plain outputs and the hidden bases of
outputs that are views of intermediates (see :mod:`aotgrad.ir.records`).
"""
from __future__ import annotations

import contextlib

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch import (
    as_traced_by_make_fx, fake_like, lazy_graph_modules, modules_called_as_now, traceable_subclass, register_stack_trace_anchor, symbolic_dispatch, tracing_graph, user_stack_traces,
    version_counter,
)
from ..ir.records import Analysis, JointLayout, forward_values
from ..runtime.modes import autocast_off
from ..inputs.flatten import module_state
from ..inputs.subclasses import Promoted, SubclassGradient
from ..errors import UnsupportedError, caller_line
from ..scoped import FX_TRACING
from ..passes.rng_positions import backward_begins
from .. import errors, tracing
from ..guards import reads
from .block_graph import Direct, UnseenUsed
from .session import Session, traceable_ops, from_functional, functional_mode, to_functional


def joint_function(flat_fn, analysis: Analysis, lay: JointLayout, grad_enabled: bool,
                   direct_grads: bool = False, unseen: dict | None = None, engine_sums: bool = False):
    """``direct_grads``: repeated blocks hand their inputs' gradients straight to the output;
    ``unseen``: ``{input index: fake}`` of inputs the traced function does not take (only repeated
    blocks read them; see :class:`.block_graph.Direct`). Either needs :func:`.inline_blocks`.
    The last call's :class:`.block_graph.Direct` is ``joint.direct``; with ``engine_sums``, the
    names of the nodes the autograd engine made itself are ``joint.engine_sums`` (:class:`EngineSums`)."""
    unseen = unseen or {}

    def joint(*flat):
        user_stack_traces()
        n_seen = lay.n_primals - len(unseen)
        seen, tangents = iter(flat[:n_seen]), flat[n_seen:]
        with functional_mode():
            # An unseen input's stand-in is its fake itself: only block calls read it (Direct checks).
            f_ins = [unseen[i] if i in unseen else to_functional(next(seen)) for i in range(lay.n_primals)]
            # Mutating a clone keeps the original value for autograd.grad to differentiate (a layout
            # change alone, a view: its own layout and storage).
            call_ins = [f.clone() if info.mutates_data and info.requires_grad and lay.grad_of else
                        f.view_as(f) if info.meta_seen and lay.grad_of else f
                        for f, info in zip(f_ins, analysis.inputs)]
            n = len(lay.grad_of)
            # Read only by calls of reused blocks: a trace with none makes none.
            direct = joint.direct = Direct(
                {id(call_ins[i]): k - n for k, i in enumerate(lay.grad_of) if call_ins[i] is f_ins[i]}
                if direct_grads else {}, {id(f_ins[i]): i for i in unseen}) \
                if direct_grads or unseen or tracing.current().blocks is not None else None
            with tracing.scope(direct=direct):
                versions = [version_counter(t) for t in call_ins]
                with torch.set_grad_enabled(grad_enabled), reads.user_code():
                    outs = flat_fn(*call_ins)
                joint.replaced = getattr(outs, "replaced", ())
                fw = forward_values(call_ins, outs, analysis)
                grads = [None] * n
                # An input written without a version bump (a batch norm's running statistics): the
                # runtime puts its version back after the write-back, as eager's kernel never bumps it.
                joint.quiet = tuple(i for i, (t, v) in enumerate(zip(call_ins, versions))
                                    if v is not None and analysis.inputs[i].mutates_data and version_counter(t) == v)
                if lay.grad_of:
                    joint.eager_saved = eager_saved_inputs([fw[i] for i in lay.tangent_of], call_ins)
                    n_written = len(analysis.mutated())     # (a later call's backward comes through these)
                    joint.eager_reruns = not eager_saves([fw[i] for i in lay.tangent_of if i < n_written])
                    backward_begins()
                    if direct is not None:
                        direct.backward = True
                    # The backward runs where .backward() is called, outside the caller's autocast
                    # (autocast regions are for the forward): its casts are the forward's alone.
                    # On this thread (not the engine's device threads): the per-thread state the
                    # trace reads (module state, RNG log, hook recorder) holds for a recompute too.
                    sums = EngineSums([fw[i] for i in lay.tangent_of], f_ins) if engine_sums else contextlib.nullcontext()
                    tangents = tuple(map(to_functional, tangents))
                    with module_state(flat_fn, call_ins), autocast_off(), \
                            torch.autograd.set_multithreading_enabled(False), reads.user_code(), \
                            reads.backward_code(runs_user_code([fw[i] for i in lay.tangent_of])), sums, \
                            tracing.scope(tangents=tangents):
                        # Every differentiated input, unseen stand-ins included: the engine runs
                        # only the backward nodes on a path to an input it is asked for, and a
                        # block's parameters get their gradients from its backward (written directly).
                        got = torch.autograd.grad(
                            [fw[i] for i in lay.tangent_of], [f_ins[i] for i in lay.grad_of], tangents,
                            allow_unused=True)
                    joint.engine_sums = (sums.names, sums.counts) if engine_sums else None
                    _subclass_grads(got, lay, f_ins)
                    for k, (i, g) in enumerate(zip(lay.grad_of, got)):
                        if i in unseen and g is not None:   # a gradient the block did not write itself
                            direct.missed = True        # (unseen inputs come with a Direct)
                        elif i not in unseen:
                            grads[k] = g
            return [from_functional(v) for v in fw] + [from_functional(g) for g in grads]
    joint.direct = None
    joint.eager_saved = joint.quiet = joint.replaced = ()
    joint.eager_reruns = False
    joint.engine_sums = None
    return joint


def _subclass_grads(grads, lay, ins) -> None:
    """A subclass input's gradient is flattened by its own unflatten's backward (``inputs.subclasses``):
    what reaches a graph input here is a plain tensor's gradient. Where that is a subclass (the input
    met one in an op, so eager's ``.grad`` is one), the capture traces again with the input promoted
    (``SubclassGradient``; ``Promoted.of`` refuses inner sizes it cannot give the carriers)."""
    found, why = {}, None
    for i, g in zip(lay.grad_of, grads):
        if traceable_subclass(g):
            found[i] = Promoted.of(g, ins[i])
            why = why or (f"the gradient of flat input {i}, a plain tensor, is a {type(g).__name__} (it met a "
                          f"{type(g).__name__} in an op, so eager's .grad would be one)")
    if found:
        raise SubclassGradient(why + ": its graph inputs were rebased (aliased inputs written), so aotgrad cannot "
                               "add inputs carrying that gradient's leaves; make the input itself that subclass, "
                               "or detach it", found, lay.n_primals, user_line=caller_line())


class EngineSums:
    """While the backward is traced, how the autograd engine added up the gradients that several
    uses send to one of ``inputs``: ``counts`` (by input index) of the gradients it got, and
    ``names`` of the nodes the engine made itself, between the code of the backward nodes (a
    node's own code runs between its pre-hook and its hook): the additions ``old + new``, one per
    gradient after the first, in the order the uses' backward ran."""

    def __init__(self, roots, inputs):
        self.graph, self.depth, self.windows, self.counts = tracing_graph(), 0, [], {}
        self.handles = []
        self.edge = {}      # (autograd node, input number) -> the input whose gradient it receives
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                e = torch.autograd.graph.get_gradient_edge(x)
                self.edge[(e.node, e.output_nr)] = i
        try:
            for node in autograd_nodes(roots):
                self.handles += [node.register_prehook(self._enter), node.register_hook(self._hook(node))]
        except RuntimeError:        # a node that takes no hooks: no counts, so nothing is split
            self._remove()
            self.edge = {}

    def _enter(self, grads):
        if self.depth == 0:
            self.start = len(self.graph.nodes)
        self.depth += 1

    def _hook(self, node):
        targets = [self.edge.get((n, nr)) for n, nr in node.next_functions]

        def exit_(grads_in, grads_out):
            self.depth -= 1
            if self.depth == 0:
                self.windows.append((self.start, len(self.graph.nodes)))
            for i, g in zip(targets, grads_in):
                if i is not None and g is not None:
                    self.counts[i] = self.counts.get(i, 0) + 1
        return exit_

    def __enter__(self):
        self.begin = len(self.graph.nodes)
        return self

    def _remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def __exit__(self, *exc):
        self._remove()
        inside = {k for a, b in self.windows for k in range(a, b)}
        made = list(self.graph.nodes)[self.begin:]
        self.names = frozenset(n.name for k, n in enumerate(made, self.begin) if k not in inside)


def autograd_nodes(roots):
    """Every autograd node the backward of ``roots`` can reach, each once."""
    seen: set = set()
    todo = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(n for n, _ in node.next_functions)


def runs_user_code(roots) -> bool:
    """Whether the backward of ``roots`` runs Python of the user's: a custom Function's ``backward``
    (aotgrad's own aside; a module's backward hooks run on torch's ``BackwardHookFunction`` node), a
    saved-tensor hook's unpack (a saved value with an unpack hook: a checkpoint's recompute too)."""
    for node in autograd_nodes(roots):
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and not getattr(cls, "aotgrad_writes_nothing", False):
            return True
        for name in _saved_names(type(node)):
            raw = getattr(node, name, None)
            if any(saved is not None and getattr(saved, "unpack_hook", None) is not None
                   for saved in (raw if isinstance(raw, (tuple, list)) else (raw,))):
                return True
    return False


def _saved_names(cls) -> tuple:
    if cls not in _SAVED_NAMES:
        _SAVED_NAMES[cls] = tuple(a for a in dir(cls) if a.startswith("_raw_saved_"))
    return _SAVED_NAMES[cls]


_SAVED_NAMES: dict = {}     # backward node class -> the attributes that hold its saved tensors, raw


def eager_saved_inputs(roots, ins) -> tuple:
    """Indices of ``ins`` that autograd saved for the backward of ``roots`` in this trace, as it does
    in eager: eager's backward checks their version counters, so writing one of them in place before
    the backward raises there (``runtime.function.version_checks`` repeats that check for the ones the
    compiled forward does not save as themselves). Saved values are read raw, never unpacked: an
    unpack runs the saved-tensor hooks (a checkpoint's recompute); one with hooks is left out."""
    index = {id(t): i for i, t in enumerate(ins) if isinstance(t, torch.Tensor)}
    found = set()
    for node in autograd_nodes(roots):
        for name in _saved_names(type(node)):
            raw = getattr(node, name, None)
            for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
                if saved is not None and getattr(saved, "unpack_hook", True) is None:
                    t = getattr(saved, "data", None)
                    if id(t) in index:
                        found.add(index[id(t)])
    return tuple(sorted(found))


def eager_saves(roots) -> bool:
    """Whether eager's autograd saved any tensor for the backward of ``roots`` (a saved-tensor hook's
    counts, unread): its nodes are released by a backward, so a second backward through them raises
    "backward through the graph a second time"; nodes that saved nothing (``add_``) run again. The
    roots are the new values of the inputs a call writes: a non-leaf input written by every call and
    backwarded after each takes every later backward through the earlier calls' nodes, and the
    compiled call's node runs again where eager's would (and it saved nothing itself)."""
    for node in autograd_nodes(roots):
        for name in _saved_names(type(node)):
            raw = getattr(node, name, None)
            for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
                if saved is not None and (getattr(saved, "unpack_hook", None) is not None
                                          or getattr(saved, "data", None) is not None):
                    return True
    return False


def _anchor_user_frames(user_fn) -> None:
    """make_fx keeps stack frames of ``forward`` methods; also keep a plain user function's own frames."""
    if callable(user_fn) and hasattr(user_fn, "__code__"):
        register_stack_trace_anchor(user_fn)


def trace_joint(session: Session, flat_fn, fake_inputs, analysis: Analysis,
                lay: JointLayout, user_fn=None, direct_grads: bool = False,
                unseen: frozenset = frozenset(), engine_sums: bool = False) -> torch.fx.GraphModule:
    """The joint graph; ``direct_grads`` and ``unseen`` (input indices) as in :func:`joint_function`.
    Raises :class:`.block_graph.UnseenUsed` when something other than one block read an unseen input."""
    with session.fake_mode:
        tangents = [torch.empty_strided(analysis.fake_outputs[i].shape,
                                        _contiguous_strides(analysis.fake_outputs[i].shape),
                                        dtype=analysis.fake_outputs[i].dtype,
                                        device=analysis.fake_outputs[i].device)
                    for i in lay.tangent_of]
    fn = joint_function(flat_fn, analysis, lay, session.grad_enabled, direct_grads,
                        {i: fake_inputs[i] for i in unseen}, engine_sums)
    _anchor_user_frames(user_fn)
    seen = [f for i, f in enumerate(fake_inputs) if i not in unseen]
    # Inside fake mode, factory ops (torch.rand(3)) become graph nodes instead of
    # running for real (which would bake a constant and consume the real RNG).
    # An explicit (empty) decomposition table: without one, torch >= 2.14.1 turns every
    # aten.detach into aten.alias, which the clean-up cannot tell from a user's alias.
    # A lazy graph module writes its Python code only when someone reads or runs it: capture edits
    # the joint and the partitioner builds new graphs from it, so that code would be written for nothing.
    # No torch-function metadata mode (make_fx's ``node.meta["torch_fn"]``, which nothing here reads):
    # with it every torch function the program calls (``F.linear``, ``x.view``) went through a Python
    # ``__torch_function__`` first, about a seventh of a deep model's joint trace.
    try:
        with FX_TRACING, session.fake_mode, traceable_ops(), lazy_graph_modules(), modules_called_as_now(), \
                symbolic_dispatch(session.shape_env):
            gm = make_fx(as_traced_by_make_fx(fn), decomposition_table={}, pre_dispatch=False, record_stack_traces=True,
                         _allow_non_fake_inputs=True, _disable_torch_fn_metadata_mode=True)(*seen, *tangents)
    except Exception:
        if fn.direct is not None and fn.direct.missed:
            raise UnseenUsed from None
        raise
    finally:
        if fn.direct is not None:
            fn.direct.forget()
    if fn.direct is not None and fn.direct.missed:
        raise UnseenUsed
    _refuse_replaced_reads(gm, fn.replaced)
    if unseen:
        _add_inputs(gm.graph, {i: fake_inputs[i] for i in unseen}, lay.n_primals)
    d = fn.direct
    gm.meta["aotgrad block calls"] = (d.calls, d.rng, d.origins, d.flat) if d is not None else ({}, {}, {}, {})
    gm.meta["aotgrad eager saved"] = (fn.eager_saved, fn.quiet, fn.eager_reruns)
    gm.meta["aotgrad engine sums"] = fn.engine_sums
    return gm


def _refuse_replaced_reads(gm, replaced) -> None:
    """A module attribute the trace rebinds (``runtime.call.Rebound``) whose old tensor the graph also
    read (``self.t = self.t * 0.9``): the graph holds that tensor as a constant, where each later eager
    call reads the one the call before bound."""
    if not replaced:
        return
    for node in gm.graph.find_nodes(op="get_attr"):
        if any(getattr(gm, node.target, None) is t for t in replaced):
            raise errors.UnsupportedError(
                "the traced code reads a tensor held in a plain module attribute and then rebinds that attribute "
                "to a tensor it computed (state carried from call to call outside the module's buffers): the "
                "graph would read the first value on every call; register it as a buffer",
                user_line=errors.traced_line(next(iter(node.users), node).meta.get("stack_trace")))


def _add_inputs(graph: torch.fx.Graph, unseen: dict, n_primals: int) -> None:
    """Placeholders for the unseen inputs, each at its index among the joint's inputs."""
    traced = list(graph.find_nodes(op="placeholder"))
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        made = {i: graph.placeholder(f"unseen_{i}") for i in sorted(unseen)}
    for i, node in made.items():
        node.meta["val"] = fake_like(unseen[i])
    seen = iter(traced)
    order = [made[i] if i in made else next(seen) for i in range(n_primals)] + list(seen)
    for before, node in zip(order, order[1:]):
        before.append(node)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc = acc * s
    return tuple(reversed(strides))
