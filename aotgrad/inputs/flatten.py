"""Flatten a call ``fn(*args, **kwargs)`` into a function of a flat tensor list.

Parameters and buffers of a module are lifted to the front of the flat list
(tied parameters once, under their first name); every tensor leaf of the
pytree of arguments follows. Non-tensor leaves (ints, floats, None, strings)
are baked into the graph and checked on every call.

Inputs that share storage, when one of them is mutated (:func:`find_groups`):
functionalization sees each input as its own tensor, so a write through one
alias would not reach the other. Such a group is replaced by one *synthetic
base* input; inside the graph each member is regenerated as a view of it, so
functionalization propagates the write, and at run time the real base is
passed and written back. Inputs of one storage that touch none of the same bytes
(:func:`..runtime.call.disjoint`: slices of a flat buffer, the separate results a compiler carved
from one allocation) are inputs of their own, as in PyTorch's AOTAutograd: a write
to one cannot reach another.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .._torch import FakeTensor, pytree, subclass_kind, traceable_subclass
from ..runtime.call import rebound, same_objects, tensor_attributes
from ..runtime.modes import left_as_found
from ..guards.reads import paused, thread_watch
from ..ir.descriptors import BaseDesc, BufferDesc, InputDesc, ParamDesc, input_name
from ..ir.records import ViewMeta
from .. import tracing
from ..tracing import tree
from ..tracing.views import holding
from ..errors import MutationError
from ..tracing.patches import FORWARD_ONLY
from .subclasses import Unwrap, as_inner


@dataclass(frozen=True)
class Slot:
    """Where a lifted parameter or buffer lives: ``module._parameters[attr]``."""
    module: torch.nn.Module
    attr: str
    is_param: bool


@dataclass(frozen=True)
class Signature:
    """How the user's arguments map onto the flat tensor inputs."""
    in_spec: pytree.TreeSpec
    leaves: tuple            # non-tensor leaves baked in; tensors as None
    tensor_pos: tuple        # positions of tensor leaves in ``leaves``
    state_names: tuple       # lifted parameter/buffer names, flat order
    slots: tuple             # Slot per lifted tensor
    ties: tuple = ()         # (name, Slot, flat index): a lifted tensor's second place (a tied weight)
    unwrap: Unwrap | None = None     # subclass inputs as their inner tensors (inputs.subclasses)
    # (j, i): tensor argument j is the object at flat index i < j (``runtime.call.same_objects``); None where the
    # frontend gives distinct objects itself (Dynamo dedupes its graph's inputs)
    same: tuple | None = None


def _slots(module: torch.nn.Module, *walked):
    """``(name, tensor, Slot)`` of each parameter, then each buffer, as ``named_parameters()`` and
    ``named_buffers()`` list them; ``walked``: :func:`_places`, when the caller has it."""
    where = walked[0] if walked else _places(module)
    return [(name, t, Slot(owner, attr, store == "_parameters"))
            for store in ("_parameters", "_buffers") for name, t, owner, attr in _members(module, where, store)]


def _places(module):
    """The module tree's places, walked once (:mod:`..tracing.tree`); None where a class walks its own way."""
    with paused():      # torch's own walk, no user code: not worth a profile event per step
        return tree.places(module)


def _tensor_attributes(module) -> list:
    """:func:`..runtime.call.tensor_attributes` of ``module``, over :func:`_places` with the recording paused
    (aotgrad's own bookkeeping, every trace: no user code runs in it); the classes' own walk, watched,
    where one walks its own way."""
    where = _places(module)
    if where is None:
        return tensor_attributes(module)
    seen = set()
    with paused():
        return [(path, m, k, v) for path, m in where if not (id(m) in seen or seen.add(id(m)))
                for k, v in vars(m).items() if isinstance(v, torch.Tensor)]


def _members(module, where, store: str, remove_duplicate: bool = True) -> list:
    """``[(name, tensor, owner, attr)]``: :func:`..tracing.tree.members`, else the classes' own walks
    (user code: watched)."""
    with paused():
        found = tree.members(module, where, store, remove_duplicate)
    return found if found is not None else tree.own_members(module, store, remove_duplicate)


