"""Stage 0 -> stage 1: ``capture(fn, *args, **kwargs) -> Captured``.

A capture, for ``jit`` and ``capture`` alike, records the Python state its trace reads
(:func:`recorded`): the trace runs under :func:`aotgrad.guards.reads.record`; an assignment
the traced code made to recorded state is undone and refused (the graph would not repeat it);
what it read is returned as ``Read`` s for :func:`aotgrad.guards.state.build`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
import types
from dataclasses import replace

import sympy
import torch

from .._torch import FakeTensor, pytree
from .. import errors
from ..ir.ops import is_random
from ..ir.records import ViewMeta
from ..runtime.call import unbound_size
from ..inputs import fsdp_graph
from ..inputs.distributed import refuse_wrapped
from ..inputs.flatten import find_groups, flat_function, rebase, signature
from ..inputs.step import step_root, step_reads
from ..guards import inputs as input_guards
from ..guards import reads, resolve
from ..guards import state as state_guards
from ..observe import timed
from ..passes import share_recomputed_randomness
from ..passes.cleanup import simplify_owned
from ..passes.input_writes import keep_written_originals
from ..passes.views import fold_views_owned
from ..passes.rng_positions import ENDS as RNG_ENDS, traced_with_positions
from .. import tracing
from ..scoped import GC_PAUSED
from ..stages import Captured, Setup
from .block_graph import FlatCall, SharedGradient, UnseenUsed, inline_blocks
from .block_groups import repeated
from .blocks import reusing, unseen_inputs
from . import stale_views
from ..partition.blocks import is_call
from ..ir.descriptors import GradDesc, MutationDesc, OutputDesc, TangentDesc, ViewBaseDesc, input_name
from ..ir.records import HookRecord, layout
from ..runtime.call import disjoint
from ..runtime.hooks import observed
from ..runtime.modes import rng_states, set_rng_states
from ..inputs.subclasses import SubclassGradient, promoted
from .analyze import analyze, without_rebound
from .joint import trace_joint
from .session import Session
from ..tracing.patches import COMPILED_AUTOGRAD_OFF

_DATA_DEPENDENT = ("DataDependentOutputException", "GuardOnDataDependentSymNode",
                   "DynamicOutputShapeException", "PendingUnbackedSymbolNotFound")
_UNSUPPORTED = ("UnsupportedOperatorException", "UnsupportedFakeTensorException")


def capture(fn, *args, dynamic: bool | None = False, reuse_blocks: bool = True, **kwargs) -> Captured:
    """Trace ``fn(*args, **kwargs)`` forward and backward into one joint graph.

    Nothing runs for real: inputs are replaced by fake tensors. ``dynamic=True``
    makes every size symbolic; tensors marked with ``torch._dynamo.mark_dynamic``
    get symbolic sizes on the marked dimensions only. ``reuse_blocks=False`` traces every
    repeated block of a module on its own (see :mod:`aotgrad.capture.blocks`).
    """
    if isinstance(fn, torch.nn.Module):
        refuse_wrapped(fn, "capture")       # DDP, FSDP1
    elif (root := step_root(fn)) is not None:   # a whole training step: its modules, .grad and optimizer state as inputs
        captured = capture(root, root.binding.gather(), *args, dynamic=dynamic, reuse_blocks=reuse_blocks, **kwargs)
        return replace(captured, step=root.binding)
    with GC_PAUSED():
        captured, assumed, since = recorded(fn, lambda: capture_call(fn, args, kwargs, dynamic=dynamic,
                                                                     reuse_blocks=reuse_blocks),
                                            call_leaves(args, kwargs), root_name(fn, depth=1), leaf_names(args, kwargs))
        # The Python state the trace read (globals, attributes, m.training, hooks) is checked by every
        # call of what this compiles: a change raises instead of running a graph that assumed otherwise.
        return replace(captured, state=state_guards.build(assumed, since))


def capture_call(fn, args, kwargs, *, dynamic=False, dynamic_dims=None, reuse_blocks=True) -> Captured:
    """``capture`` with the arguments as data; ``dynamic_dims`` maps a flat input
    index to the dimensions to trace symbolically (automatic dynamic uses it)."""
    history: list = []
    with GC_PAUSED():
        with timed(history, "setup") as info:
            setup = make_setup(fn, args, kwargs, dynamic, dynamic_dims or {})
            info["inputs"] = len(setup.input_descs)
        return capture_setup(setup, history, reuse_blocks)


def capture_setup(setup: Setup, history: list, reuse_blocks: bool = True, *, user_code: bool = True) -> Captured:
    """Stage 0 -> stage 1 for any frontend: analyze, trace the joint, clean it up, build guards.
    A refused capture leaves the global RNG as it found it (``torch.manual_seed`` inside ran for real).
    ``user_code=False``: the function is a graph of torch ops alone (Dynamo's), whose trace seeds nothing."""
    rng = rng_states()
    try:
        try:
            return _capture_once(setup, history, reuse_blocks, rng[0], user_code)
        except SubclassGradient as e:     # plain inputs whose gradient is a subclass: traced again, promoted
            again = promoted(setup, e)
            if again is None:
                raise
            return _capture_once(again, history, reuse_blocks, rng[0], user_code)
    except BaseException:
        if _changed_rng(rng[0], user_code):
            set_rng_states(rng)
        raise


def _capture_once(setup: Setup, history: list, reuse_blocks: bool, rng, user_code: bool) -> Captured:
    members = repeated(setup, reuse_blocks)
    with GC_PAUSED(), tracing.scope(seeds=[]), _reusing(setup, members) as reuse:
        return _capture_setup(setup, history, reuse, rng, user_code)


def _changed_rng(before: torch.Tensor, user_code: bool) -> bool:
    """Whether this capture changed torch's global RNG (from ``before``). A traced op draws from no
    real stream: a change is a seed or a state set. With other threads alive it may be theirs (an
    eager training loop's dropout): it is the capture's only where user code ran in the trace and
    the capture's watch saw its thread call a generator's setter, or no watch could tell
    (:mod:`..guards.attribution`; a thread started after the capture began)."""
    if torch.equal(before, torch.random.get_rng_state()):
        return False
    if threading.active_count() == 1:
        return True
    if not user_code:
        return False
    watch = reads.thread_watch()
    return watch is None or watch.drew_from("torch")


def _reusing(setup: Setup, members: dict):
    """Block reuse (:mod:`.blocks`) where the module has repeated blocks; none (``None``) elsewhere."""
    return reusing(setup, members) if members else contextlib.nullcontext()


def _capture_setup(setup: Setup, history: list, reuse, rng: torch.Tensor, user_code: bool) -> Captured:
    setup = replace(setup, flat_fn=observed(setup.flat_fn, []))     # analysis must not run hooks' registration either
    # Inputs sharing a storage (a layout change of one is refused at its op's line); found once, the
    # groups with a written member are taken from them after analysis.
    sharing = find_groups(setup.real_inputs, set(range(len(setup.real_inputs))))
    shared = {i: g.members for g in sharing for i in g.members}
    with timed(history, "analyze"):
        analysis = _traced(lambda: analyze(setup.session, setup.flat_fn, setup.fake_inputs, setup.input_descs,
                                           shared))
    if getattr(setup.fn, "whole_step", False):
        # A training step's outputs and updated parameters are detached from any later backward (the
        # step ran its own): an inference graph, whose epilogue writes the updates in place.
        analysis = replace(analysis, fw_requires_grad=(False,) * len(analysis.fw_requires_grad))
    # (a layout change alone leaves the others' values as they are: each member keeps its own input;
    # so does a write where the members touch none of the same bytes, which the argument match checks
    # per call, in a graph without a backward: views share a version counter, so a write to one
    # would fail the version check of another saved for the backward. Not under Dynamo, whose calls
    # check storage sharing only for a synthetic base.)
    changed = {i for i, info in enumerate(analysis.inputs) if info.mutates_data}
    apart = user_code and not any(analysis.fw_requires_grad)
    groups = [g for g in sharing if changed & set(g.members)
              and not (apart and disjoint([setup.real_inputs[i] for i in g.members]))]
    if any(not v.is_static for g in groups for v in g.views):
        raise errors.UnsupportedError(
            "inputs that share storage, one of them written, are laid out with symbolic sizes or strides (Dynamo "
            "recompiled them as dynamic): the graph regenerates each from their base at a fixed place; mark them "
            "static (torch._dynamo.mark_static) or pass separate tensors")
    if groups:
        with timed(history, "synthetic bases", groups=len(groups)):
            setup = rebased(setup, rebase(len(setup.real_inputs), groups))
            analysis = _traced(lambda: analyze(setup.session, setup.flat_fn, setup.fake_inputs, setup.input_descs))
    records: list = []      # what each joint trace registers, by graph input (the last one counts)
    setup = replace(setup, flat_fn=observed(setup.flat_fn, records))
    lay = layout(analysis)
    with timed(history, "trace joint") as info:
        joint, info["direct grads"], (saved, quiet, reruns), info["unseen inputs"] = _joint(setup, analysis, lay, reuse)
        analysis = replace(analysis, eager_saved=saved, quiet_writes=quiet, eager_reruns=reruns,
                           rewritten=records[-1].rewritten[0] if records and records[-1].rewritten else ())
        info["nodes"] = len(joint.graph.nodes)
        info["reused blocks"], info["reused whole blocks"] = (reuse.count(), reuse.whole) if reuse else (0, 0)
        if reuse:
            info.update(_block_facts(joint, reuse))
    _refuse_held_constants(joint, setup, analysis, setup.session.grad_enabled or not lay.is_inference)
    _refuse_used_inner_leaves(joint, analysis)
    _unread_freed_inputs(joint, analysis)
    in_descs, out_descs = _joint_descs(setup, analysis, lay)
    name_placeholders(joint, in_descs)      # before simplify, whose recompile writes the names in
    with timed(history, "simplify") as info:
        if joint.meta.get(RNG_ENDS) or any(is_random(n) for n in joint.graph.nodes):
            joint = share_recomputed_randomness(joint)      # nothing to share or rewind otherwise
        if not lay.is_inference:        # t(t(w)) -> w, in place: the compile's fold then copies nothing
            info["views folded"] = fold_views_owned(joint, lay.n_fw)
        joint = simplify_owned(joint)   # the fresh trace, or share_recomputed_randomness's copy
        info["written inputs copied"] = keep_written_originals(joint, lay)
        info["nodes"] = len(joint.graph.nodes)
    analysis = _settled(analysis, setup.session.shape_env)
    with timed(history, "input guards"):
        guards = _input_guards(setup, analysis)
        _refuse_unbound_sizes(analysis, guards)
    seeds = tracing.current().seeds
    if seeds and any(is_random(n) for n in joint.graph.nodes):
        raise errors.UnsupportedError(
            f"torch.manual_seed({seeds[0][0]}) inside the captured function: the compiled graph would not "
            "reseed, so its random numbers would differ from eager's; seed before calling it", user_line=seeds[0][1])
    if _changed_rng(rng, user_code):
        raise errors.UnsupportedError(
            "the function changed the global RNG while being traced (torch.manual_seed, set_rng_state, or "
            "drawing numbers outside tensor ops); the compiled graph would not repeat that, so its random "
            "numbers would differ from eager's. Seed outside the captured function")
    hooks = records[-1].record() if records else HookRecord()
    records.clear()     # the recorders hold the trace's tensors
    return Captured(setup.traced(), joint, analysis, lay, guards, analysis.out_spec,
                    in_descs, out_descs, tuple(history), hooks=hooks)     # no stage pins the user's batch


def _block_facts(joint, reuse) -> dict:
    """The history's facts of block reuse beyond the counts: calls of halves, why blocks ran flat."""
    facts = {}
    kept = sum(is_call(n) and n.target.kind == "forward" for n in joint.graph.nodes)
    if kept:
        facts["blocks called as halves"] = kept
    if reuse.why:
        facts["blocks run flat"] = dict(reuse.why)
    return facts


def _joint(setup: Setup, analysis, lay, reuse) -> tuple:
    """The joint with repeated blocks inlined, how many gradients blocks wrote directly, the inputs
    eager's autograd saves (``joint.eager_saved_inputs``) and those the program writes without a
    version bump, and how many inputs the trace did not see.

    Tried in order: blocks' own parameters unseen by the trace and their gradients written
    directly; gradients written directly; neither (see :class:`.block_graph.Direct`). Each
    attempt that cannot stand for the program is dropped for the next. Calls a template cannot
    stand for bit for bit (:class:`.block_graph.FlatCall`) run flat, and the attempts start again."""
    def trace(direct: bool, unseen: frozenset):
        if reuse is not None:
            reuse.calls = reuse.whole = 0
            reuse.seen.clear()
        joint = _traced(lambda: traced_with_positions(lambda: trace_joint(
            setup.session, setup.flat_fn, setup.fake_inputs, analysis, lay, user_fn=setup.fn,
            direct_grads=direct, unseen=unseen)))
        if unseen and any(isinstance(getattr(joint, n.target, None), FakeTensor)
                          for n in joint.graph.find_nodes(op="get_attr")):
            raise UnseenUsed("a fake constant in the graph may be an unseen input's stand-in")
        saved = joint.meta.pop("aotgrad eager saved", ((), (), False))
        calls = joint.meta.pop("aotgrad block calls")
        return joint, inline_blocks(joint, *calls) if reuse is not None else 0, saved, len(unseen)
    if reuse is None:       # no repeated blocks
        return trace(False, frozenset())
    reuse.may_trace = False      # templates come from the metadata pass only
    unseen = unseen_inputs(reuse, setup, analysis)
    attempts = [(True, unseen)] * bool(unseen) + [(True, frozenset())] + [(False, frozenset())]
    while True:
        try:
            return _first_standing(trace, attempts)
        except (errors.AotgradError, FlatCall) as e:
            flat = e if isinstance(e, FlatCall) else e.__cause__
            if not isinstance(flat, FlatCall) or flat.calls.keys() <= reuse.refused.keys():
                raise
            reuse.refused.update(flat.calls)     # they run flat in the next trace


def _first_standing(trace, attempts):
    for direct, unseen in attempts[:-1]:
        try:
            return trace(direct, unseen)
        except SharedGradient:      # a block's parameter also used outside the blocks
            continue
        except (errors.AotgradError, UnseenUsed) as e:
            # A stand-in may have failed in a way that hid it (an error of the program's own, a
            # constant): the next attempt, with every input seen, decides. Without stand-ins an
            # error is the program's.
            if not unseen and not _cause(e, UnseenUsed) or _cause(e, FlatCall):
                raise
    return trace(*attempts[-1])


def _cause(e: BaseException, kind) -> bool:
    return isinstance(e, kind) or isinstance(e.__cause__, kind)


def _refuse_used_inner_leaves(joint, analysis) -> None:
    """A leaf made inside with ``requires_grad=True``, returned and also used: eager fills its
    ``.grad`` from what it was used in; the graph differentiates its inputs only, so the returned
    leaf's ``.grad`` would stay None."""
    made = joint.graph.find_nodes(op="output")[0].args[0]
    for k, o in analysis.plain():
        node = made[k]
        if o.requires_grad and o.is_leaf and isinstance(node, torch.fx.Node) and len(node.users) > 1:
            raise errors.UnsupportedError(
                "the function returns a leaf it made inside that requires grad (requires_grad=True or "
                "requires_grad_()) and also computes with it; eager would accumulate its .grad, the compiled "
                "graph differentiates its inputs only: pass it in as an argument (or make it a parameter)",
                user_line=_user_line(node.users))


def _user_line(nodes) -> str | None:
    """``file:line: code`` of the first of ``nodes`` whose trace recorded the user's stack."""
    trace = next((u.meta.get("stack_trace") for u in nodes if u.meta.get("stack_trace")), None)
    return ": ".join(line.strip() for line in trace.strip().splitlines()[-2:]) if trace else None


def _refuse_held_constants(joint, setup, analysis, training: bool) -> None:
    """Real tensors the trace read as constants (a closure, a global, a plain attribute), refused where
    the graph would differ from eager: one that requires grad (``training``: its gradient would be
    dropped), and one in the storage of an input the graph writes (a buffer also held as ``self.alias``
    or in a global): eager's read through that reference sees the call's writes, the graph's constant
    is the tensor as it was before the call."""
    written = {setup.real_inputs[i].untyped_storage()._cdata: setup.input_descs[i]
               for i, info in enumerate(analysis.inputs) if info.mutates_data and i < len(setup.real_inputs)
               and isinstance(setup.real_inputs[i], torch.Tensor) and not isinstance(setup.real_inputs[i], FakeTensor)}
    for n in joint.graph.find_nodes(op="get_attr"):
        t = getattr(joint, n.target, None)
        if not isinstance(t, torch.Tensor):
            continue
        if training and t.requires_grad:
            raise errors.UnsupportedError(
                f"the function uses a tensor of shape {tuple(t.shape)} that requires grad but is not an input "
                "(a module's parameter reached through a closure or a global?); its gradient would be lost. "
                "Capture the module itself, or pass the tensor as an argument", user_line=_user_line(n.users))
        desc = written.get(t.untyped_storage()._cdata) if written and t.layout == torch.strided else None
        if desc is not None:
            raise errors.UnsupportedError(
                f"the function writes {desc} in place and also reads it (or a view of it) through another "
                "reference (a plain attribute, a global, a closure or a list), which the trace holds as a "
                "constant: eager's read there sees the call's writes, the graph's would not; read it where the "
                "function is given it (the module's registered buffer, the argument)", user_line=_user_line(n.users))


def name_placeholders(gm, descs) -> None:
    """Rename the joint's inputs after their descriptors (``p_fc1_weight``, ``tangent_output_0``);
    the caller recompiles."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, d in zip(ph, descs):
        n._rename(d.ident())
        n.target = n.name


def make_setup(fn, args, kwargs, dynamic, dynamic_dims) -> Setup:
    # Watched: a module's own named_parameters (or a pytree node's flatten) is user code that may read state.
    sig, tensors, descs = signature(fn, args, kwargs)
    session = Session.for_inputs(tensors, dynamic or (None if dynamic_dims else False), torch.is_grad_enabled())
    with reads.paused():        # torch's own Python: no user code to watch
        fakes = session.fakeify_all(tensors, dynamic_dims)
    return Setup(fn, sig, tuple(descs), flat_function(fn, sig), session, tuple(fakes), tuple(tensors))


def rebased(setup: Setup, rb) -> Setup:
    """The same setup with aliased, mutated inputs replaced by synthetic bases."""
    tensors = rb.graph_inputs(list(setup.real_inputs))
    if not any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in tensors):
        # Dynamo's inputs (fake tensors and SymInts): keep its fake mode and guards
        session, fakes = setup.session, tuple(tensors)
    else:
        session = Session.for_inputs(tensors, setup.session.dynamic, setup.session.grad_enabled)
        fakes = tuple(session.fakeify(t) for t in tensors)
    return replace(setup, input_descs=tuple(rb.descs(setup.input_descs)), flat_fn=rb.wrap(setup.flat_fn),
                   session=session, fake_inputs=fakes, real_inputs=tuple(tensors), rebase=rb)


def _traced(thunk):
    """Run a trace; turn failures in the user's program into typed errors naming their line."""
    try:
        return thunk()
    except errors.AotgradError:
        raise
    except Exception as e:
        # Raised inside torch with no user frame (the engine's backward): the user's capturing line.
        line = errors.user_frame(e.__traceback__) or errors.caller_line()
        kind = type(e).__name__
        if kind in _DATA_DEPENDENT:
            raise errors.DataDependentError(
                "cannot capture a Python read of a tensor's value (a branch on it, int()/float()/bool(), .item()) or "
                "a size that depends on values (nonzero(), a boolean mask): a captured graph holds one path (no "
                "torch.cond-style branch), and which path runs is decided per call (a random draw deciding a "
                "branch, LayerDrop's torch.rand([]) < p, also "
                "decides what the ops after it draw)" + _library_reader(e.__traceback__), user_line=line) from e
        if type(e).__module__.startswith("torch._dynamo"):
            raise errors.UnsupportedError(COMPILED_INSIDE.format(why=f"Dynamo raised {kind}: {_first_line(e)}"),
                                          user_line=line) from e
        if "invalid python storage" in str(e):
            raise errors.UnsupportedError(
                "a traced tensor's storage cannot be read or resized (untyped_storage().resize_(), data_ptr(): "
                "FSDP-style freeing and re-allocating of storage); the graph holds values, not storages: do it "
                "outside the captured function", user_line=line) from e
        stale = stale_views.refusal(e, line)
        if stale is not None:
            raise stale from e
        if kind in _UNSUPPORTED or "numpy" in str(e).lower():
            raise errors.UnsupportedError(f"cannot capture this operation: {_first_line(e)}", user_line=line) from e
        raise errors.TraceError(f"tracing failed with {kind}: {_first_line(e)}", user_line=line) from e


_AOTGRAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Below the library code that read a value: torch's own tracing machinery (what turned the read into
# an error), not a cause to name.
_MACHINERY = tuple(f"{os.sep}torch{os.sep}{p}" for p in (
    "_subclasses", "fx", "_dynamo", "_compile.py", "__init__.py", "utils", "_ops.py", "_prims", "_refs",
    "_decomp", "overrides.py", "_tensor.py", "_meta_registrations.py", "_library"))
# Library code known to read values, and what the user can do about it.
_READERS = {
    f"torch{os.sep}distributions": "a distribution validating its arguments (pass validate_args=False, or "
                                   "torch.distributions.Distribution.set_default_validate_args(False))",
    f"nn{os.sep}modules{os.sep}batchnorm.py": "a batch norm with momentum=None (a cumulative average of "
                                             "num_batches_tracked): give it a momentum, or run it under "
                                             "aotgrad.jit or torch.compile(backend=\"aotgrad\") (Dynamo splits the "
                                             "graph at the read)",
}


def _library_reader(tb) -> str:
    """Where library code (not the user's, not torch's tracing machinery) read the value, and what to
    do instead; the generic advice where the user's own code read it."""
    generic = ("; aotgrad.jit and torch.compile(backend=\"aotgrad\") run it (Dynamo splits the graph at the read), "
               "or compute it outside the captured function or use torch.where/torch.cond")
    for fr in reversed(traceback.extract_tb(tb) if tb is not None else []):
        name = os.path.abspath(fr.filename)
        if any(m in name for m in _MACHINERY) or name.startswith(_AOTGRAD_DIR):
            continue
        if not errors.in_packages(fr.filename) and "site-packages" not in name:
            return generic      # the user's code read it
        known = next((hint for key, hint in _READERS.items() if key in name), None)
        where = f"{os.sep.join(name.split(os.sep)[-3:])}:{fr.lineno} in {fr.name}"
        return f": read in {where}" + (f", {known}" if known else generic)
    return generic


def _first_line(e) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


_CLONE, _COPY, _EMPTY_LIKE = torch.ops.aten.clone.default, torch.ops.aten.copy.default, torch.ops.aten.empty_like.default
_SIZES = {torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel, torch.ops.aten.sym_storage_offset}


def _unread_freed_inputs(joint, analysis) -> None:
    """An input freed on entry that the function re-allocates (FSDP's unsharded parameter) holds no
    values: the trace refused every read of them but a whole ``copy_()`` (``copy``, whose kernel reads
    a storage-less ``self``'s layout alone). The joint's own copy of a written input that requires grad
    (a ``clone``, so autograd sees the write) would read them: it is an ``empty_like``, which the
    ``copy`` then fills. Any other use but a read of its sizes would read freed memory at run time."""
    freed = [i for i, info in enumerate(analysis.inputs) if info.storage_resize and not info.storage_resize[0]]
    if not freed:
        return
    placeholders = joint.graph.find_nodes(op="placeholder")
    for i in freed:
        for n in list(placeholders[i].users):
            if n.target is _CLONE and all(u.target is _COPY and u.args[0] is n for u in n.users):
                n.target, n.kwargs = _EMPTY_LIKE, {k: v for k, v in n.kwargs.items() if k == "memory_format"}
            elif not (n.target is _COPY and n.args[0] is placeholders[i] and n.args[1] is not placeholders[i]
                      or getattr(n.target, "_overloadpacket", None) in _SIZES):
                raise errors.UnsupportedError(
                    f"input {i}, freed on entry and re-allocated by the function, is read by {n.target} in the "
                    "captured graph: it holds no values to read; fill it with a whole copy_() first")
    joint.recompile()


def _settled(analysis, shape_env):
    """``analysis`` with every size it recorded (a storage resize's, a view's layout) over the symbols the
    trace settled after it was recorded: a number Dynamo passed as a symbol that a later guard made equal
    to another or to a constant (``x.split(2)`` of 7 rows pins it, after the last view's ``s0 - 6``). A
    stored entry sizes its views from these alone: the replay that sized them in process is not stored."""
    if shape_env is None or not shape_env.replacements:
        return analysis

    def size(v):
        for _ in range(8):      # replacements may name symbols replaced in turn
            if isinstance(v, (int, float)) or not v.free_symbols & shape_env.replacements.keys():
                break
            v = sympy.expand(v.xreplace(shape_env.replacements))
            v = int(v) if v.is_number else v
        return v

    def meta(m):
        return m and ViewMeta(tuple(map(size, m.size)), tuple(map(size, m.stride)), size(m.offset))

    def output(o):
        return o and replace(o, view=meta(o.view))

    inputs = tuple(replace(i, new_meta=meta(i.new_meta), new_storage=output(i.new_storage),
                           storage_resize=i.storage_resize and (i.storage_resize[0], size(i.storage_resize[1])))
                   for i in analysis.inputs)
    return replace(analysis, inputs=inputs, outputs=tuple(map(output, analysis.outputs)))


def _refuse_unbound_sizes(analysis, guards) -> None:
    """A size the epilogue computes per call (a storage resize, a view's layout) is computed over the
    symbols the input guards bind; one over a symbol they do not (a stride Dynamo made symbolic) cannot be."""
    size = unbound_size(analysis, guards.bound)
    if size is not None:
        raise errors.UnsupportedError(
            f"an input's storage, or a view the function returns, is sized {size}, over sizes or strides no input "
            "guard binds (a layout Dynamo made symbolic): mark the input static (torch._dynamo.mark_static) or "
            "size it by its shape alone")


def _input_guards(setup: Setup, analysis):
    """The input guards; an input whose storage the function resizes and held its values on entry must
    hold them on every call (the trace may have read them; one freed on entry may come with any storage:
    the trace read none of it)."""
    specs = [input_guards.tensor_spec(f, t) if isinstance(t, torch.Tensor) else None
             for f, t in zip(setup.fake_inputs, setup.real_inputs)]
    specs = [replace(s, filled=True) if info.storage_resize and info.storage_resize[0] else s
             for s, info in zip(specs, analysis.inputs)] + specs[len(analysis.inputs):]
    conds = input_guards.shape_conditions(setup.session.shape_env)
    numbers = [(i, f.node.expr) for i, f in enumerate(setup.fake_inputs)
               if isinstance(f, torch.SymInt) and isinstance(f.node.expr, sympy.Symbol)]
    return input_guards.build(specs, setup.input_descs, conds, numbers)


def _joint_descs(setup, analysis, lay):
    ins = list(setup.input_descs)
    fw = [MutationDesc(ins[i]) for i in analysis.mutated()]
    fw += [OutputDesc(j) for j, info in enumerate(analysis.outputs) if info.kind == "plain"]
    fw += [ViewBaseDesc(k) for k in range(analysis.base_count)]
    tangents = [TangentDesc(fw[k]) for k in lay.tangent_of]
    grads = [GradDesc(ins[i]) for i in lay.grad_of]
    return tuple(ins + tangents), tuple(fw + grads)


# --- recording what the trace reads

def root_name(fn, depth: int = 0) -> str:
    """How messages name the jitted object: a function by its name, a module by the variable
    the caller of ``aotgrad.jit`` holds it in (``model.fc.training``), else ``model``."""
    if not isinstance(fn, torch.nn.Module):
        return getattr(fn, "__name__", type(fn).__name__)
    if depth:
        frame = sys._getframe(depth + 1)
        for scope in (frame.f_locals, frame.f_globals):
            for k, v in scope.items():
                if v is fn and k.isidentifier() and not k.startswith("_"):
                    return k
    return "model"


def call_leaves(args, kwargs) -> list:
    """The call's non-tensor argument leaves (tensors as None), in pytree order."""
    return [None if isinstance(v, torch.Tensor) else v for v in pytree.tree_leaves((tuple(args), dict(kwargs)))]


def leaf_names(args, kwargs) -> list:
    """How messages name each of :func:`call_leaves` (as the input guards do: ``input 1``,
    ``input['past_key_values']``, with the path inside it)."""
    return [input_name(path) for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]]


