"""Per-operator facts read from operator schemas and tags, not if-chains."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch import OpOverload, known_true, suggest_memory_format


def is_random(node: fx.Node) -> bool:
    """Ops that draw from the RNG (dropout masks, rand, bernoulli). An attention op is tagged
    random because it *can* drop out: with ``dropout_p`` 0 it draws nothing (eager's kernels take
    no generator state then), so it is deterministic like any other op. A call of a repeated
    block's half (``partition.blocks.BlockPart``) draws when its graph does (its ``aotgrad_draws``)."""
    t = node.target
    if node.op != "call_function":
        return False
    if not isinstance(t, OpOverload):
        return getattr(t, "aotgrad_draws", False) is True
    if torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    at = _dropout_p_at(t)
    if at is None:
        return True
    i, default = at
    p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else default)
    return not (type(p) in (int, float) and p == 0)


_DROPOUT_P: dict = {}


def _dropout_p_at(op: OpOverload):
    """``(position, default)`` of an op's ``dropout_p`` argument, or None (cached per op)."""
    if op not in _DROPOUT_P:
        args = op._schema.arguments
        _DROPOUT_P[op] = next(((i, a.default_value) for i, a in enumerate(args) if a.name == "dropout_p"), None)
    return _DROPOUT_P[op]


RNG_META = "aotgrad_rng"   # (device, epoch, index) a random node draws at; see passes.rng_positions
RNG_PHASE = "aotgrad_rng_phase"     # "fw" or "bw", the pass a random node was traced in
RNG_CALL = "aotgrad_rng_call"       # a call of a block's half: ((RNG_META, RNG_PHASE), ...) of its draws, in order


def draws_at_backward(node: fx.Node) -> bool:
    """Random ops that draw from the RNG as it stands when ``backward()`` runs (a custom
    backward's ``rand_like``, a checkpoint recomputing without ``preserve_rng_state``):
    they belong to the backward graph, not the forward."""
    tag = node.meta.get(RNG_META)
    return tag is not None and tag[1] == "bw"


COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def is_collective(node: fx.Node) -> bool:
    """A collective or its wait: every rank must issue it, in the same order as every other rank."""
    return node.op == "call_function" and isinstance(node.target, OpOverload) and node.target.namespace in COLLECTIVES


def has_side_effect(node: fx.Node) -> bool:
    """Nodes that must run even when nothing reads them, in eager's order: random
    ops, ops that return nothing (error checks such as ``_linalg_check_errors``) and collectives
    (a rank whose shard of the result is empty still takes part)."""
    t = node.target
    return is_random(node) or is_collective(node) or (node.op == "call_function" and isinstance(t, OpOverload)
                                                       and not t._schema.returns)


def mutated_args(op: OpOverload) -> list[str]:
    """Names of the arguments an operator writes to (``alias_info.is_write``)."""
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


aten = torch.ops.aten

# Never recomputed by any policy: the backward must reuse their forward result.
EXPENSIVE = frozenset(getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
    "cudnn_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward") if hasattr(aten, name))

MATMULS = EXPENSIVE


def _overloads(*names) -> frozenset:
    """``"bernoulli.p"`` -> ``aten.bernoulli.p``, a bare name -> ``.default``; names this torch lacks are skipped."""
    found = (getattr(getattr(aten, p, None), o or "default", None) for p, _, o in (n.partition(".") for n in names))
    return frozenset(op for op in found if op is not None)


# Ops whose tensor arguments give only a shape, dtype and device, never values: two calls
# from the same RNG state draw the same numbers whatever tensors they were given.
SHAPE_ONLY = _overloads("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                        "randint_like", "randint_like.low_dtype", "bernoulli.p", "new_empty", "new_zeros",
                        "new_ones", "new_full")

# Random ops whose functional form returns a contiguous tensor while eager's in-place form
# (``empty_like(x).bernoulli_(p)`` in dropout) fills its input's own layout, in memory order.
FILLS_CONTIGUOUS = _overloads("bernoulli.p")

def inplace_twin(op) -> OpOverload | None:
    """The in-place op a functionalized random op stands for (``normal_functional`` ->
    ``normal_``, ``uniform`` -> ``uniform_``, ``bernoulli.p`` -> ``bernoulli_.float``): the
    ``<name>_`` overload with the same arguments, which fills ``self`` in ``self``'s own layout."""
    if not isinstance(op, OpOverload) or op.namespace != "aten":
        return None
    packet = getattr(aten, op._schema.name.split("::")[-1].removesuffix("_functional") + "_", None)
    sig = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in packet.overloads() if packet is not None else ():
        twin = getattr(packet, name)
        if [(a.name, str(a.type)) for a in twin._schema.arguments] == sig and len(op._schema.returns) == 1:
            return twin
    return None


