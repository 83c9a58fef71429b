"""Fresh, faithful copies of sample inputs, and functions of tensor leaves.

check() needs a fresh copy of every input per run. ``copy.deepcopy`` refuses
non-leaf tensors, and ``clone()`` drops storage offsets, overlapping strides
and storage shared between inputs -- all things OpInfo samples exercise. So
each tensor is rebuilt over a clone of its whole storage, as a leaf with the
original's requires_grad, and tensors that shared a storage still do.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree


class _Copier:
    def __init__(self):
        self.storages = {}   # data_ptr of an original storage -> its clone
        self.tensors = {}    # id of an original tensor -> its copy

    def __call__(self, t):
        if id(t) not in self.tensors:
            self.tensors[id(t)] = self._copy(t)
        return self.tensors[id(t)]

    def _copy(self, t):
        if t.layout != torch.strided or type(t) is not torch.Tensor:
            c = t.detach().clone()
        else:
            c = torch.empty(0, dtype=t.dtype, device=t.device)
            c.set_(self._storage(t), t.storage_offset(), t.size(), t.stride())
        return c.requires_grad_(t.requires_grad)

    def _storage(self, t):
        s = t.untyped_storage()
        if s.nbytes() == 0:
            return s.clone()
        key = s.data_ptr()
        if key not in self.storages:
            self.storages[key] = s.clone()
        return self.storages[key]


def fresh(tree):
    """A copy of every tensor in ``tree`` (any pytree), sharing preserved."""
    return pytree.tree_map_only(torch.Tensor, _Copier(), tree)


def tensor_function(fn, tree, name):
    """Bake the non-tensor leaves of ``tree`` into ``fn``.

    Returns ``(f, tensors)`` where ``f(*tensors)`` rebuilds ``tree`` and calls
    ``fn(*args, **kwargs)`` with it; ``tree`` is ``(args, kwargs)``.
    """
    flat, spec = pytree.tree_flatten(tree)
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    tensors = [flat[i] for i in slots]
    consts = [None if isinstance(v, torch.Tensor) else v for v in flat]

    def f(*ts):
        vals = list(consts)
        for i, t in zip(slots, ts):
            vals[i] = t
        args, kwargs = pytree.tree_unflatten(vals, spec)
        return fn(*args, **kwargs)
    f.__name__ = f.__qualname__ = name
    return f, tensors