_ATTEMPTS = 3


def recorded(fn, trace, leaves, name, names=()):
    """``(trace(), reads, since)``: run ``trace`` (a capture of ``fn``) recording what it read. A trace
    that read a global another thread changed meanwhile runs again (its graph may hold either value).
    FSDP2 units in ``fn`` are traced with their collectives in the graph, their settings guarded.
    ``since``: a ``state.watermark`` taken before the reads' values were (``state.build``'s)."""
    for _ in range(_ATTEMPTS):
        with fsdp_graph.lowering(fn) as fsdp_reads:
            captured, rec = _recorded_once(fn, trace, leaves, names)
        since = state_guards.watermark() if not fsdp_reads else None    # (its reads' values were taken earlier)
        reads_ = [*without_rebound(fn, captured, resolve.assumed(fn, leaves, name, rec)), *(fsdp_reads or ())]
        if getattr(fn, "whole_step", False):     # what a step's state argument carries is not guarded
            reads_ = step_reads(fn, reads_)
        raced = rec.raced(reads_)
        if raced is None:
            return captured, reads_, since
    raise errors.UnsupportedError(
        f"another thread changed `{raced}`, which the traced code reads, while it was captured, "
        f"{_ATTEMPTS} times: the graph may hold either value. Change it outside the first call, or "
        "make the first call before starting the thread that changes it", user_line=None)