# Cheap ops that carry neither the pointwise tag nor an aliasing schema.
CHEAP_EXTRA = frozenset(getattr(aten, name) for name in (
    "_to_copy", "clone", "_unsafe_view", "expand_copy", "view_copy", "permute_copy", "t_copy",
    "transpose_copy", "unsqueeze_copy", "squeeze_copy", "slice_copy", "select_copy",
    "lift_fresh_copy", "full_like", "zeros_like", "ones_like", "empty_like", "scalar_tensor")
    if hasattr(aten, name))

# Ops whose output shares its first argument's storage though the schema says otherwise.
ALIASING_EXTRA = frozenset({aten._unsafe_view})


def packet(node: fx.Node):
    t = node.target
    return t.overloadpacket if isinstance(t, OpOverload) else None


def aliases_input(node: fx.Node) -> bool:
    """Whether the node's output is a view of (shares storage with) its first argument."""
    t = node.target
    if not isinstance(t, OpOverload):
        return False
    return packet(node) in ALIASING_EXTRA or any(r.alias_info is not None for r in t._schema.returns)


_FRESH: dict = {}       # a true cache: an operator's schema never changes


def returns_fresh(op) -> bool:
    """Whether every output of ``op`` is a new tensor (no alias annotation: not a view, not ``out=``)."""
    fresh = _FRESH.get(op)
    if fresh is None:
        fresh = _FRESH[op] = isinstance(op, OpOverload) and bool(op._schema.returns) and all(
            r.alias_info is None for r in op._schema.returns)
    return fresh


def is_cheap(node: fx.Node) -> bool:
    """Pointwise ops, views, reshapes, casts and unpacking a tuple."""
    if node.target is operator.getitem:
        return True
    t = node.target
    if not isinstance(t, OpOverload):
        return False
    return torch.Tag.pointwise in t.tags or aliases_input(node) or packet(node) in CHEAP_EXTRA


def is_expensive(node: fx.Node) -> bool:
    return packet(node) in EXPENSIVE


RUNS_IN_FORWARD = "aotgrad_runs_in_forward"
"""Node meta key: the partitioners run the node in the forward even though no forward output needs
it (a pass's smaller stand-in for a value the backward reads, ``passes.compact_saved``)."""


# Ops whose fake (meta) kernel may lay an output out otherwise than the real kernel does: batch norm
# keeps a transposed 3-d input's layout where its CPU kernel returns a contiguous result, and its
# backward takes the gradient's layout where the CPU kernel follows the input's. The trace lays their
# outputs out as the real kernels do (:func:`laid_out_as_kernel`), so that what is traced after them
# (views, reshapes, the layout an output is returned in) is what eager does.
FAKE_LAYOUT_DIFFERS = frozenset(getattr(torch.ops.aten, name) for name in (
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_batch_norm_backward", "batch_norm_backward",
    "cudnn_batch_norm", "cudnn_batch_norm_backward", "miopen_batch_norm", "miopen_batch_norm_backward")
    if hasattr(torch.ops.aten, name))
# Where a batch norm op takes the input its real kernels lay the result out like (0 otherwise).
_LAYOUT_FROM = {torch.ops.aten.native_batch_norm_backward: 1, torch.ops.aten.batch_norm_backward: 1}


def laid_out_as_kernel(func, args, out, clone):
    """``out`` of a :data:`FAKE_LAYOUT_DIFFERS` op with its first value laid out as the real kernels lay
    it out, ``empty_like(input, input.suggest_memory_format())``, where the fake kernel kept the input's
    layout: ``clone(value, memory_format)`` traces the copy (one copy at run time, only there). With
    symbolic sizes a layout the trace cannot decide without a guard is copied too."""
    values = out if isinstance(out, (tuple, list)) else (out,)
    first, base = values[0], args[_LAYOUT_FROM.get(func._overloadpacket, 0)]
    if not (isinstance(first, torch.Tensor) and isinstance(base, torch.Tensor)):
        return out
    fmt = suggest_memory_format(base)
    if known_true(first.is_contiguous(memory_format=fmt)):
        return out
    laid = clone(first, fmt)
    return type(out)((laid, *values[1:])) if isinstance(out, (tuple, list)) else laid