def signature(fn, args: tuple, kwargs: dict):
    """The call's signature, its flat tensors and a descriptor for each."""
    with_path, in_spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    leaves, tensor_pos, tensors, descs = [], [], [], []
    where = _places(fn) if isinstance(fn, torch.nn.Module) else None     # the tree, walked once
    state = _slots(fn, where) if isinstance(fn, torch.nn.Module) else []
    with _unwatched({type(t) for _, t, _ in state}):
        for name, t, slot in state:
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
                from ..errors import UnsupportedError, caller_line
                raise UnsupportedError(f"'{name}' of {type(fn).__name__} is not initialized yet (a lazy module such "
                                       "as LazyLinear); call the module once eagerly before capturing it",
                                       user_line=caller_line())
            refuse_tensor(f"'{name}' of {type(fn).__name__}", t)
            tensors.append(t)
            descs.append((ParamDesc if slot.is_param else BufferDesc)(name))
    for i, (path, leaf) in enumerate(with_path):
        _refuse_argument(input_name(path), leaf)
        if isinstance(leaf, torch.Tensor):
            leaves.append(None)
            tensor_pos.append(i)
            tensors.append(leaf)
            descs.append(InputDesc(input_name(path)))
        else:
            leaves.append(leaf)
    same = same_objects(tensors, len(state))
    with _unwatched({type(t) for t in tensors}):
        unwrap = Unwrap.of(tensors, descs)
    if unwrap is not None:      # the graph takes each subclass's inner tensors
        tensors, descs = unwrap.examples(tensors), unwrap.descs(descs)
        for d, t in zip(descs, tensors):
            refuse_tensor(str(d), t)
    sig = Signature(in_spec, tuple(leaves), tuple(tensor_pos),
                    tuple(n for n, _, _ in state), tuple(s for _, _, s in state),
                    _ties(fn, state, where) if state else (), unwrap, same)
    return sig, tensors, descs


_TORCH_CLASSES = frozenset((torch.Tensor, torch.nn.Parameter))


def _unwatched(classes: set):
    """The recording paused where every tensor checked is of torch's own classes: no user code runs
    in checking them (a profile event per call and C call of the checks, per parameter, otherwise).
    A subclass's methods are user code: watched."""
    return paused() if classes <= _TORCH_CLASSES else contextlib.nullcontext()


def _ties(module, state, where) -> tuple:
    """``(name, Slot, flat index)`` of every place that holds a lifted tensor under a second name (a
    tied weight: ``head.weight`` is ``emb.weight``). The graph takes the tensor once, so a call whose
    places no longer hold one tensor (the weight untied since) must not run it."""
    own = {(id(s.module), s.is_param, s.attr) for _, _, s in state}
    first = {id(t): i for i, (_, t, _) in reversed(list(enumerate(state)))}
    out = []
    for is_param, store in ((True, "_parameters"), (False, "_buffers")):
        for name, t, owner, attr in _members(module, where, store, remove_duplicate=False):
            if (id(owner), is_param, attr) not in own and id(t) in first:
                out.append((name, Slot(owner, attr, is_param), first[id(t)]))
    return tuple(out)


@contextlib.contextmanager
def forward_only():
    """While the user's forward is traced in this thread: ``backward()`` and reading an input's
    ``.grad`` are refused with the user's line (the trace would differentiate fake values, or read
    a ``.grad`` that eager has and the trace does not). Other threads' backwards run as usual."""
    with FORWARD_ONLY(), tracing.scope(backward=tracing.REFUSE):
        yield


def _refuse_argument(name: str, leaf) -> None:
    """Arguments whose contents a baked constant would freeze: tensors pytree cannot see, arrays."""
    from ..errors import UnsupportedError, caller_line
    if isinstance(leaf, torch.Tensor):
        refuse_tensor(name, leaf)
        return
    if type(leaf).__module__ == "numpy" and hasattr(leaf, "shape"):
        if isinstance(leaf, sys.modules["numpy"].generic):     # a numpy scalar: numpy.float32(1.5)
            raise UnsupportedError(f"{name} is a numpy scalar (numpy.{type(leaf).__name__}); pass a Python number "
                                   "(item()), which is guarded bit-exactly, or a tensor", user_line=caller_line())
        raise UnsupportedError(f"{name} is a numpy array; its values would be baked into the graph: "
                               "pass torch.from_numpy(array) instead", user_line=caller_line())
    if _holds_tensors(leaf):
        raise UnsupportedError(f"{name} is an object of class {type(leaf).__name__} holding tensors, which is not "
                               "a pytree, so its tensors would be baked into the graph; register the class with "
                               "torch.utils._pytree.register_pytree_node (dataclasses: register_dataclass)",
                               user_line=caller_line())


