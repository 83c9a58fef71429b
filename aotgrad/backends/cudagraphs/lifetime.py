"""Output lifetime: a replay writes its recording's outputs again, in the same memory, and a
recording's temporaries (freed when its capture ended) may since hold the outputs of a
recording captured after it in the same pool, which its replays then overwrite too.

So nothing the caller can keep lives in recorded memory, and the user's tensors behave like
eager's:

* an output in an input's memory is a view of the caller's tensor (the tensor itself when it
  has the same geometry): a saved input shares the caller's version counter, so writing it in
  place before the backward raises as in eager;
* every other output is copied out, one copy per recorded storage;
* a saved tensor in the memory of an output so copied is a view of that copy (the same object
  when it has the same geometry: ``exp``'s result is returned and saved, as in eager);
* any other saved tensor (read only by the backward) is copied out too while saved-tensor hooks
  are active (a pack hook may keep a view of it, which could not be moved); otherwise it is
  handed out in recorded memory and
  tracked in its pool: before a replay that may overwrite it (of its own recording, or of one
  captured earlier in the pool) it moves to a copy of its memory, keeping its version. Two
  forwards before one backward and ``retain_graph=True`` thus pay a copy; a step that runs its
  backward before the next forward pays nothing.

    y = exp(x); return y (user), y (saved)  ->  user copy c; saved c
    t = x.t();  return t (saved)            ->  saved: the caller's x.t() (version of x)
"""
from __future__ import annotations

import weakref

import torch

from ..._torch import set_version_counter, top_saved_tensors_default_hooks
from ...errors import AotgradError


class StaleOutputError(AotgradError):
    """Kept for callers that catch it: no cudagraphs output is overwritten any more (a replay
    first moves what it would overwrite), so nothing raises it."""


def over(storage, like: torch.Tensor) -> torch.Tensor:
    """A new tensor (not a view) over ``storage`` with ``like``'s geometry and version 0. (``set_`` on a
    fresh tensor that requires no grad records nothing in any grad mode: no ``no_grad`` needed, which
    was 40% of this per-replay call.)"""
    out = torch.empty((0,), dtype=like.dtype, device=like.device).set_(
        storage, like.storage_offset(), like.shape, like.stride())
    set_version_counter(out, 0)
    return out


def homes(inputs, outputs) -> tuple:
    """Per recorded output: None (not a tensor), ``("input", j)`` (in input ``j``'s memory) or
    ``("own", key)`` (recorded memory: the storage pointer, or the position for an empty storage,
    which has no memory to share)."""
    by_storage = {}
    for j, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
            by_storage.setdefault(t.untyped_storage().data_ptr(), j)
    found = []
    for i, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor):
            found.append(None)
            continue
        ptr = o.untyped_storage().data_ptr()
        found.append(("input", by_storage[ptr]) if ptr in by_storage else ("own", ptr or ("empty", i)))
    return tuple(found)


def _view(base: torch.Tensor, ref: torch.Tensor, o: torch.Tensor, itself: bool = True) -> torch.Tensor:
    """``o``, which lies in ``ref``'s memory, as a view of ``base`` (which holds ``ref``'s
    values at its own place); ``base`` itself when the geometry is the same and ``itself``."""
    nbytes = (o.storage_offset() * o.element_size() - ref.storage_offset() * ref.element_size()
              + base.storage_offset() * base.element_size())
    offset = nbytes // o.element_size()
    if itself and base.dtype == o.dtype and (base.shape, base.stride(), base.storage_offset()) == \
            (o.shape, o.stride(), offset):
        return base
    typed = base if base.dtype == o.dtype else base.view(o.dtype)
    return typed.as_strided(o.shape, o.stride(), offset)


def _copied(o: torch.Tensor, key, copies: dict) -> torch.Tensor:
    """``o`` copied out of recorded memory: one copy per storage, and a view (of its base's
    copy) where ``o`` is a view, as the graph's own outputs (a transposed gradient) are."""
    if key not in copies:
        ref = o if o._base is None else o._base
        copies[key] = (ref, over(o.untyped_storage().clone(), ref))
    ref, copy = copies[key]
    if o._base is not None:
        return _view(copy, ref, o, itself=False)
    return copy if o is ref else over(copy.untyped_storage(), o)


def hand_out(rec, outs, args, saved: frozenset, pool) -> tuple:
    """What the caller gets for a replay's ``outs`` (see the module docstring)."""
    result, copies = list(outs), {}
    # A saved-tensor pack hook may keep its own view of a saved tensor, which no move can reach.
    hooked = top_saved_tensors_default_hooks(False) is not None
    for pass_saved in (False, True):
        for i, (o, home) in enumerate(zip(outs, rec.homes)):
            if home is None or (i in saved) != pass_saved:
                continue
            kind, where = home
            if kind == "input":
                result[i] = _view(args[where], rec.inputs[where], o)
            elif where in copies and pass_saved:
                ref, copy = copies[where]
                result[i] = _view(copy, ref, o)
            elif not pass_saved or hooked:
                result[i] = _copied(o, where, copies)
            else:
                result[i] = over(o.untyped_storage(), o)
                pool.handed.append((rec.order, weakref.ref(result[i])))
    return tuple(result)


def evacuate(pool, order: int) -> None:
    """Before a replay of the recording captured ``order``-th in ``pool``: move every live saved
    tensor handed out by it or by a recording captured after it to a copy of its memory."""
    if not pool.handed:
        return
    keep, moved = [], {}
    for captured, ref in pool.handed:
        t = ref()
        if t is None:
            continue
        if captured < order:
            keep.append((captured, ref))
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in moved:
            moved[storage.data_ptr()] = storage.clone()
        version = t._version
        with torch.no_grad():
            t.set_(moved[storage.data_ptr()], t.storage_offset(), t.shape, t.stride())
        set_version_counter(t, version)    # the same values: the backward must not see a write
    pool.handed = keep
