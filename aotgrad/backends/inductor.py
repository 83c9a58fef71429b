"""``"inductor"``: hand one of our forward/backward graphs to Inductor's graph
compiler (``compile_fx_inner``), the layer below its own aot_autograd path.

Inductor is imported only when this backend compiles something: importing it
costs seconds. If Inductor rejects a graph, that graph runs eagerly and a
warning says why; the other graph of the pair is unaffected.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..partition.graphs import distinct_examples
from ..runtime.modes import autocast_off
from ..scoped import FX_TRACING
from .graph_info import info_of


def _is_backward(gm: fx.GraphModule) -> bool:
    return info_of(gm).kind == "backward"


def _decompose(gm: fx.GraphModule, example_inputs: list, fake_mode) -> fx.GraphModule:
    """Retrace with Inductor's decomposition table: its lowerings assume it ran."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from .._torch import inductor_api
    select_decomp_table = inductor_api()[2]

    with FX_TRACING, fake_mode:
        return make_fx(gm, decomposition_table=select_decomp_table(),
                       _allow_non_fake_inputs=True)(*example_inputs)


def _compile(gm: fx.GraphModule, example_inputs: list):
    from .._torch import detect_fake_mode
    fake_mode = detect_fake_mode(example_inputs)
    # A graph handed to this backend directly may give two placeholders one example object.
    example_inputs = distinct_examples(example_inputs)
    if _is_backward(gm):
        return _lazy_backward(gm, example_inputs, fake_mode)
    compiled = _compile_inner(gm, example_inputs, fake_mode)

    def run(*args):
        return tuple(compiled(list(args)))
    return run


_OPAQUE = torch.library.Library("aotgrad", "FRAGMENT")
_opaque_ops: dict = {}


def _opaque(op):
    """``aotgrad::eager_<op>(Tensor[] after, ...)``: ``op`` itself as an operator Inductor only calls
    (its fallback path) and never lowers or fuses, ordered after the tensors ``after`` (the previous
    draw: Inductor schedules independent calls in any order, eager draws in program order); None
    for an op with an aliasing schema."""
    if op in _opaque_ops:
        return _opaque_ops[op]
    schema = op._schema
    made = None
    if not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
        name = "eager_" + "_".join(p for p in (op.namespace, schema.name.split("::")[-1], op._overloadname)
                                   if p).replace(".", "_")
        text = str(schema)[str(schema).index("(") + 1:]
        _OPAQUE.define(f"{name}(Tensor[] after{', ' if not text.startswith(')') else ''}{text}")

        def run(after, *args, **kwargs):
            return op(*args, **kwargs)
        _OPAQUE.impl(name, run, "CompositeExplicitAutograd")
        torch.library.register_fake(f"aotgrad::{name}", run, lib=_OPAQUE)
        made = getattr(torch.ops.aotgrad, name).default
    _opaque_ops[op] = made
    return made