def refuse_tensor(name: str, t: torch.Tensor) -> None:
    """Tensors a trace through plain fake tensors cannot stand for, refused before anything runs:
    layouts other than strided and nested tensors other than traceable subclasses (the jagged one is),
    and tensor subclasses whose class changes what ops do but cannot be flattened (``__torch_function__``
    subclasses, a ``__torch_dispatch__`` class without ``__tensor_flatten__``)."""
    from ..errors import UnsupportedError, caller_line
    why = subclass_kind(t)
    if (t.is_nested or t.layout != torch.strided) and not traceable_subclass(t):
        what = f"a nested tensor ({type(t).__name__}, layout {t.layout})" if t.is_nested else f"of layout {t.layout}"
        raise UnsupportedError(f"{name} is {what}; only strided (dense) tensors and traceable wrapper subclasses "
                               "can be captured", user_line=caller_line())
    if why is not None and not traceable_subclass(t):
        raise UnsupportedError(f"{name} is a {type(t).__name__}, a tensor subclass that {why} but no "
                               "__tensor_flatten__/__tensor_unflatten__; aotgrad traces plain tensors and traceable "
                               "wrapper subclasses (the graph would not run the subclass's code): pass plain "
                               "tensors, or compile this function with another torch.compile backend",
                               user_line=caller_line())


def _holds_tensors(obj) -> bool:
    inner = None if isinstance(obj, (torch.Tensor, torch.nn.Module)) else getattr(obj, "__dict__", None)
    return isinstance(inner, dict) and any(isinstance(v, torch.Tensor) for v in inner.values())


class Outputs(list):
    """A flat function's output leaves; ``spec`` is their tree structure (the trace returns it);
    ``replaced``: the tensors module attributes held before the trace rebound them (``runtime.call.rebound``)."""
    spec: pytree.TreeSpec
    replaced: tuple = ()


def outputs(out) -> Outputs:
    leaves, spec = pytree.tree_flatten(out)
    flat = Outputs(leaves)
    flat.spec = spec
    return flat


def flat_function(fn, sig: Signature) -> Callable:
    """``flat_fn(*tensors) -> Outputs``: the output leaves, with their tree structure."""
    n_state = len(sig.state_names)
    homes = state_homes(sig) if isinstance(fn, torch.nn.Module) else None

    def flat_fn(*flat):
        if sig.same:        # one object passed twice: one stand-in in both places
            flat = list(flat)
            for j, i in sig.same:
                flat[j] = flat[i]
        leaves = list(sig.leaves)
        for pos, t in zip(sig.tensor_pos, flat[n_state:]):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, sig.in_spec)
        attrs = _tensor_attributes(fn) if homes is not None else ()
        with forward_only(), left_as_found(thread_watch()):
            if homes is not None:
                out = call_with_state(fn, homes, flat[:n_state], args, kwargs)
            else:
                out = fn(*args, **kwargs)
        out, replaced = rebound(attrs, as_inner(out))     # a pre-hook's module.weight = ... (weight_norm)
        flat_out = outputs(out)
        flat_out.replaced = replaced
        _refuse_hidden_tensors(flat_out)
        return flat_out

    if homes is not None:
        flat_fn.module_state = lambda flat: holding(homes, flat[:n_state])
    flat_fn.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return flat_fn if sig.unwrap is None else sig.unwrap.wrap(flat_fn)


def module_state(flat_fn, flat):
    """A context in which ``flat_fn``'s module (if any) holds ``flat``'s parameters and buffers.
    The backward runs in it: a ``torch.utils.checkpoint`` region recomputed there calls the
    module again, and must read the traced inputs, not the real parameters."""
    state = getattr(flat_fn, "module_state", None)
    return state(flat) if state is not None else contextlib.nullcontext()


def state_homes(sig: Signature) -> tuple:
    """Every ``(module __dict__, "_parameters" or "_buffers", attr, flat index)`` holding a lifted
    tensor: its own slot, and each second place of a tied one (``sig.ties``: one flat input with
    several homes, each swapped exactly once). A home names its module's dict by attribute, not the
    dict object: a capture may stand a per-thread view in for it (``tracing.views``)."""
    places = [(s, i) for i, s in enumerate(sig.slots)] + [(s, i) for _, s, i in sig.ties]
    return tuple((s.module.__dict__, "_parameters" if s.is_param else "_buffers", s.attr, i) for s, i in places)


