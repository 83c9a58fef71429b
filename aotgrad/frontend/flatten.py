"""Flatten a call ``fn(*args, **kwargs)`` into a function of a flat tensor list.

Parameters and buffers of a module are lifted to the front of the flat list
(tied parameters once, under their first name); every tensor leaf of the
pytree of arguments follows. Non-tensor leaves (ints, floats, None, strings)
are baked into the graph and checked on every call.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree

from ..capture.descriptors import Desc


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


def _slots(module: torch.nn.Module):
    named = []
    for kind, items in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            named.append((name, t, Slot(sub, attr, kind == "param")))
    return named


def _input_name(path) -> str:
    (top, *rest) = path
    rest_s = pytree.keystr(tuple(rest))
    if top.idx == 0:     # positional args tuple
        return f"input {rest[0].idx}{pytree.keystr(tuple(rest[1:]))}"
    return f"input{rest_s}"


def signature(fn, args: tuple, kwargs: dict):
    """The call's signature, its flat tensors and a descriptor for each."""
    with_path, in_spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    leaves, tensor_pos, tensors, descs = [], [], [], []
    state = _slots(fn) if isinstance(fn, torch.nn.Module) else []
    for name, t, slot in state:
        tensors.append(t)
        descs.append(Desc("param" if slot.is_param else "buffer", name))
    for i, (path, leaf) in enumerate(with_path):
        if isinstance(leaf, torch.Tensor):
            leaves.append(None)
            tensor_pos.append(i)
            tensors.append(leaf)
            descs.append(Desc("input", _input_name(path)))
        else:
            leaves.append(leaf)
    sig = Signature(in_spec, tuple(leaves), tuple(tensor_pos),
                    tuple(n for n, _, _ in state), tuple(s for _, _, s in state))
    return sig, tensors, descs


def flat_function(fn, sig: Signature, out_specs: list) -> Callable:
    """``flat_fn(*tensors) -> list`` of output leaves; appends each call's output spec to ``out_specs``."""
    n_state = len(sig.state_names)
    is_module = isinstance(fn, torch.nn.Module)

    def flat_fn(*flat):
        leaves = list(sig.leaves)
        for pos, t in zip(sig.tensor_pos, flat[n_state:]):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, sig.in_spec)
        if is_module:
            state = dict(zip(sig.state_names, flat[:n_state]))
            out = torch.func.functional_call(fn, state, args, kwargs, tie_weights=True, strict=False)
        else:
            out = fn(*args, **kwargs)
        out_leaves, spec = pytree.tree_flatten(out)
        out_specs.append(spec)
        return out_leaves

    if isinstance(fn, torch.nn.Module):
        flat_fn.module_state = lambda flat: torch.nn.utils.stateless._reparametrize_module(
            fn, dict(zip(sig.state_names, flat[:n_state])), tie_weights=True, strict=False)
    flat_fn.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return flat_fn


def module_state(flat_fn, flat):
    """A context in which ``flat_fn``'s module (if any) holds ``flat``'s parameters and buffers.
    The backward runs in it: a ``torch.utils.checkpoint`` region recomputed there calls the
    module again, and must read the traced inputs, not the real parameters."""
    state = getattr(flat_fn, "module_state", None)
    return state(flat) if state is not None else contextlib.nullcontext()
