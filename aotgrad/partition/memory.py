"""Predict what a partition costs in memory, by liveness over its two graphs.

Counted: every storage the forward and backward allocate, from the op that
creates it until the fx-generated code drops its last reference. Not counted:
the graph inputs (parameters and user inputs, alive anyway). A view shares
its base's storage. Between the graphs, the saved tensors and the forward
outputs stay alive; gradients stay alive after the backward (in ``.grad``).
"""
from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import TorchDispatchMode, pytree
from ..errors import traced_line
from ..ir.ops import aliases_input
from .blocks import is_call
from .costs import as_int, flops, tensor_bytes
from .default import is_sym, output_values, placeholders


@dataclass(frozen=True)
class SavedTensor:
    name: str
    shape: tuple
    dtype: object
    nbytes: int                 # 0 when it is a view of a graph input
    source: str | None          # the user's line that produced it


@dataclass(frozen=True)
class MemoryEstimate:
    saved_bytes: int            # saved activations, each storage once, inputs excluded
    peak_bytes: int             # predicted peak of forward + backward above the inputs
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved: tuple[SavedTensor, ...]
    recompute_flops: int        # FLOPs the backward spends recomputing forward values

    def __str__(self) -> str:
        rows = [f"saved {self.saved_bytes} B, predicted peak {self.peak_bytes} B, "
                f"recompute {self.recompute_flops} FLOPs"]
        rows += [f"  {s.name}: {list(s.shape)} {s.dtype} {s.nbytes} B  <- {s.source}" for s in self.saved]
        return "\n".join(rows)


def user_line(node: fx.Node) -> str | None:
    """The innermost frame of the node's stack trace outside torch and aotgrad."""
    return traced_line(node.meta.get("stack_trace"))


def _is_tuple(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (tuple, list))


def _parts(n: fx.Node) -> tuple:
    """Per value of a call of a repeated block's half, the first of its values sharing its storage
    (a half may return a view and its base: one storage)."""
    return _parts_of(n.target)


@functools.lru_cache(maxsize=64)
def _parts_of(part) -> tuple:
    """:func:`_parts` for every call of the half ``part`` (one per layer: worked out once)."""
    g = part.gm.graph
    key, first = _storages(g, {p: p for p in placeholders(g)}), {}
    return tuple(first.setdefault(key.get(o) if isinstance(o, fx.Node) else (None, i), i)
                 for i, o in enumerate(output_values(g)))


def _storages(g: fx.Graph, inputs: dict) -> dict:
    """Storage key of every tensor-valued node: shared by views, one per tuple part.

    ``inputs`` maps each placeholder to its key (``None``: not counted).
    """
    key = dict(inputs)
    for n in g.nodes:
        if n in key or n.op != "call_function" or is_sym(n):
            continue
        if n.target is operator.getitem:     # a part of a tuple; of a split's views: their base
            t, i = n.args
            key[n] = key.get(t) if aliases_input(t) else (t, _parts(t)[i] if is_call(t) else i)
        elif aliases_input(n) and isinstance(n.args[0], fx.Node):
            key[n] = key.get(n.args[0])
        elif _is_tuple(n):
            key[n] = None
        else:
            key[n] = n
    return key


def _allocations(g: fx.Graph, key: dict) -> dict:
    """``node -> {storage key: bytes}`` for the storages each node creates."""
    made = {}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if _is_tuple(n) and not aliases_input(n):
            first = _parts(n) if is_call(n) else range(len(n.meta["val"]))
            made[n] = {(n, i): _storage_bytes(x) for i, (x, j) in enumerate(zip(n.meta["val"], first)) if i == j}
        elif key.get(n) is n:
            made[n] = {n: tensor_bytes(n.meta.get("val"))}
    return made


def _storage_bytes(v) -> int:
    """A tuple part's bytes: its storage's, where it is a view of a larger one (a half returning ``q``
    of a split ``qkv`` keeps all of ``qkv``), else its span."""
    span = tensor_bytes(v)
    try:
        return max(span, as_int(v.untyped_storage().nbytes()))
    except Exception:       # no storage to ask (a symbolic size, a meta value without one)
        return span


def _last_uses(g: fx.Graph, key: dict, made: dict) -> dict:
    order = {n: i for i, n in enumerate(g.nodes)}
    last = {k: order[n] for n, ks in made.items() for k in ks}
    for n in g.nodes:
        for a in n.all_input_nodes:
            for k in (made.get(a, {}) if _is_tuple(a) else [key.get(a)]):
                if k is not None:
                    last[k] = max(last.get(k, -1), order[n])
    return last