def call_with_state(module, homes, state, args, kwargs):
    """``module(*args, **kwargs)`` holding ``state``. A buffer the forward rebinds
    (``self.count = self.count + 1``) becomes a write into the lifted buffer, which the
    runtime replays on the real one."""
    with holding(homes, state):
        out = module(*args, **kwargs)
        for md, kind, attr, i in homes:
            if md[kind][attr] is not state[i]:
                _rebound(attr, state[i], md[kind][attr])
    return out


def _rebound(attr: str, lifted: torch.Tensor, new) -> None:
    from ..errors import MutationError
    if not (isinstance(new, torch.Tensor) and new.shape == lifted.shape and new.dtype == lifted.dtype
            and new.device == lifted.device and not new.requires_grad and not lifted.requires_grad):
        raise MutationError(f"the forward rebinds '{attr}' to a tensor of another shape, dtype or device, one "
                            "that requires grad, or a non-tensor; only a buffer rebound to a tensor like it "
                            "can be replayed (or update it in place)")
    with torch.no_grad():
        lifted.copy_(new)


def _refuse_hidden_tensors(leaves) -> None:
    """An output object pytree cannot see into would come back holding trace-time tensors."""
    for leaf in leaves:
        if _holds_tensors(leaf):
            from ..errors import UnsupportedError, caller_line
            raise UnsupportedError(f"the function returns an object of class {type(leaf).__name__} holding tensors, "
                                   "which is not a pytree; register its class with "
                                   "torch.utils._pytree.register_pytree_node (or return its tensors in a tuple or dict)",
                                   user_line=caller_line())


# --- inputs that alias a mutated input

@dataclass(frozen=True)
class AliasGroup:
    members: tuple          # flat input indices
    views: tuple            # ViewMeta of each member on the base's storage


@dataclass(frozen=True)
class Rebase:
    """How a flat input list becomes the graph's inputs: untouched inputs first, then one base per group."""
    n_inputs: int
    groups: tuple
    kept: tuple             # flat indices passed through

    def graph_inputs(self, flat: list) -> list:
        return [flat[i] for i in self.kept] + [real_base([flat[i] for i in g.members], g) for g in self.groups]

    def descs(self, descs) -> list:
        return [descs[i] for i in self.kept] + [
            BaseDesc(tuple(descs[i] for i in g.members)) for g in self.groups]

    def wrap(self, flat_fn):
        """``flat_fn`` on the graph's inputs: members regenerated as views of their base."""
        n_kept = len(self.kept)

        def fn(*graph_inputs):
            flat = [None] * self.n_inputs
            for i, t in zip(self.kept, graph_inputs):
                flat[i] = t
            for g, base in zip(self.groups, graph_inputs[n_kept:]):
                for i, v in zip(g.members, g.views):
                    flat[i] = base.as_strided(v.size, v.stride, v.offset)
            return flat_fn(*flat)
        fn.__name__ = flat_fn.__name__
        return fn


def _key(t: torch.Tensor):
    return t.untyped_storage()._cdata if t.device.type != "meta" else id(t)


def find_groups(tensors, mutated: set) -> list[AliasGroup]:
    """Groups of inputs sharing a storage where some member is mutated."""
    by_storage: dict = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            by_storage.setdefault(_key(t), []).append(i)
    groups = []
    for members in by_storage.values():
        if len(members) > 1 and mutated & set(members):
            groups.append(AliasGroup(tuple(members), tuple(ViewMeta.of(tensors[i]) for i in members)))
    return groups


def rebase(n_inputs: int, groups) -> Rebase:
    grouped = {i for g in groups for i in g.members}
    return Rebase(n_inputs, tuple(groups), tuple(i for i in range(n_inputs) if i not in grouped))


def real_base(members: list, group: AliasGroup) -> torch.Tensor:
    """The tensor whose storage all members view, with autograd history where there is one."""
    first = members[0]
    if all(m is first for m in members):
        return first if first._base is None else first._base
    bases = {id(m._base) if m._base is not None else id(m) for m in members}
    root = first._base if first._base is not None else first
    if len(bases) == 1:
        return root
    if any(m.requires_grad for m in members):
        raise MutationError("inputs share storage without a common base tensor and require grad; "
                            "pass views of one base tensor instead")
    storage = first.untyped_storage()
    # Dynamo's example inputs are fake (a set_() it ran before the graph left two sharing one storage):
    # their storage is a meta one, which only the fake mode sets on a tensor.
    with first.fake_mode if isinstance(first, FakeTensor) else contextlib.nullcontext():
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage)
