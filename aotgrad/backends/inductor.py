"""``"inductor"``: hand one of our forward/backward graphs to Inductor's graph
compiler (``compile_fx_inner``), the layer below its own aot_autograd path.

Inductor is imported only when this backend compiles something: importing it
costs seconds. If Inductor rejects a graph, that graph runs eagerly and a
warning says why; the other graph of the pair is unaffected.
"""
from __future__ import annotations

import keyword
import operator
import re
import warnings

import torch
import torch.fx as fx

from .._torch import OpOverload
from ..ir.ops import aliases_input, mutated_args
from ..ir.records import reach
from ..partition.default import distinct_examples
from ..passes.cleanup import copy_module
from ..runtime import regions
from ..runtime.modes import autocast_off
from ..scoped import FX_TRACING
from .graph_info import info_of


def _is_backward(gm: fx.GraphModule) -> bool:
    return info_of(gm).kind == "backward"


def _decompose(gm: fx.GraphModule, example_inputs: list, fake_mode) -> fx.GraphModule:
    """Retrace with Inductor's decomposition table (its lowerings assume it ran), each output laid
    out as ``gm`` lays it out (:func:`_eager_layouts`)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from .._torch import inductor_api
    select_decomp_table = inductor_api()[2]
    want = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in gm.graph.output_node().args[0]]

    def laid_out(*args):
        return _eager_layouts(_Relaid(gm).run(*args), want)
    with FX_TRACING, fake_mode:
        return make_fx(laid_out, decomposition_table=select_decomp_table(),
                       _allow_non_fake_inputs=True)(*example_inputs)


class _Relaid(fx.Interpreter):
    """Runs a graph through decompositions with each fresh value laid out as the graph traced it:
    a decomposition may lay a value out otherwise than its ATen kernel (a transposed result where
    the kernel's was dense), and a ``view`` traced on the kernel's layout then cannot view it
    (HF GPT-2's attention under ``torch.compile``). Such a value is copied into the traced layout,
    which Inductor fuses into the kernel computing it; nothing else changes."""

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and isinstance(n.target, OpOverload) and not aliases_input(n) \
                and not mutated_args(n.target):
            return _laid_out(out, n.meta.get("val"))
        return out


def _eager_layouts(outs, want) -> tuple:
    """``outs`` (a graph's outputs traced through decompositions), each fresh one laid out as ``want``
    (its fake value before decomposition, which is eager's layout) says.

    Inductor gives an output the strides of its fake value in the graph it compiles, and a
    decomposition can change them (``cat`` with an empty operand: eager keeps the other operand's
    layout, the decomposition is contiguous). Such an output becomes ``copy(empty, value)`` with
    ``empty`` laid out as eager's (``empty_strided`` for static strides, ``empty_permuted`` in eager's
    dimension order for symbolic ones), which Inductor fuses into the kernel computing it. A value
    output twice is laid out once (one tensor, as in eager; a saved output stays the saved tensor).
    Views (laid out as their base) are left."""
    done = {}       # by id: ``outs`` holds every value alive
    for o, w in zip(outs, want):
        if id(o) not in done:
            done[id(o)] = _laid_out(o, w)
    return tuple(done[id(o)] for o in outs)


def _laid_out(o, w):
    if not (isinstance(o, torch.Tensor) and isinstance(w, torch.Tensor)) or w._is_view() or o.dim() != w.dim():
        return o
    if all(type(v) is int for v in (*w.shape, *w.stride(), *o.stride())):
        if o.stride() == w.stride() or w.numel() <= 1:
            return o
        empty = torch.empty_strided(o.shape, w.stride(), dtype=o.dtype, device=o.device)
    else:
        want, got = _order(w), _order(o)
        if want is None or got is None or want == got:
            return o
        empty = torch.empty_permuted(o.shape, want, dtype=o.dtype, device=o.device)
    return torch.ops.aten.copy.default(empty, o)


def _order(t):
    """``t``'s dimensions from outermost to innermost by their strides' hints, or None when ``t`` is
    not dense (a permuted dense layout is then not its layout) or a hint is missing."""
    hints = [s.node.hint if isinstance(s, torch.SymInt) else s for s in (*t.shape, *t.stride())]
    if any(h is None for h in hints):
        return None
    shape, stride = hints[:t.dim()], hints[t.dim():]
    order = sorted(range(t.dim()), key=lambda d: -stride[d])
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order


def _fake_mode_of(gm: fx.GraphModule, example_inputs: list):
    """The examples' fake mode; for a graph without tensor inputs (``torch.randn(3)`` alone) the
    one its traced values hold, else a fresh one (no mode would send it back to eager)."""
    from .._torch import FakeTensorMode, detect_fake_mode
    vals = [n.meta.get("val") for n in gm.graph.nodes]
    return detect_fake_mode(example_inputs) or next(
        (v.fake_mode for v in vals if hasattr(v, "fake_mode")), None) or FakeTensorMode()


def _compile(gm: fx.GraphModule, example_inputs: list):
    fake_mode = _fake_mode_of(gm, example_inputs)
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
        # An argument named by a Python keyword (``uniform``'s ``from``) is renamed ``from_``: fx cannot
        # normalize a call to it, and Inductor normalizes every fallback's call.
        text = re.sub(rf" ({'|'.join(keyword.kwlist)})(?=[=,)])", r" \1_", str(schema)[str(schema).index("(") + 1:])
        _OPAQUE.define(f"{name}(Tensor[] after{', ' if not text.startswith(')') else ''}{text}")

        def run(after, *args, **kwargs):
            return op(*args, **{k[:-1] if keyword.iskeyword(k[:-1]) else k: v for k, v in kwargs.items()})
        _OPAQUE.impl(name, run, "CompositeExplicitAutograd")
        torch.library.register_fake(f"aotgrad::{name}", run, lib=_OPAQUE)
        made = getattr(torch.ops.aotgrad, name).default
    _opaque_ops[op] = made
    return made


def _random_ops_opaque(gm: fx.GraphModule) -> tuple:
    """``(graph, extra)``: a copy of ``gm`` whose random ops (``nondeterministic_seeded``) run as
    eager runs them, in eager's order: neither decomposed (``native_dropout`` into ``rand_like``,
    which draws other numbers on CUDA) nor lowered by Inductor (whose fused kernels have read an
    in-place ``bernoulli_`` buffer before its fallback filled it), each after the one before it.
    A draw nothing reads (``F.dropout(x)`` discarded) still advances eager's stream, but Inductor
    drops what no output needs: the last draw is one more output (``extra`` 1), which the caller
    drops, and every draw before it is an argument of the next."""
    from ..ir.ops import is_random
    if not any(is_random(n) for n in gm.graph.nodes):
        return gm, 0
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
    if prev is None:
        return gm, 0
    out = gm.graph.output_node()
    out.args = ((*out.args[0], prev),)
    gm.recompile()
    return gm, 1


_OFFSET_ARG = {torch.ops.aten.as_strided.default: 3, torch.ops.aten.as_strided_.default: 3,
               torch.ops.aten.as_strided_scatter.default: 4}


def _relative_offsets(gm: fx.GraphModule, example_inputs: list) -> tuple:
    """``(graph, watched)``: ``gm`` with each ``as_strided`` storage offset made relative to the graph
    input it reaches, and ``{input index: storage offset}`` of those inputs.

    In ATen an ``as_strided`` offset counts from the start of the *storage*: on an input that starts
    3 elements into its storage, ``x.as_strided((2,), (3,), 1)`` reads storage elements 1 and 4. Inductor
    indexes an input from its first element, so it would read ``x``'s elements 1 and 4. Each node is
    given its input's storage offset through views (and ``as_strided_scatter``, whose ATen result keeps
    its input's layout), and subtracts it. The compiled graph holds for those offsets only (Dynamo
    does not guard storage offsets): :func:`_compile_inner` checks them per call. An offset before the
    input's first element, or a symbolic one, cannot be said to Inductor: ``NotImplementedError`` (the
    graph then runs eagerly)."""
    origin, edits, watched = {}, [], {}
    for i, (n, ex) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if isinstance(ex, torch.Tensor):
            origin[n] = (i, ex.storage_offset())
    for n in gm.graph.nodes:
        src = origin.get(n.args[0]) if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) \
            else None
        if src is None or not isinstance(n.target, OpOverload):
            continue
        i, base = src
        k = _OFFSET_ARG.get(n.target)
        off = None if k is None else n.args[k] if len(n.args) > k else n.kwargs.get("storage_offset")
        if off is not None:
            if type(base) is not int or type(off) is not int:
                raise NotImplementedError(f"{n.target} on an input whose storage offset is symbolic")
            if off < base:
                raise NotImplementedError(f"{n.target} at storage offset {off}, before its input's first "
                                          f"element ({base}): Inductor indexes inputs from their first element")
            watched[i] = base
            if base:
                edits.append((n, k, off - base))
        if n.target.is_view or n.target is torch.ops.aten.as_strided_scatter.default:
            origin[n] = src
    if not edits:
        return gm, watched
    new = copy_module(gm)
    by_name = {n.name: n for n in new.graph.nodes}
    for n, k, off in edits:
        m = by_name[n.name]
        if len(m.args) > k:
            m.args = (*m.args[:k], off, *m.args[k + 1:])
        else:
            m.kwargs = {**m.kwargs, "storage_offset": off}
    new.recompile()
    return new, watched


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
    # emulate_precision_casts: a cast to bf16/fp16 inside a fused kernel rounds as eager's does
    # (dropout of x.bfloat16() gave x * 2 unrounded); torch versions without it keep the default.
    exact = {"emulate_precision_casts": True} if hasattr(config, "emulate_precision_casts") else {}
    # No FX graph cache for symbolic sizes: an entry keeps its shape guards as expressions over the
    # symbols' sources, and the symbols of a graph's own fakes have none (``__meta_utils_unknown_tensor1``),
    # so the next lookup of that entry raised NameError and the graph ran without Inductor. Nor for a
    # graph holding a live object (the torch.Generator a program draws from): an entry is keyed by the
    # object's serialized state, and a hit ran the code compiled for another generator (Dynamo never puts
    # one in a graph).
    if hasattr(config, "fx_graph_cache") and (_symbolic(example_inputs) or _holds_objects(gm)):
        exact["fx_graph_cache"] = False
    constant = _fixed_sizes(example_inputs)
    with tracing(TracingContext(fake_mode)), config.patch(fallback_random=True, layout_optimization=False, **exact), \
            autocast_off():
        relative, watched = _relative_offsets(gm, example_inputs)
        opaque, extra = _random_ops_opaque(relative)
        decomposed = _decompose(opaque, example_inputs, fake_mode)
        sizes = _unbound_sizes(example_inputs)
        compiled = compile_fx_inner(_with_size_inputs(decomposed, sizes), [*example_inputs, *(v for *_, v in sizes)],
                                    is_backward=_is_backward(gm))
    if sizes:
        compiled = _passing_sizes(compiled, sizes)
    if extra:
        compiled = _dropping_last(compiled)
    pinned = _fixed_sizes(example_inputs)     # (also those an earlier compile fixed: the forward's)
    if not watched and not pinned:
        return compiled
    if set(pinned) - set(constant):
        warnings.warn("aotgrad inductor backend: compiling made sizes the graph was traced with as symbols "
                      "constants (a decomposition read them as numbers): calls of other sizes run the graph "
                      "without Inductor", stacklevel=3)

    def checked(args):      # another storage offset (the ATen graph's are absolute), a size the compile fixed
        if any(args[i].storage_offset() != off for i, off in watched.items()) or \
                any(getattr(args[i], kind)()[d] != v for i, kind, d, v in pinned):
            return gm.forward(*args)
        return compiled(args)
    return checked


def _static(t: torch.Tensor) -> bool:
    """Whether ``t``'s sizes, strides and storage offset are all plain ints."""
    return all(type(v) is int for v in (*t.shape, *t.stride(), t.storage_offset()))