def simulate(g: fx.Graph, inputs: dict, input_bytes: dict, free_inputs: bool = False) -> int:
    """Peak bytes of running ``g``: inputs in ``input_bytes`` count from the start
    (and, with ``free_inputs``, are freed after their last use, as a boxed backward
    does with saved activations); the graph's outputs stay alive to its end."""
    key = _storages(g, inputs)
    made = _allocations(g, key)
    last = _last_uses(g, key, made)
    outs = {key.get(o) for o in output_values(g) if isinstance(o, fx.Node)}
    size = {k: b for ks in made.values() for k, b in ks.items()}
    if free_inputs:
        size.update(input_bytes)
    frees = {}
    for k, i in last.items():
        if k not in outs and k in size:
            frees.setdefault(i, []).append(k)
    cur = peak = sum(input_bytes.values())
    for i, n in enumerate(g.nodes):
        cur += sum(made.get(n, {}).values())
        peak = max(peak, cur)
        cur -= sum(size[k] for k in frees.get(i, ()))
    return peak


def estimate(part) -> MemoryEstimate:
    """Saved bytes, predicted peak and saved-tensor report of a Partition."""
    fw, bw = part.forward.graph, part.backward.graph
    fw_outs = output_values(fw)
    n_saved = len(part.saved)
    fw_values = fw_outs[:len(fw_outs) - n_saved]
    saved_nodes = fw_outs[len(fw_outs) - n_saved:][:part.n_saved_tensors]
    fkey = _storages(fw, {p: None for p in placeholders(fw)})     # inputs: not counted
    fsize = {k: b for ks in _allocations(fw, fkey).values() for k, b in ks.items()}
    fw_peak = simulate(fw, {p: None for p in placeholders(fw)}, {})
    entries, seen = [], set()
    for s in saved_nodes:
        k = fkey.get(s)
        entries.append(_entry(s, fsize.get(k, 0) if k not in seen else 0))
        seen.add(k)
    saved_bytes = sum(e.nbytes for e in entries)
    value_keys = {fkey.get(v) for v in fw_values if isinstance(v, fx.Node)} - seen
    held = sum(fsize.get(k, 0) for k in value_keys)     # forward outputs the user still holds

    # The backward takes saved activations as inputs and frees each after its last use.
    bw_ph = placeholders(bw)
    saved_keys = {p: fkey.get(s) for p, s in zip(bw_ph[:part.n_saved_tensors], saved_nodes)}
    tangents = {p: p for p in bw_ph[n_saved:]}
    in_bytes = {k: fsize.get(k, 0) for k in saved_keys.values() if k is not None}
    in_bytes.update({p: tensor_bytes(p.meta.get("val")) for p in tangents})
    bw_peak = simulate(bw, {**saved_keys, **{p: None for p in bw_ph[part.n_saved_tensors:n_saved]}, **tangents},
                       in_bytes, free_inputs=True)
    between = held
    by_name = {n.name: n for n in bw.nodes}
    cost = sum(flops(by_name[r]) for r in getattr(part, "recomputed", ()) if r in by_name)
    return MemoryEstimate(saved_bytes, max(fw_peak, between + bw_peak), fw_peak,
                          between + bw_peak, tuple(entries), cost)


def _entry(node: fx.Node, nbytes: int) -> SavedTensor:
    v = node.meta.get("val")
    return SavedTensor(node.name, tuple(v.shape), v.dtype, nbytes, user_line(node))


class LiveBytes(TorchDispatchMode):
    """Measures live tensor bytes without any caching allocator in the way.

    Every storage an ATen op creates while the mode is active is counted from
    its creation until Python and C++ drop their last reference to it (a
    ``weakref.finalize`` on the storage object, which PyTorch keeps alive as
    long as the storage). Storages that existed before (parameters, inputs)
    are not counted, matching what :func:`estimate` predicts.
    """

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._known: set[int] = set()
        self._external: set[int] = set()    # storages from before: inputs, parameters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._known:
                self._external.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage):
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr == 0 or ptr in self._known or ptr in self._external:
            return
        self._known.add(ptr)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, ptr, nbytes)

    def _free(self, ptr, nbytes):
        self._known.discard(ptr)
        self.current -= nbytes


def measure_peak(step) -> int:
    """Peak live bytes allocated by ``step()`` (e.g. a forward and its backward)."""
    with LiveBytes() as mode:
        step()
    return mode.peak