def _recorded_once(fn, trace, leaves, names):
    rec, written = None, None       # undone once, whichever way the trace ends
    try:
        # Inside a compiled_autograd block, the joint trace's autograd.grad is traced, not captured.
        with reads.record(fn) as rec, COMPILED_AUTOGRAD_OFF():
            # The objects the call was given (a KV cache): whoever writes them, a library's code
            # included, changes the caller's state, which the compiled graph would not change again.
            for i, v in enumerate(leaves):
                rec.writes.given(v, names[i] if i < len(names) else f"input {i}")
            captured = trace()
    except Exception as e:
        written = rec.undo_writes() if rec is not None else []
        if rec is not None and rec.reflected and not isinstance(e, errors.GraphBreakError):
            raise resolve.reflected_call(*rec.reflected[0]) from e    # (a C call no guard can check: the cause)
        # The write is the cause (a buffer registered in the first trace broke the next), except where a
        # graph break (a value read) stopped the trace: Dynamo, which jit hands that to, repeats it eagerly.
        if written and not isinstance(e, errors.GraphBreakError):
            raise _refused(written, rec) from e
        raise
    finally:
        if written is None and rec is not None:
            written = rec.undo_writes()
    if written:
        raise _refused(written, rec)
    if rec.replaced is not None:
        raise _blinded(*rec.replaced)
    return captured, rec