def _holds_objects(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` holds an object other than a tensor or a module as an attribute (``_opaque_obj0``)."""
    return any(not isinstance(operator.attrgetter(n.target)(gm), (torch.Tensor, torch.nn.Module))
               for n in gm.graph.find_nodes(op="get_attr"))


def _symbolic(examples: list) -> bool:
    return any(isinstance(e, torch.SymInt) or isinstance(e, torch.Tensor) and not _static(e) for e in examples)


def _fixed_sizes(examples: list) -> list:
    """``(input index, "size" or "stride", dim, value)`` of each symbolic size or stride of ``examples``
    that is a constant now. Where compiling made it one, a decomposition that reads a size as a number
    (one of ``F.pad``'s modes) guarded it, the shape environment replaced the symbol by that value (a
    SymInt's expression follows), and the code Inductor generated asserts it. The caller's guards are
    symbolic, built before (the backward's are the forward's): a call of another size runs the ATen
    graph instead (a warning says so), where the compiled code would raise in its size assert."""
    return [(i, kind, d, int(v.node.expr)) for i, ex in enumerate(examples) if isinstance(ex, torch.Tensor)
            for kind, values in (("size", ex.shape), ("stride", ex.stride()))
            for d, v in enumerate(values) if isinstance(v, torch.SymInt) and v.node.expr.is_number]


def _unbound_sizes(examples: list) -> list:
    """``(input index, "size" or "stride", dim, SymInt)`` of each size symbol only inputs with no element
    hold (a literal 0 among their sizes): Inductor reads symbols off the sizes of other tensor inputs alone
    (torch 2.15), and its code then names one it never bound (``x.add_(1)`` on a ``(0, n)`` input, captured
    with ``n`` symbolic, raised NameError at the call). Such a symbol becomes an input of its own."""
    bound, found = set(), {}
    for i, ex in enumerate(examples):
        if isinstance(ex, torch.SymInt):
            bound |= ex.node.expr.free_symbols
        if not isinstance(ex, torch.Tensor):
            continue
        empty = any(type(n) is int and n == 0 for n in ex.shape)
        for kind, values in (("size", ex.shape), ("stride", ex.stride())):
            for d, v in enumerate(values):
                if not isinstance(v, torch.SymInt):
                    continue
                if not empty:
                    bound |= v.node.expr.free_symbols
                elif v.node.expr.is_Symbol:
                    found.setdefault(v.node.expr, (i, kind, d, v))
    return [at for sym, at in found.items() if sym not in bound]


def _with_size_inputs(gm: fx.GraphModule, sizes: list) -> fx.GraphModule:
    """``gm`` with a placeholder after its last for each of ``sizes`` (:func:`_unbound_sizes`)."""
    if not sizes:
        return gm
    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    for i, kind, d, v in sizes:
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"{kind}_{d}_of_input_{i}")
        last.meta["val"] = v
    gm.recompile()
    return gm


def _passing_sizes(compiled, sizes: list):
    """``compiled`` called with the sizes it takes as inputs (:func:`_with_size_inputs`) read off the call's
    tensors, appended to its (boxed) argument list."""
    def run(args):
        args.extend(getattr(args[i], kind)(d) for i, kind, d, _ in sizes)
        return compiled(args)
    return run


def _dropping_last(compiled):
    """``compiled`` without its last output (a draw kept alive, :func:`_random_ops_opaque`)."""
    def run(args):
        return list(compiled(args))[:-1]
    return run


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
    (static layouts only: a symbolic one is what the graph was traced for, and comparing its sizes with
    the call's would guard them, specialising the backward to this call's sizes, which a later call of
    other sizes would then get: a gradient of an empty input of the first call's shape)."""
    out = []
    for ex, a in zip(examples, args):
        if isinstance(ex, torch.Tensor) and isinstance(a, torch.Tensor) and _static(ex) \
                and tuple(ex.shape) == tuple(a.shape) \
                and (ex.stride() != a.stride() or ex.storage_offset() != a.storage_offset()):
            with fake_mode:
                flat = torch.empty(a.storage_offset() + reach(a.shape, a.stride()), dtype=ex.dtype, device=ex.device)
                ex = flat.as_strided(a.shape, a.stride(), a.storage_offset())
        out.append(ex)
    return out


def inductor(gm: fx.GraphModule, example_inputs: list):
    """Compile ``gm`` with Inductor; fall back to running it eagerly on failure."""
    if any(n.op == "call_function" and getattr(n.target, "namespace", None) == "aotgrad"
           and torch.Tag.nondeterministic_seeded not in n.target.tags for n in gm.graph.nodes):
        # aotgrad::rng_state/set_rng_state order RNG effects that Inductor drops or reorders (its
        # random ops, passes.rng_layout's fills, run as the other random ops do).
        warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because it saves and "
                      "restores the RNG state (torch.random.fork_rng inside the function)", stacklevel=2)
        return gm.forward
    found = [r for r in regions.repeated(gm.graph, layouts=True) if not all(map(_is_view, r.nodes))] \
        if regions.ENABLED else ()
    if found and _glue_share(gm.graph, found) <= GLUE_SHARE:
        return _regional(gm, found)
    try:
        return _compile(gm, example_inputs)
    except Exception as e:  # noqa: BLE001 - any Inductor failure means "run this graph eagerly"
        warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because "
                      f"Inductor failed on it: {type(e).__name__}: {e}", stacklevel=2)
        return gm.forward


REGION_LAYOUTS = 8      # layouts one repeated block is compiled for before its other calls run eagerly
GLUE_SHARE = 0.5        # regional compilation only where at most this share of the ops lies outside blocks


def _is_view(n: fx.Node) -> bool:
    return n.target is operator.getitem or getattr(n.target, "is_view", False)


def _glue_share(graph: fx.Graph, found: list) -> float:
    """The share of ``graph``'s ops (views aside) outside the repeated regions, which regional
    compilation runs eagerly: a GPT's embeddings, head and loss are 6-26% of its forward; a whole
    training step's optimizer update, which Inductor fuses best, is 85% of the step."""
    inside = {n for r in found for n in r.nodes}
    ops = [n for n in graph.nodes if n.op == "call_function" and not _is_view(n)]
    return sum(n not in inside for n in ops) / max(len(ops), 1)


def _regional(gm: fx.GraphModule, found: list):
    """Regional compilation: each repeated block of ``gm`` (:mod:`..runtime.regions`) compiled by
    Inductor once and called per copy; what lies between the blocks (embeddings, the head, the
    loss) runs as the eager backend runs it. A block is compiled when first called, for the layouts
    its inputs really have (a backward's saved tensors are laid out as Inductor's forward made
    them), and again for each other layout a copy brings, up to :data:`REGION_LAYOUTS`. Blocks of
    views alone (a backward's transposed weights) are worth no compile: they run inline."""
    from .._torch import lazy_graph_module
    from ..runtime.codegen import python_function
    fake_mode = _fake_mode_of(gm, [])

    def compile_region(r, name):
        sub = lazy_graph_module(gm, r.graph(), type(gm).__name__)
        sub.meta["aotgrad"] = gm.meta.get("aotgrad")
        return _by_layout(sub, distinct_examples([x.meta.get("val") for x in r.inputs]), fake_mode, name)
    return python_function(gm, type(gm).__name__.lower(), boxed=_is_backward(gm), compile_region=compile_region,
                           found=found)


def _by_layout(gm: fx.GraphModule, examples: list, fake_mode, name: str):
    variants: dict = {}

    def run(args):
        key = tuple((a.stride(), a.storage_offset()) if isinstance(a, torch.Tensor) else None for a in args)
        fn = variants.get(key)
        if fn is None:
            fn = variants[key] = _compiled_or_eager(gm, _as_laid_out(examples, args, fake_mode), fake_mode, name) \
                if len(variants) < REGION_LAYOUTS else (lambda args: gm.forward(*args))
        return fn(args)
    run._boxed_call = True
    return run


def _compiled_or_eager(gm: fx.GraphModule, examples: list, fake_mode, name: str):
    try:
        return _compile_inner(gm, examples, fake_mode)
    except Exception as e:  # noqa: BLE001 - as in ``inductor``: this block runs eagerly
        warnings.warn(f"aotgrad inductor backend: running {name} eagerly because Inductor failed on it: "
                      f"{type(e).__name__}: {e}", stacklevel=3)
        return lambda args: gm.forward(*args)
