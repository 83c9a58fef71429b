"""Input mutations, output aliasing and requires-grad flow of a program.

Found by running the flat function once on functional fake tensors:
functionalization records which inputs had their data or metadata changed,
and storages tell which outputs alias inputs or intermediates.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch import (
    apply_view_meta_sequence, backed_symbols, functionalize_has_data_mutation, functionalize_was_storage_changed,
    FunctionalTensor, sync, traceable_subclass, view_base, view_meta_sequence,
)
from ..errors import MutationError, UnsupportedError
from ..guards import reads
from ..ir.records import Analysis, InputInfo, OutputInfo, ViewMeta, symbolic
from ..runtime.call import Rebound
from ..runtime.hooks import custom_view
from .session import Session, from_functional, functional_mode, to_functional


def analyze(session: Session, flat_fn, fake_inputs: list, names=None, shared=None) -> Analysis:
    """Run ``flat_fn`` functionalized on fakes and describe what it did (``names``: how a refusal
    names each input; ``shared``: input index -> the indices of the inputs sharing its storage)."""
    # Sizes that depend on data (nonzero, unique) get unbacked symbols; only the
    # joint trace binds them to graph nodes, so this pass does not track them.
    mode = functional_mode()
    with session.tracing(), mode, session.shape_env.ignore_fresh_unbacked_symbols():
        with reads.paused():        # torch's own Python: no user code to watch
            f_ins = [to_functional(t) for t in fake_inputs]
            grad_fns = [getattr(f, "grad_fn", None) for f in f_ins]
            mode.storages.enter(f_ins)
        mode.watched = frozenset(map(id, f_ins))
        mode.owners = [f for f in f_ins if isinstance(f, FunctionalTensor)]    # (a set_() lands in one's storage)
        with reads.user_code():     # (the first run is recorded; a second, after rebasing, is not)
            f_outs = flat_fn(*f_ins)
        resized = mode.storages.finish()
        names = names or [f"input {i}" for i in range(len(f_ins))]     # (formatted only in a refusal)
        shared = shared or {}
        inputs = tuple(_input_info(f, t, g, n, mode.lines.get(id(f)), {str(names[j]): fake_inputs[j]
                                                                            for j in shared.get(i, ()) if j != i},
                                   _swap(i, f_ins, fake_inputs, n, mode, shared))
                       for i, (f, t, g, n) in enumerate(zip(f_ins, fake_inputs, grad_fns, names)))
        inputs = tuple(_resized(info, resized.get(id(f)), n, shared.get(i, ()), mode.storages.lines.get(id(f)))
                       for i, (info, f, n) in enumerate(zip(inputs, f_ins, names)))
        _refuse_meta_in_written_group(inputs, shared, names, [mode.lines.get(id(f)) for f in f_ins])
        swapped = {i for i, info in enumerate(inputs) if info.new_storage}
        outputs, bases = _output_infos(f_outs, f_ins, swapped)
        if swapped:
            outputs = _views_of_swapped(f_outs, f_ins, swapped, outputs)
        if mode.anchors:
            outputs = _set_onto_inputs(f_outs, f_ins, fake_inputs, swapped, mode, outputs)
        fw = ([f for f, i in zip(f_ins, inputs) if i.mutates_data]
              + [o for o, info in zip(f_outs, outputs) if info.kind == "plain"] + bases)
        # A write autograd did not see, traced under no_grad: the joint's copy of that input (cloned
        # under the captured grad mode) has no history to differentiate, and eager's written tensor
        # keeps none from it (a leaf parameter an optimizer updates stays the leaf it was).
        hidden = [not session.grad_enabled and i.mutation_hidden for i in inputs if i.mutates_data]
        rg = tuple(v.requires_grad and not (k < len(hidden) and hidden[k]) for k, v in enumerate(fw))
        fake_outs = tuple(from_functional(v) for v in fw)
    return Analysis(inputs, outputs, len(bases), fake_outs, rg, getattr(f_outs, "spec", None))


def _resized(info: InputInfo, nbytes, name, shared, line=None) -> InputInfo:
    """``info`` with the storage sizes ``(start, final)`` of an input whose storage the function resized
    (``capture.session.Storages``), replayed by the epilogue before its data write."""
    if nbytes is None:
        return info
    if info.new_storage is not None or info.mutates_metadata or len(shared) > 1:
        what = "set_()" if info.new_storage is not None else "a layout change" if info.mutates_metadata else \
            "another input sharing its storage"
        raise MutationError(f"{name}'s storage is resized and it has {what}: the epilogue replays a resize only on an "
                            "input that holds its storage alone and keeps its layout (PyTorch's AOTAutograd bans "
                            "resize_() with set_() too); resize it outside the function", user_line=line)
    return replace(info, storage_resize=(nbytes[0], symbolic(nbytes[1])))     # (a size expression, per call)


def _input_info(f, t, grad_fn_before, name, line, others=None, swap=None) -> InputInfo:
    """What the function did to input ``t`` (``f`` its functional stand-in). A write that autograd
    recorded changes ``f.grad_fn``; one through ``.data``/``.detach()`` or under ``no_grad`` does
    not, and is replayed without autograd. ``line``: where its layout or storage changed; ``others``:
    the inputs sharing its storage, by name (their fakes); ``swap``: its storage swapped (``_swap``)."""
    if not isinstance(t, torch.Tensor):
        return InputInfo(False, False, False, False, None)
    if swap is not None:
        others = others or {}
        if any(o is t for o in others.values()):
            raise MutationError(f"set_() on {name}, which is passed again as "
                                f"{', '.join(n for n, o in others.items() if o is t)}: eager's other argument is "
                                "that very tensor and holds the new storage too; the graph takes them as separate "
                                "inputs: return the new tensor instead", user_line=line)
        # Its new value is the graph's (a forward value) unless it lies in another input's storage.
        return InputInfo(False, swap.kind == "plain", True, swap.kind == "plain", swap.view, new_storage=swap)
    sync(f)
    data = functionalize_has_data_mutation(f.elem)
    seen = f.grad_fn is not grad_fn_before
    # requires_grad_() on an input that did not require grad (a leaf: it had no history to need): the graph
    # differentiates it as traced, and each call sets the flag on the caller's tensor before the graph runs,
    # so its outputs' history reaches it as eager's does (``runtime.call.make_call``).
    flagged = f.requires_grad and not t.requires_grad and f.grad_fn is None
    if f.requires_grad != t.requires_grad and not (data and seen and f.requires_grad) and not flagged:
        raise MutationError(f"detach_() on {name} inside the captured function cannot be replayed on the "
                            "caller's tensor; call detach_() on it before calling", user_line=line)
    if flagged and any(o is t for o in (others or {}).values()):
        raise MutationError(f"requires_grad_() on {name}, which is passed again as "
                            f"{', '.join(n for n, o in others.items() if o is t)}: eager's other argument is that "
                            "very tensor and requires grad too; the graph takes them as separate inputs: call "
                            "requires_grad_() before calling", user_line=line)
    meta = (f.shape != t.shape or f.stride() != t.stride()
            or f.storage_offset() != t.storage_offset())
    if meta and t.requires_grad and not seen:
        raise MutationError(f"an in-place metadata change of {name} (t_(), unsqueeze_(), as_strided_()...), which "
                            "requires grad, made without autograd (under no_grad): eager's gradient for it is then "
                            "laid out as the new layout, the graph's as the old one; change it outside the function",
                            user_line=line)
    if meta and seen and t.requires_grad and t.is_leaf:
        raise MutationError(f"an in-place metadata change of {name} (t_(), unsqueeze_(), as_strided_()...), a leaf "
                            "that requires grad: eager raises 'a leaf Variable that requires grad is being used in an "
                            "in-place operation'; use the out-of-place op, or change it under torch.no_grad()",
                            user_line=line)
    others = others or {}
    if meta and any(o is t for o in others.values()):
        raise MutationError(f"{name} is passed again as {', '.join(n for n, o in others.items() if o is t)} "
                            "and has its metadata changed in place (t_(), unsqueeze_(), as_strided_()...); "
                            "the graph takes them as separate inputs: use the out-of-place op and return the "
                            "result", user_line=line)
    return InputInfo(t.requires_grad or flagged, data, meta, data and not seen,
                     ViewMeta.relative(f, t) if meta else None, meta and seen and t.requires_grad,
                     sets_requires_grad=flagged)


def _refuse_meta_in_written_group(inputs, shared, names, lines) -> None:
    """An input whose layout changed in place that shares its storage with an input the program
    writes: the graph takes the group as one synthetic base and regenerates each member from it,
    so the layout change would be lost."""
    for i, info in enumerate(inputs):
        written = [j for j in shared.get(i, ()) if inputs[j].mutates_data]
        if info.mutates_metadata and written:
            raise MutationError(
                f"{names[i]} has its metadata changed in place (t_(), unsqueeze_(), as_strided_()...) and shares "
                f"storage with {', '.join(str(names[j]) for j in written)}, which the function writes; that cannot "
                "be replayed through their shared base: use the out-of-place op and return the result",
                user_line=lines[i])


def _views_of_swapped(f_outs, f_ins, swapped, infos) -> tuple:
    """An output that is a view of a swapped input (``x.set_(y[1:]); return x.view(-1)``) is a view of
    the caller's ``x`` as eager's is, taken after the epilogue's ``set_()``: at its place relative to
    ``x``'s new layout (both as the functional wrappers hold them; the Python tensor's metadata is the
    old one)."""
    ids = {id(f_ins[i]): i for i in swapped}
    infos = list(infos)
    for j, o in enumerate(f_outs):
        if isinstance(o, FunctionalTensor) and o._is_view() and id(o._base) in ids and not custom_view(o):
            i = ids[id(o._base)]
            sync(o)
            now, base = ViewMeta.of(o.elem), f_ins[i].elem
            infos[j] = OutputInfo("input_view", i, ViewMeta(now.size, now.stride, now.offset - symbolic(
                base.storage_offset())), o.requires_grad, is_leaf=o.grad_fn is None)
    return tuple(infos)


def _storages(f_ins, anchors) -> dict:
    """Each input's storage as the first ``set_()`` found it -> (the first input holding it, an alias of
    that whole input then): the functional wrapper's own (``f.elem``; a ``set_()`` leaves the Python
    tensor's metadata and storage as they were). Read only after the function ran: a storage's Python
    object held while it runs makes functionalization take the tensor for a view (no ``resize_``)."""
    found: dict = {}
    for i, f in enumerate(f_ins):
        alias = anchors.get(id(f))
        if alias is not None:
            found.setdefault(StorageWeakRef(alias.elem.untyped_storage()), (i, alias))
    return found


def _swap(i, f_ins, fake_inputs, name, mode, shared) -> OutputInfo | None:
    """Where input ``i`` lies after a ``set_()`` swapped its storage (None: it was not swapped): in the
    storage input ``index`` had on entry (``input_view``, at ``view`` relative to that input as called:
    the epilogue regenerates it with ``as_strided`` of the caller's tensor, so the caller's ``x`` shares
    ``y``'s storage afterwards, as eager's), or in storage the function made (``plain``: the graph
    returns that value and the epilogue sets the caller's tensor to it). Refused where eager's result
    has history or a gradient the graph's cannot give, or the write before the swap would be lost."""
    f, t = f_ins[i], fake_inputs[i]
    if not isinstance(t, torch.Tensor):
        return None
    sync(f)
    if not _storage_changed(f.elem):
        return None
    line = mode.lines.get(id(f))
    if t.requires_grad or f.requires_grad:
        what = name if t.requires_grad else f"{name}, onto a tensor that requires grad with grad enabled,"
        raise MutationError(
            f"set_() on {what}: eager's set_ has no derivative (a backward through it raises) and its gradient "
            "would take the new storage's layout; detach it, or call set_() under torch.no_grad() on a tensor "
            "that does not require grad", user_line=line)
    if id(f) in mode.written_before_swap:
        raise MutationError(
            f"{name} is written in place and then set_() to another storage: the caller's old storage must "
            "keep the write, which the graph (holding values, not storages) cannot give it; write the tensor "
            "set_() gives it, or return the written one", user_line=mode.written_before_swap[id(f)])
    if shared.get(i):
        raise MutationError(f"set_() on {name}, which shares storage with other inputs: the graph takes them "
                            "through one base; pass separate tensors", user_line=line)
    now = f.elem
    j, at = _landed(now, f_ins, fake_inputs, mode.anchors)
    if j == i and functionalize_has_data_mutation(now):
        raise MutationError(f"{name} is set_() to a view of its own storage and that storage is written: the graph "
                            "replays the write on the caller's tensor only where it holds its old storage; use the "
                            "view itself (v = x[1:]) and return it", user_line=line)
    if at is not None:
        return OutputInfo("input_view", j, at)
    if j is not None:
        raise MutationError(f"set_() on {name} onto input {j}'s storage seen as another dtype; pass the tensor "
                            "itself", user_line=line)
    return OutputInfo("plain", view=ViewMeta.of(now))


def _landed(now, f_ins, fake_inputs, anchors) -> tuple:
    """``(j, at)``: the input ``j`` in whose storage on entry functional value ``now`` lies, and where relative to
    that input as called (None where its elements are not the input's: another dtype); ``(None, None)``: in
    storage the function made. Offsets in a functional storage count from its base value, which a write replaces
    (at offset 0): an alias of the whole input, taken at the first set_() (``session``) and regenerated from the
    base now, says where the input lies in it, whatever became of the input itself."""
    j, alias = _storages(f_ins, anchors).get(StorageWeakRef(now.untyped_storage()), (None, None))
    if j is None or not isinstance(fake_inputs[j], torch.Tensor) or not _same_elements(now, fake_inputs[j]):
        return j, None
    at = ViewMeta.of(now)
    sync(alias)
    return j, ViewMeta(at.size, at.stride, at.offset - symbolic(alias.elem.storage_offset()))


def _set_onto_inputs(f_outs, f_ins, fake_inputs, swapped, mode, infos) -> tuple:
    """An output made inside and ``set_()`` onto an input's storage (``y = torch.empty(0); y.set_(x)``), or a view
    of one: eager's is a tensor of its own over the caller's storage (not ``x``, no view of it, its own version
    counter), so writes through it land in ``x``. Regenerated so (``input_set``, at ``view`` relative to the
    input; a view of such a tensor where eager's is a view). Refused where eager's has set_'s history (onto a
    tensor that requires grad, grad enabled: its backward raises) or lies in the storage of an input the epilogue
    swaps too."""
    infos = list(infos)
    for k, o in enumerate(f_outs):
        swap = o._base if isinstance(o, FunctionalTensor) and o._is_view() else o
        if not isinstance(swap, FunctionalTensor) or infos[k].kind in ("input", "input_view", "output") or \
                not _storage_changed(swap.elem):
            continue
        sync(o)
        j, at = _landed(o.elem, f_ins, fake_inputs, mode.anchors)
        if at is None:
            continue
        line = mode.lines.get(id(swap))
        if o.requires_grad or j in swapped:
            why = "onto a tensor that requires grad with grad enabled: eager's has set_'s history, whose backward " \
                  "raises; call set_() under torch.no_grad()" if o.requires_grad else \
                  f"onto input {j}'s storage, which set_() gives input {j} another storage too; return a view of it"
            raise MutationError(f"output {k} is a tensor set_() {why}", user_line=line)
        infos[k] = OutputInfo("input_set", j, at, is_view=o._is_view())
    return tuple(infos)


def _storage_changed(elem) -> bool:
    return functionalize_was_storage_changed(elem)


def _symbolic_output(o) -> OutputInfo:
    """A Python number computed from symbolic sizes: re-evaluated from each call's sizes."""
    expr, kind = o.node.expr, {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(o)]
    if expr.is_number:
        return OutputInfo("constant", value=kind(expr))
    shape_env = o.node.shape_env
    backed = backed_symbols(shape_env)
    if not expr.free_symbols <= set(backed):
        raise UnsupportedError(f"returning a number that depends on tensor values ({expr}) is not supported; "
                               "return it as a tensor")
    return OutputInfo("symbolic", value=(kind, expr))


class Replay:
    """The view ops that made an output (functionalization's record), replayed on the real base:
    ``x[1]`` stays a select of whatever layout and offset the next input has, ``as_strided`` keeps
    its absolute offset, ``view_as_real``/``conj`` keep their dtype and bits. Not stored (the
    records are live C++ objects): a cached entry regenerates with ``as_strided`` on inputs whose
    layout its guards pin, and one that only replay can regenerate (``required``: another dtype,
    conjugate or negative bit) is not cached."""
    __slots__ = ("sequence", "required")

    def __init__(self, sequence, required: bool):
        self.sequence, self.required = sequence, required

    def apply(self, base: torch.Tensor) -> torch.Tensor:
        return apply_view_meta_sequence(base, self.sequence)

    def __reduce__(self):
        if self.required:
            from ..ir.graphs import Unserializable
            raise Unserializable("an output view that only replaying its view ops regenerates (view_as_real, conj)")
        return (type(None), ())


def replay_of(view, base) -> Replay | None:
    """``view``'s view ops, when this torch records them and none has a symbolic argument."""
    sequence = view_meta_sequence(view.elem) if isinstance(view, FunctionalTensor) else None
    if sequence is None:     # (a view of a constant the function reached, not of a traced value)
        return None
    # In-place view ops (x.t_()) are replayed on the input by the mutation epilogue first.
    if not sequence or any(getattr(vm, "has_symbolic_inputs", True) or type(vm).__name__.endswith("__ViewMeta")
                           for vm in sequence):
        return None
    return Replay(sequence, required=base is None or not _replayable(view, base))


def _is_detach(view_meta) -> bool:
    """Whether one step of a replayed view is ``detach()``/``.data`` (functionalization's ``detach_ViewMeta``)."""
    return type(view_meta).__name__.startswith("detach_")


def _reshaped_in_place(base) -> bool:
    """Whether ``base`` went through an in-place view op (``t_()``, ``unsqueeze_()``) itself: a view
    taken before it replays its ops on the base as it was then, not as it is returned."""
    sequence = view_meta_sequence(base.elem) if isinstance(base, FunctionalTensor) else None
    return bool(sequence)


def _same_elements(view, base) -> bool:
    """Same dtype, layout and conjugate/negative bits: ``as_strided`` of ``base`` can be ``view``
    (a dtype view ``x.view(torch.int32)`` is not: the graph returns it)."""
    return view.dtype == base.dtype and view.layout == base.layout == torch.strided and \
        view.is_conj() == base.is_conj() and view.is_neg() == base.is_neg()


def _replayable(view, base) -> bool:
    """Whether ``base.as_strided(...)`` regenerates ``view`` at run time: same dtype (not
    ``view_as_real``), same conjugate/negative bits (not ``conj()``), and sizes computable
    from the inputs (no data-dependent symbols).
    Other aliasing outputs are returned by the graph as fresh values: right numbers,
    without the view relationship."""
    if not _same_elements(view, base):
        return False
    free = set()
    for v in (*view.shape, *view.stride(), view.storage_offset()):
        if isinstance(v, torch.SymInt):
            free |= v.node.expr.free_symbols
    if not free:
        return True
    shape_env = _shape_env_of(view)
    backed = backed_symbols(shape_env)
    return free <= set(backed)


def _shape_env_of(t):
    for v in (*t.shape, *t.stride(), t.storage_offset()):
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
    return None


def _storage(t) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _wrapped_storage(t) -> StorageWeakRef:
    return StorageWeakRef((t.elem if isinstance(t, FunctionalTensor) else t).untyped_storage())


def _output_infos(f_outs, f_ins, swapped=()):
    """``swapped``: inputs ``set_()`` gave another storage (an output in it is a view of its owner;
    storages are then the functional wrappers' own: a view of a swapped input holds its stale one)."""
    storage_of = _wrapped_storage if swapped else _storage
    in_storages = {}
    for i, f in enumerate(f_ins):
        if isinstance(f, torch.Tensor) and i not in swapped:
            in_storages.setdefault(storage_of(f), i)
    infos, bases, seen = [], [], {}
    plain_ids = {id(o): j for j, o in reversed(list(enumerate(f_outs)))
                 if isinstance(o, torch.Tensor) and not o._is_view()}
    for j, o in enumerate(f_outs):
        if isinstance(o, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            infos.append(_symbolic_output(o))
            continue
        if not isinstance(o, torch.Tensor):
            infos.append(OutputInfo("constant", value=o))
            continue
        rg, leaf = o.requires_grad, o.grad_fn is None
        custom = custom_view(o)     # regenerating it as a view would skip a custom backward
        same_in = next((i for i, f in enumerate(f_ins) if o is f), None)
        storage = storage_of(o)
        base = f_ins[in_storages[storage]] if storage in in_storages else (view_base(o) if o._is_view() else None)
        replay = replay_of(o, base) if base is not None and not _reshaped_in_place(base) and (
            not o._is_view() or not traceable_subclass(o._base)) else None     # (its view ops start at the subclass)
        if same_in is not None:
            infos.append(OutputInfo("input", same_in, requires_grad=rg, is_leaf=leaf))
        elif id(o) in seen:
            infos.append(OutputInfo("output", seen[id(o)], requires_grad=rg, is_leaf=leaf))
        elif replay is not None and storage in in_storages and not custom and torch.is_inference_mode_enabled() \
                and not all(map(_is_detach, replay.sequence)):
            # Inference mode records no autograd view, so the trace's view of an input neither is one nor
            # requires grad; eager's is a view, and a leaf that requires grad where its base does (no detach).
            base_rg = f_ins[in_storages[storage]].requires_grad and not any(map(_is_detach, replay.sequence))
            infos.append(OutputInfo("input_view", in_storages[storage], ViewMeta.relative(
                o, f_ins[in_storages[storage]]), base_rg, is_leaf=True, replay=replay))
        elif not custom and storage in in_storages and not o._is_view() and not rg \
                and _same_elements(o, f_ins[in_storages[storage]]):
            infos.append(OutputInfo("input_detached", in_storages[storage], ViewMeta.relative(
                o, f_ins[in_storages[storage]])))
        elif not custom and storage in in_storages and (replay or _replayable(o, f_ins[in_storages[storage]])):
            infos.append(OutputInfo("input_view", in_storages[storage], ViewMeta.relative(
                o, f_ins[in_storages[storage]]), rg, is_leaf=leaf, replay=replay))
        elif not custom and o._is_view() and id(o._base) in plain_ids and (replay or _replayable(o, o._base)):
            infos.append(OutputInfo("output_view", plain_ids[id(o._base)], ViewMeta.relative(o, o._base), rg,
                                    is_leaf=leaf, replay=replay))
        elif not custom and base is not None and storage not in in_storages and (replay or _replayable(o, base)):
            k = next((b for b, t in enumerate(bases) if t is base), None)
            if k is None:
                k = len(bases)
                bases.append(base)
            infos.append(OutputInfo("intermediate_view", k, ViewMeta.relative(o, base), rg, is_leaf=leaf,
                                    replay=replay))
        else:
            infos.append(OutputInfo("plain", requires_grad=rg, is_leaf=leaf, is_view=o._is_view()))
        seen.setdefault(id(o), j)
    return tuple(infos), bases


def without_rebound(fn, captured, found: list) -> list:
    """The reads of a capture of ``fn``, less those of the module attributes its graph rebinds
    (``runtime.call.Rebound``: a forward pre-hook's ``module.weight = ...``): every call binds them
    before anything reads them (a graph that read the old value was refused), so the value held
    between calls is the graph's own output, not state the graph was made for."""
    spec = getattr(captured, "out_spec", None)
    if spec is None or spec.type is not Rebound or not isinstance(fn, torch.nn.Module):
        return found
    places = set()
    for path, attr in spec.context:
        m = fn.get_submodule(path)
        places.update(((id(m), attr), (id(vars(m)), attr)))
    return [r for r in found if (id(r.where), r.key) not in places]
