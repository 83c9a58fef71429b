"""Output lifetime: a replay writes its recording's outputs again, in the same memory, and a
recording's temporaries (freed when its capture ended) may since hold the outputs of a
recording captured after it in the same pool, which its replays then overwrite too.

So what the caller gets behaves like eager's:

* an output in an input's memory is a view of the caller's tensor (the tensor itself when it
  has the same geometry): a saved input shares the caller's version counter, so writing it in
  place before the backward raises as in eager;
* every other output is handed out in recorded memory, under a storage of its own per recorded
  storage (outputs sharing one are views of one tensor, sharing its version counter: ``exp``'s
  result returned and saved is one object, as in eager). That storage keeps the recorded one
  alive and is tracked in the pool: before a replay that may write over it (of its own recording,
  or of one captured earlier in the pool) a storage still alive gets a copy of its memory in
  exchange (``_torch.swap_storage_memory``), so every tensor and view over it follows, versions
  unchanged. A step whose outputs are gone by the next replay (the loss, gradients set to None,
  saved tensors freed by the backward) copies nothing; one that keeps them (two forwards before
  one backward, ``retain_graph=True``, gradients accumulated in place) pays a copy of those;
* on a torch without that exchange every such output is copied out at once.

    y = exp(x); return y (user), y (saved)  ->  one tensor over recorded memory, handed out twice
    t = x.t();  return t (saved)            ->  saved: the caller's x.t() (version of x)
"""
from __future__ import annotations

import torch

from ..._torch import set_version_counter, swap_storage_memory
from ...errors import AotgradError


class StaleOutputError(AotgradError):
    """Kept for callers that catch it: no cudagraphs output is overwritten any more (a replay
    first moves what it would overwrite), so nothing raises it."""


def over(storage, like: torch.Tensor) -> torch.Tensor:
    """A new tensor (not a view) over ``storage`` with ``like``'s geometry and version 0. (``set_`` on a
    fresh tensor that requires no grad records nothing in any grad mode: no ``no_grad`` needed, which
    was 40% of this per-replay call; ``new_empty`` parses no dtype or device.)"""
    out = like.new_empty((0,)).set_(storage, like.storage_offset(), like.shape, like.stride())
    set_version_counter(out, 0)
    return out


def recorded_storage(t: torch.Tensor):
    """The storage of ``t``'s memory: the recorded one where ``t`` is over a storage handed out."""
    storage = t.untyped_storage()
    return getattr(storage, "recorded", storage)


class Plan:
    """How a recording's outputs are handed out, worked out once when it is recorded: ``storages``, per
    recorded storage that outputs lie in, the storage and the tensor holding its whole geometry (its
    base); ``steps``, per output, None (not a tensor) or one of

    * ``("input", j)``: in the memory of input ``j``, a view of the caller's;
    * ``("base", k)``: the base of the ``k``-th storage itself;
    * ``("view", k, (dtype, shape, stride, offset))``: a view of that base, where the output is a view;
    * ``("over", k, o)``: a tensor of its own over that storage, like the output ``o`` (eager's int view
      of a float that requires grad is no view)."""

    def __init__(self, inputs, outputs):
        by_storage, own = {}, {}
        for j, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                by_storage.setdefault(t.untyped_storage().data_ptr(), j)
        self.storages, self.steps = [], []
        for i, o in enumerate(outputs):
            ptr = o.untyped_storage().data_ptr() if isinstance(o, torch.Tensor) else None
            if ptr is None or ptr in by_storage:
                self.steps.append(None if ptr is None else ("input", by_storage[ptr]))
                continue
            k = own.setdefault(ptr or ("empty", i), len(self.storages))
            if k == len(self.storages):
                self.storages.append((o.untyped_storage(), o if o._base is None else o._base))
            self.steps.append(("base", k) if o is self.storages[k][1] else ("over", k, o) if o._base is None else
                              ("view", k, (o.dtype, o.shape, o.stride(), o.storage_offset())))


def _view(base: torch.Tensor, ref: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``o``, which lies in ``ref``'s memory, as a view of ``base`` (which holds ``ref``'s values at its
    own place); ``base`` itself when the geometry is the same."""
    offset = (o.storage_offset() * o.element_size() - ref.storage_offset() * ref.element_size()
              + base.storage_offset() * base.element_size()) // o.element_size()
    if base.dtype == o.dtype and (base.shape, base.stride(), base.storage_offset()) == (o.shape, o.stride(), offset):
        return base
    return _as(base, o.dtype, o.shape, o.stride(), offset)


def _as(base: torch.Tensor, dtype, shape, stride, offset: int) -> torch.Tensor:
    return (base if base.dtype == dtype else base.view(dtype)).as_strided(shape, stride, offset)


def hand_out(rec, outs, args, pool) -> tuple:
    """What the caller gets for a replay's ``outs`` (see the module docstring): one tensor over a
    storage handed out per recorded storage, the outputs in it that base, views of it or tensors over it."""
    bases = [over(pool.hand(storage, rec.order), base) for storage, base in rec.plan.storages]
    result = list(outs)
    for i, step in enumerate(rec.plan.steps):
        if step is None:
            continue
        kind, k = step[0], step[1]
        if kind == "input":
            result[i] = _view(args[k], rec.inputs[k], outs[i])
        elif kind == "base":
            result[i] = bases[k]
        elif kind == "view":
            result[i] = _as(bases[k], *step[2])
        else:
            result[i] = over(bases[k].untyped_storage(), step[2])
    return tuple(result)


def evacuate(pool, order: int) -> None:
    """Before a replay of the recording captured ``order``-th in ``pool``: every storage handed out by
    it or by a recording captured after it that is still alive takes a copy of its memory."""
    keep = []
    for captured, ref in pool.handed:
        storage = ref()
        if storage is None:
            continue
        if captured < order:
            keep.append((captured, ref))
            continue
        swap_storage_memory(storage, storage.clone())
        del storage.recorded        # it owns its memory now
    pool.handed = keep
