"""Graph runners: record a callable once on static inputs, then replay it.

A runner owns one recording. ``record(fn, inputs)`` returns the static
outputs; ``replay()`` recomputes them in the same memory, so a replay
overwrites what the previous one handed out — the property the rest of the
backend is built around.

* :class:`NullRunner` records by calling ``fn`` and replays by calling it
  again and copying the results into the recorded outputs; it runs anywhere
  and lets the whole state machine be tested on CPU. Given its :class:`Pool`,
  a replay also overwrites (NaN, flipped bits) the recorded outputs of every
  recording captured after it in that pool, as a GPU replay may write over
  them through its temporaries: what survives it on CPU survives a GPU.
* :class:`CudaRunner` captures a ``torch.cuda.CUDAGraph`` on a side stream
  into the memory pool shared by one compiled function's graphs.
"""
from __future__ import annotations

import weakref

import torch

from ..._torch import cuda_end_allocate_to_pool, storage_over, swap_storage_memory


class Pool:
    """One memory pool shared by a compiled function's graphs. A recording's replays may write
    over the outputs of recordings captured after it (into its freed temporaries), so each
    recording takes its place in ``captures`` order, and the storages handed out over recorded
    memory are tracked in ``handed`` (``(order, weakref)``; see :mod:`.lifetime`)."""

    def __init__(self, cuda: bool = False):
        self.handle = torch.cuda.graph_pool_handle() if cuda else object()
        self.captures = 0
        self.handed: list = []
        self.null_runners: list = []    # weak references to the NullRunners recorded here, in order
        self.outputs: dict = {}         # storage address -> weakref to a recorded output there

    def next_order(self) -> int:
        self.captures += 1
        return self.captures

    def recorded(self, outputs) -> None:
        """Note the memory of a recording's ``outputs`` (dropping what no recording holds any more)."""
        self.outputs = {p: r for p, r in self.outputs.items() if r() is not None}
        for o in outputs:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr():
                self.outputs[o.untyped_storage().data_ptr()] = weakref.ref(o)

    def hand(self, recorded, order: int):
        """A storage of the caller's over the memory of ``recorded`` (a storage a recording captured
        ``order``-th wrote its outputs to), which it keeps alive: a recording dropped meanwhile (recorded
        again, evicted, collected) frees no memory still handed out. Without the exchange of memory
        that moves it later (``lifetime.evacuate``), a copy."""
        if swap_storage_memory is None:
            return recorded.clone()
        storage = storage_over(recorded.data_ptr(), recorded.device, recorded.nbytes())
        storage.recorded = recorded     # (kept with the storage as long as a tensor is over it)
        self.handed.append((order, weakref.ref(storage)))
        return storage

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in memory that a live recording of this pool wrote its outputs to."""
        ptr = t.untyped_storage().data_ptr()
        ref = self.outputs.get(ptr)
        out = ref() if ref is not None else None
        return out is not None and out.untyped_storage().data_ptr() == ptr


def _storage_ptr(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def _overwrite(outputs) -> None:
    """Write over the memory of ``outputs``, each storage once: NaN bytes under a floating-point
    tensor, every value changed (bits flipped, ``False`` <-> ``True``) under any other."""
    done = set()
    with torch.no_grad():
        for o in outputs:
            storage = o.untyped_storage()
            if storage.data_ptr() in done or not storage.nbytes():
                continue
            done.add(storage.data_ptr())
            raw = torch.empty((0,), dtype=torch.uint8, device=o.device).set_(storage)
            if o.is_floating_point() or o.is_complex():
                raw.fill_(0xFF)
            else:
                raw.bitwise_xor_(1 if o.dtype == torch.bool else 0x5A)


class NullRunner:
    device_type = "cpu"

    def __init__(self, pool=None):
        self.pool = pool if isinstance(pool, Pool) else None

    def warmup(self, fn, args):
        return fn(*args)

    def record(self, fn, inputs):
        self.fn, self.inputs = fn, inputs
        self.outputs = tuple(fn(*inputs))
        in_ptrs = {_storage_ptr(t) for t in inputs} - {None}
        # Outputs that view an input's memory are recomputed by the writes to that input.
        self._copy = [i for i, o in enumerate(self.outputs)
                      if isinstance(o, torch.Tensor) and _storage_ptr(o) not in in_ptrs]
        if self.pool is not None:
            self.pool.null_runners.append(weakref.ref(self))
        return self.outputs

    def replay(self):
        if self.pool is not None:
            self._overwrite_later()
        fresh = self.fn(*self.inputs)
        with torch.no_grad():
            for i in self._copy:
                self.outputs[i].copy_(fresh[i])


    def _overwrite_later(self) -> None:
        runners = [r() for r in self.pool.null_runners]
        later = runners[next(i for i, r in enumerate(runners) if r is self) + 1:]
        _overwrite([r.outputs[i] for r in later if r is not None for i in r._copy])


class CudaRunner:
    device_type = "cuda"

    def __init__(self, pool):
        self.pool = pool
        self.stream = torch.cuda.Stream()

    def warmup(self, fn, args):
        # Warm-up runs on the side stream the capture will use, so lazy
        # initialisation (cuBLAS workspaces, allocator pools) happens there.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn(*args)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def record(self, fn, inputs):
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        caller = torch.cuda.current_stream()
        try:
            # thread_local: another thread's CUDA calls (a DataLoader pinning memory, NCCL's watchdog)
            # do not invalidate this capture, as in torch's own CUDA graph trees
            with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                outputs = tuple(fn(*inputs))
        except Exception as e:
            _end_failed_capture(caller, self.stream, self.pool)
            raise CaptureFailed(_first_cause(e)) from e
        self.graph.replay()          # capture only records; this computes the first outputs
        return outputs

    def replay(self):
        self.graph.replay()


class CaptureFailed(Exception):
    """A CUDA graph capture failed (``cause``: the op's error, or CUDA's invalidated capture). Its
    kernels were recorded, never run: the call runs without CUDA graphs instead (``recording``)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        self.cause = cause


def _first_cause(e: BaseException) -> BaseException:
    """The error a failed capture began with: ``torch.cuda.graph``'s exit raises CUDA's "capture
    invalidated" over the op's own error, which it then holds as its context."""
    return e.__context__ if e.__context__ is not None and e.__cause__ is None else e


def _end_failed_capture(caller, stream, pool) -> None:
    """Put back what a failed capture leaves behind. ``CUDAGraph.capture_end`` raises before it
    ends the default generator's capture, so every later eager draw would raise "Offset increment
    outside graph capture": an empty capture on the same stream begins and ends it again (no offset
    moves: eager's random stream is unchanged); its exit never left the capture's stream either,
    and its pool stays open to the failed capture's allocations."""
    torch.cuda.set_stream(caller)
    try:        # (where the capture did end, the pool was closed with it)
        cuda_end_allocate_to_pool(caller.device.index, pool)
    except (TypeError, RuntimeError):
        pass
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream, capture_error_mode="thread_local"):
        torch.empty(1, device=caller.device).zero_()        # (its exit puts the caller's stream back)