def _random_ops_opaque(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose random ops (``nondeterministic_seeded``) run as eager runs them, in
    eager's order: neither decomposed (``native_dropout`` into ``rand_like``, which draws other
    numbers on CUDA) nor lowered by Inductor (whose fused kernels have read an in-place
    ``bernoulli_`` buffer before its fallback filled it), each after the one before it."""
    import operator

    from ..analysis.ops import is_random
    from ..passes.cleanup import copy_module
    if not any(is_random(n) for n in gm.graph.nodes):
        return gm
    gm = copy_module(gm)
    prev = None
    for n in list(gm.graph.nodes):
        if not is_random(n) or (op := _opaque(n.target)) is None:
            continue
        n.target, n.args = op, ([] if prev is None else [prev], *n.args)
        prev = n
        if isinstance(n.meta.get("val"), (tuple, list)):
            with gm.graph.inserting_after(n):
                prev = gm.graph.call_function(operator.getitem, (n, 0))
                prev.meta["val"] = n.meta["val"][0]
    gm.recompile()
    return gm


def _compile_inner(gm: fx.GraphModule, example_inputs: list, fake_mode):
    from .._torch import TracingContext, inductor_api, tracing
    config, compile_fx_inner, _ = inductor_api()
    # fallback_random: random ops draw from the eager RNG with eager's kernels, so random values
    # match eager's for the same seed (Inductor's own RNG would not); it also selects the
    # decomposition table that keeps random ops whole, so the retrace runs under it too.
    # layout_optimization off: it would give saved tensors (channels-last)
    # strides other than those the backward graph was traced with.
    # autocast off: the graph holds the casts its trace chose; a compile that happens under the
    # caller's autocast (jit, an outer autocast) must not cast the retrace again.
    with tracing(TracingContext(fake_mode)), config.patch(fallback_random=True, layout_optimization=False), \
            autocast_off():
        decomposed = _decompose(_random_ops_opaque(gm), example_inputs, fake_mode)
        return compile_fx_inner(decomposed, list(example_inputs), is_backward=_is_backward(gm))


def _lazy_backward(gm: fx.GraphModule, example_inputs: list, fake_mode):
    """The backward, compiled when it first runs for the layouts its inputs really have.

    Inductor's forward chooses the layouts of what it returns (padding, a dense copy of an
    ``expand``), and the backward's generated code asserts the sizes and strides it was compiled
    for: so its saved inputs are described by what the forward gave this first call (as PyTorch's
    own AOT autograd compiles the backward lazily). The forward gives the same layouts for the same
    input layouts, which the guards pin; one that still differs is a typed error, never a crash in
    generated code. Inductor's convention is one boxed list it clears as it frees inputs: a backward
    is handed its list directly (``_boxed_call``) so saved activations die early."""
    compiled = None

    def run_boxed(args):
        nonlocal compiled
        if compiled is None:
            try:
                compiled = _compile_inner(gm, _as_laid_out(example_inputs, args, fake_mode), fake_mode)
            except Exception as e:  # noqa: BLE001 - as in ``inductor``: this graph runs eagerly
                warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because "
                              f"Inductor failed on it: {type(e).__name__}: {e}", stacklevel=2)
                compiled = lambda args: gm.forward(*args)   # noqa: E731
        try:
            return tuple(compiled(args))
        except AssertionError as e:
            if "stride" not in str(e) and "size" not in str(e):
                raise
            from ..errors import UnsupportedError
            raise UnsupportedError(f"the Inductor-compiled backward got a saved tensor or gradient with another "
                                   f"layout than on its first call ({e}); compile with fw_compiler='eager' for "
                                   "this program") from e
    run_boxed._boxed_call = True
    return run_boxed


def _as_laid_out(examples: list, args: list, fake_mode) -> list:
    """``examples`` with the strides and storage offsets of the real ``args`` where those differ
    (static sizes only: a symbolic layout is what the graph was traced for)."""
    import torch

    out = []
    for ex, a in zip(examples, args):
        if isinstance(ex, torch.Tensor) and isinstance(a, torch.Tensor) and tuple(ex.shape) == tuple(a.shape) \
                and all(type(v) is int for v in (*ex.stride(), ex.storage_offset())) \
                and (ex.stride() != a.stride() or ex.storage_offset() != a.storage_offset()):
            with fake_mode:
                flat = torch.empty(a.storage_offset() + _extent(a), dtype=ex.dtype, device=ex.device)
                ex = flat.as_strided(a.shape, a.stride(), a.storage_offset())
        out.append(ex)
    return out


def _extent(t) -> int:
    """Elements from ``t``'s storage offset to one past its last element."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


def inductor(gm: fx.GraphModule, example_inputs: list):
    """Compile ``gm`` with Inductor; fall back to running it eagerly on failure."""
    if any(n.op == "call_function" and getattr(n.target, "namespace", None) == "aotgrad" for n in gm.graph.nodes):
        # aotgrad::rng_state/set_rng_state order RNG effects that Inductor drops or reorders.
        warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because it saves and "
                      "restores the RNG state (torch.random.fork_rng inside the function)", stacklevel=2)
        return gm.forward
    try:
        return _compile(gm, example_inputs)
    except Exception as e:  # noqa: BLE001 - any Inductor failure means "run this graph eagerly"
        warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because "
                      f"Inductor failed on it: {type(e).__name__}: {e}", stacklevel=2)
        return gm.forward
