"""The per-shape state machine: warm up, record, replay.

``Graphed`` wraps one capturable callable. Each distinct input key (shapes,
strides, dtypes, scalar values and the addresses of in-place inputs) gets
its own :class:`Recording`, which runs eagerly for ``warmup`` calls, then
records, then replays (and records once more where inputs it copies in settle
in memory recorded in its pool: ``Recording.SETTLED``). Recordings are kept in least-recently-used order and
bounded: past ``max_recordings`` a new key either runs eagerly (``"eager"``,
the default) or evicts the least recently used recording (``"evict"``), and a
warning says so once.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from ...ir.records import reach, reached_bytes
from .lifetime import Plan, evacuate, hand_out, over, recorded_storage
from .runners import CaptureFailed, Pool

_NEW = object()


def input_key(args, in_place) -> tuple:
    key = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device,
                        a.data_ptr() if i in in_place else None))
        else:
            key.append(a)
    return tuple(key)


def _span(t: torch.Tensor) -> torch.Tensor:
    """The stretch of storage ``t`` reads, as one flat tensor: copying it copies ``t`` whatever
    its strides, including an expanded (stride-0) input that ``copy_`` cannot write into."""
    return t.as_strided((reach(t.shape, t.stride()),), (1,), t.storage_offset())


def _static_copy(t):
    if not isinstance(t, torch.Tensor):
        return t
    if t.numel() and t.untyped_storage().nbytes() < reached_bytes(t):
        from ...errors import UnsupportedError, caller_line
        raise UnsupportedError(f"an input of shape {tuple(t.shape)} whose storage was freed (resized to "
                               f"{t.untyped_storage().nbytes()} bytes, as FSDP frees parameters) cannot be copied "
                               "into a CUDA graph's static input: use another compiler for this function",
                               user_line=caller_line())
    span = _span(t)
    return torch.empty_like(span).copy_(span).as_strided(t.shape, t.stride(), 0)


class Recording:
    """One input key's warm-up count, static inputs and runner.

    Besides the owner's parameters and buffers, a tensor input passed at the
    same address on every warm-up call and the recording call is used in
    place. If it later arrives elsewhere, this shape is recorded again with
    that input (and only it) copied in: a caching allocator hands a fresh
    tensor (a backward's tangent) the same address for a few calls, then
    another, and each input can move out of place only once.
    """

    # Replays in a row at which a copied-in input came at the address of the replay before it, in
    # memory a recording of this pool holds, after which the shape is recorded once more with those
    # read in place: a backward's saved tensors move once, from the forward's warm-up (eager memory)
    # to its recording's memory, and stay there. Only recorded memory qualifies: a fresh tensor
    # that the allocator placed at one address for a while is no sign that it stays there.
    SETTLED = 2

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        self.calls, self.replays, self.recorded = 0, 0, False
        self.runner = owner.make_runner()
        self.seen: dict[int, int] | None = None     # input index -> address on every call so far
        self.promoted = False
        self.last: dict[int, tuple] = {}    # copied-in input index -> (its address, replays in a row there)
        self.copied = 0

    def __call__(self, args):
        o = self.owner
        self.calls += 1
        if not self.recorded:       # (once recorded, a move or a promotion sets what is stable)
            self._observe(args)
        if self.calls <= o.config.warmup:
            return tuple(self.runner.warmup(o.fn, args))
        moved = self.recorded and {i for i, p in self.stable.items() if args[i].data_ptr() != p}
        if moved:
            self.seen = {i: p for i, p in self.stable.items() if i not in moved}
            self.recorded, self.runner = False, o.make_runner()
        elif self.recorded and not self.promoted and self._settled(args):
            settled = {i: ptr for i, (ptr, n) in self.last.items() if n >= self.SETTLED}
            self.seen, self.recorded, self.runner = {**self.stable, **settled}, False, o.make_runner()
            self.promoted = True        # once: a later move records again with these copied in
        if not self.recorded:
            self._record(args)
        else:
            self._copy_in(args)
            evacuate(o.pool, self.order)
            self.runner.replay()
        self.replays += 1
        self._copy_back(args)
        return self.outputs

    def _observe(self, args):
        ptrs = {i: a.data_ptr() for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        if self.seen is None:
            self.seen = ptrs if self.owner.config.warmup > 0 else {}
        else:
            self.seen = {i: p for i, p in self.seen.items() if ptrs.get(i) == p}

    def _settled(self, args) -> bool:
        """Whether some input copied in, in memory this pool recorded, has come at one address for
        ``SETTLED`` replays in a row (those are added to ``self.last``, the others left out)."""
        streak, pool = {}, self.owner.pool
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i not in self.owner.in_place and i not in self.stable \
                    and pool.holds(a):
                ptr, n = self.last.get(i, (None, 0))
                streak[i] = (ptr, n + 1) if ptr == a.data_ptr() else (a.data_ptr(), 0)
        self.last = streak
        return any(n >= self.SETTLED for _, n in streak.values())

    def _record(self, args):
        o = self.owner
        self.recorded, self.order = True, o.pool.next_order()
        self.stable = {i: p for i, p in self.seen.items() if i not in o.in_place}
        # A stable input is read where it is, through a tensor of our own over the recorded storage
        # where it was handed out: the caller's storage (a saved tensor's) may later move
        # (lifetime.evacuate) while that memory stays.
        self.inputs = [a if i in o.in_place or not isinstance(a, torch.Tensor) else
                       over(recorded_storage(a), a) if i in self.stable else _static_copy(a)
                       for i, a in enumerate(args)]
        self.outputs = self.runner.record(o.fn, self.inputs)
        o.pool.recorded(self.outputs)
        self.plan = Plan(self.inputs, self.outputs)

    def _copy_in(self, args):
        copied = 0
        with torch.no_grad():
            for s, a in zip(self.inputs, args):
                if isinstance(a, torch.Tensor) and s is not a and s.data_ptr() != a.data_ptr():
                    _span(s).copy_(_span(a))
                    copied += 1
        self.copied = copied        # inputs copied in by the last replay (benchmarks.gpu reports it)

    def _copy_back(self, args):
        # Writes to a copied-in input landed in its static buffer; the caller's tensor needs them.
        with torch.no_grad():
            for i in self.owner.written:
                if self.inputs[i] is not args[i] and self.inputs[i].data_ptr() != args[i].data_ptr():
                    args[i].copy_(self.inputs[i])


class Graphed:
    """A callable graphed per input key, its recordings in one memory ``pool``; what the caller
    gets is decided by :func:`.lifetime.hand_out`."""

    def __init__(self, fn, name: str, config, in_place, written, make_runner, output_names=(),
                 pool=None):
        self.fn, self.name, self.config = fn, name, config
        self.pool = pool if pool is not None else Pool()
        self.in_place, self.written = frozenset(in_place), tuple(written)
        self.make_runner = make_runner
        self.output_names = tuple(output_names)
        self.recordings: OrderedDict = OrderedDict()
        self.eager_calls = 0
        self._warned = False

    def __call__(self, *args):
        key = input_key(args, self.in_place)
        rec = self._lookup(key)
        if rec is not None:
            try:
                outs = rec(args)
            except CaptureFailed as e:      # nothing ran: this key runs without CUDA graphs from now on
                self.recordings[key] = None
                warnings.warn(f"aotgrad cudagraphs: {self.name} could not be recorded for these input shapes "
                              f"({e}); they run without CUDA graphs", stacklevel=2)
            else:
                return outs if rec.calls <= self.config.warmup else hand_out(rec, outs, args, self.pool)
        self.eager_calls += 1
        return self.fn(*args)

    def _lookup(self, key):
        rec = self.recordings.get(key, _NEW)
        if rec is not _NEW:             # (None: a key whose capture failed)
            self.recordings.move_to_end(key)
            return rec
        if len(self.recordings) >= self.config.max_recordings:
            self._warn_full()
            if self.config.on_full == "eager":
                return None
            self.recordings.popitem(last=False)
        rec = self.recordings[key] = Recording(self, f"{self.name} recording {len(self.recordings)}")
        return rec

    def _warn_full(self):
        if not self._warned:
            self._warned = True
            what = "run without CUDA graphs" if self.config.on_full == "eager" else \
                "evict the least recently used recording"
            warnings.warn(f"aotgrad cudagraphs: {self.name} has {self.config.max_recordings} "
                          f"recordings (max_recordings); new input shapes {what}", stacklevel=3)