# Globals Dynamo installs in the module of a function it compiles (builtins, imports it needs).
_DYNAMO_GLOBALS = ("__builtins_dict___", "__import_", "__compiled_fn_", "__resume_at_")
COMPILED_INSIDE = (
    "torch.compile's Dynamo runs inside the captured function ({why}), for a function or module compiled "
    "with torch.compile or an op that compiles its body with it (torch.cond, flex_attention): aotgrad "
    "traces the whole function itself; call the uncompiled one inside (a compiled module's `_orig_mod`, a "
    "compiled function's `_torchdynamo_orig_callable`), or compile the outer function with "
    "torch.compile(backend=\"aotgrad\")")


def _blinded(fn, code, line) -> errors.UnsupportedError:
    """The traced code replaced this thread's profile function, through which capture records what the
    trace reads: the reads after it would not be guarded."""
    owner = getattr(fn, "__self__", None)
    name = None if fn is None else f"{owner.__name__}.{fn.__name__}" if isinstance(owner, types.ModuleType) \
        else f"{type(owner).__module__}.{type(owner).__qualname__}.{fn.__name__}" if owner is not None \
        else f"{getattr(fn, '__module__', None) or 'builtins'}.{fn.__name__}"
    return errors.UnsupportedError(
        f"the traced code replaces this thread's profile function{f' (it calls `{name}`)' if name else ''}: "
        "a profiler started or stopped inside the captured function. Capture sees the Python state the "
        "trace reads through that function, so what it read after would go unguarded and a later call "
        "could run a stale graph; start and stop the profiler outside the compiled function",
        user_line=f"{code.co_filename}:{line} in {code.co_name}" if code is not None else errors.caller_line())


def _refused(written, rec) -> errors.UnsupportedError:
    what, key = written[0]
    if isinstance(key, str) and key.startswith(_DYNAMO_GLOBALS):
        return errors.UnsupportedError(
            COMPILED_INSIDE.format(why=f"Dynamo installed its global `{key}` while compiling it there"),
            user_line=reads.store_line(rec, key) or errors.caller_line())
    return errors.UnsupportedError(
        f"the traced code {what} (Python state outside the tensors that outlives the call); the compiled "
        "graph would not repeat the write, so later calls would differ from eager. Keep that state "
        "in a tensor buffer or update it outside the compiled function", user_line=reads.store_line(rec, key))
