"""Capture of one ``.backward()`` into an FX graph of ATen ops.

PyTorch's C++ autograd engine, with a compiler installed, walks the autograd
graph once and calls this object for every step instead of running it:
``begin_capture`` hands over the lifted inputs (saved tensors, root grads,
leaves), sizes and scalars; built-in nodes arrive as ``apply_functional``
(a C++ function of (grads, saved values)), Python ``autograd.Function``s as
``proxy_call_backward``, hooks as ``*_hook``, leaves as ``accumulate_grad``;
``end_capture`` returns what the engine runs from then on, for every backward
whose autograd graph has the same structure.

Built-in nodes are traced through on fake tensors (with constant sizes, or
symbolic ones where the engine lifted a size that changed), so they become ATen ops; everything holding user Python (hooks, custom
backwards, ``.grad`` updates) becomes one opaque call node (``opaque.py``).
"""
from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode, PythonKeyTracer, disable_proxy_modes_tracing,
    fetch_object_proxy, track_tensor_tree)
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic, ShapeEnv, StatelessSymbolicContext)

from .._torch import (FakeTensorMode, TorchDispatchMode, dynamo_source, enable_python_dispatcher, fake_cache_off,
                      suppress_guards)
from ..ir.ops import FAKE_LAYOUT_DIFFERS, laid_out_as_kernel
from ..errors import UnsupportedError, caller_line
from ..observe import events
from . import accumulate, opaque
from .guards import DecisionLog, LayoutGuard, SizeGuard, TensorSymbols


def _mark_used_grads(graph) -> None:
    """Tell each custom backward call which of its gradients the graph reads (see
    ``opaque.call_backward``: a None there is refused, not passed to an ATen op)."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is opaque.call_backward:
            used = {u.args[1] for u in n.users if u.target is operator.getitem}
            n.kwargs = {**n.kwargs, "expected": tuple(sorted(used))}


@dataclass
class Structure:
    """What the engine told us about the autograd graph, in call order (for miss reasons)."""
    steps: list = field(default_factory=list)


class _KernelLayouts(TorchDispatchMode):
    """Above the proxy mode: a batch norm's result laid out as its real kernels lay it out (its fake
    kernel keeps the input's layout), so that the views traced after it hold at run time. A higher
    order operator passes through to the modes below, as it did before this mode was there."""
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "_overloadpacket", None) in FAKE_LAYOUT_DIFFERS:
            out = laid_out_as_kernel(func, args, out, lambda t, fmt: torch.ops.aten.clone.default(
                t, memory_format=fmt))
        return out


class _Session:
    """The fake mode, shape environment and FX tracer of one capture, entered once."""

    def __init__(self):
        # 0 and 1 stay symbols (with hints) so that every lifted size keeps its identity
        # through the engine, for the tape; guards.py still holds the capture to them.
        self.shape_env = ShapeEnv(specialize_zero_one=False)
        self.fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True,
                                        shape_env=self.shape_env)
        self.tracer = PythonKeyTracer()
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, "symbolic")
        self._modes = contextlib.ExitStack()
        self.decisions = DecisionLog(self.shape_env)
        # With symbolic sizes each op of a backward is traced on sizes no other op shares: the
        # fake-tensor dispatch cache never hits and building its entries was a third of capture
        # time. A static capture's repeated layers hit it (begin_capture decides).
        self.fake_mode.cache_enabled = False

    def enter(self):
        self._modes.enter_context(enable_python_dispatcher())
        self._modes.enter_context(self.fake_mode)
        self._modes.enter_context(self.proxy_mode)
        self._modes.enter_context(_KernelLayouts())
        # Sizes are lifted inputs and must not specialise. Recording guards makes the
        # symbolic reasoning several times slower (a GPT block: minutes), so they are
        # not recorded; the decisions they would guard are logged instead (guards.py).
        self._modes.enter_context(suppress_guards(self.shape_env))

    def exit(self):
        self._modes.close()


# The engine binds each C++ node's functional once per process, not once per capture.
FUNCTIONALS: dict[str, tuple] = {}


def _functional(name):
    try:
        return FUNCTIONALS[name]
    except KeyError:
        raise UnsupportedError(f"the autograd engine never bound {name!r} to aotgrad; another compiled "
                               "autograd implementation was used first in this process",
                               user_line=caller_line()) from None


class CaptureInstance:
    """The object the C++ engine drives during one capture (its protocol, our graph)."""

    def __init__(self, on_capture):
        self._on_capture = on_capture   # (CaptureInstance, GraphModule) -> (runtime_wrapper, compiled)
        self.session = _Session()
        self.structure = Structure()
        self.hook_proxies: dict[int, fx.Proxy] = {}
        self.symnode_proxy: dict = {}
        self._engine_node = (None, False)
        self.ctx_guards: list = []    # (backward_idx, SizeGuard) per inlined aotgrad backward
        self.symbol_reads: dict = {}  # sympy symbol -> Python reading its value at run time
        self.tensor_symbols: list = []  # TensorSymbols per lifted tensor with symbolic dims

    # -- protocol: lifecycle ------------------------------------------------
    def begin_capture(self, inputs, sizes, scalars, origins, accumulate_grad, check_nans):
        if torch.is_grad_enabled():   # the engine runs with grad mode = create_graph
            raise UnsupportedError("aotgrad.compiled_autograd cannot capture a double backward "
                                   "(create_graph=True); run this backward outside the context",
                                   user_line=caller_line())
        s = self.session
        self.n_inputs, self.n_sizes, self.n_scalars = len(inputs), len(sizes), len(scalars)
        # The engine lifts only the sizes it has seen change (automatic dynamic, see guards.py):
        # with none, every size is a constant and so are the tensors' (no symbolic reasoning);
        # else a tensor's dim is symbolic where it equals one of them, the rest stay constants.
        varying = frozenset(sizes)
        self.layout_guard = LayoutGuard.of(inputs, varying)
        s.fake_mode.cache_enabled = not sizes   # see _Session
        with s.decisions.pause():
            inputs[:] = [_fake(s.fake_mode, x, varying, idx) for idx, x in enumerate(inputs)]
        symbolic = (TensorSymbols.of(i, x, self.symbol_reads) for i, x in enumerate(inputs)
                    if varying and isinstance(x, torch.Tensor) and x.layout == torch.strided)
        self.tensor_symbols = [t for t in symbolic if t is not None]
        self._bind(inputs, [self._placeholder(f"input_{i}") for i in range(len(inputs))])
        sym_sizes = [s.shape_env.create_unspecified_symint_and_symbol(v, _source("sizes", i), DimDynamic.DYNAMIC)
                     for i, v in enumerate(sizes)]
        self._bind_syms(sym_sizes, "size")
        self._read_symbols(sym_sizes, "size[{}]")
        for i, v in enumerate(scalars):
            src = _source("scalars", i)
            if isinstance(v, int):
                scalars[i] = s.shape_env.create_unspecified_symint_and_symbol(v, src, DimDynamic.DYNAMIC)
            else:
                sym = s.shape_env.create_unspecified_symbol(v, source=src, dynamic_dim=DimDynamic.DYNAMIC)
                scalars[i] = s.shape_env.create_symfloatnode(sym, hint=v, source=src)
        self._bind_syms(scalars, "scalar")
        self._read_symbols(scalars, "scalar[{}]")
        self.size_guard = SizeGuard.of(sym_sizes)
        self.scalar_guard = SizeGuard.of([v if isinstance(v, (int, torch.SymInt)) else None for v in scalars],
                                         "lifted scalar")
        self.structure.steps.append(("begin", len(inputs), len(sizes), len(scalars)))
        s.enter()
        self._last_tagged = next(iter(reversed(s.tracer.graph.nodes)))
        self._started = (time.perf_counter(), events.now_us())
        return "aotgrad_compiled_autograd", inputs, sym_sizes, scalars

    def end_capture(self, outputs):
        self._tag_engine_node()
        self._opaque(opaque.run_final_callbacks)
        self.session.exit()
        tr = self.session.tracer
        tr.create_node("output", "output", (tr.create_arg(self._proxy(outputs)),), {})
        graph = tr.graph
        accumulate.steal_fresh_grads(graph)
        graph.eliminate_dead_code(is_impure_node=_impure)
        _mark_used_grads(graph)
        accumulate.run_early(graph)
        gm = fx.GraphModule(tr.root, graph, "CompiledAutograd")
        self.capture_seconds = time.perf_counter() - self._started[0]
        events.emit("compiled_autograd capture", self._started[1], self.capture_seconds * 1e6,
                    {"nodes": len(graph.nodes), "lifted inputs": self.n_inputs, "lifted sizes": self.n_sizes})
        return self._on_capture(self, gm)

    def close(self):
        self.session.exit()

    def log_compile_reasons(self, reasons):
        self.structure.steps.append(("engine_reasons", tuple(reasons)))

    def set_node_origin(self, node_name, nodecall_index, pyobj):
        """The engine is about to run its next node: tag the graph nodes the last one traced."""
        self.structure.steps.append(("node", node_name))
        self._tag_engine_node()
        self._engine_node = (len(self.structure.steps), node_name == "torch::autograd::AccumulateGrad")

    def _tag_engine_node(self):
        """Mark the nodes traced since the previous call (see ``accumulate.run_early``)."""
        last = next(iter(reversed(self.session.tracer.graph.nodes)))
        node, self._last_tagged = self._last_tagged.next, last
        index, accumulates = self._engine_node
        while index is not None and node.op != "root":
            if node.op != "placeholder":
                node.meta[accumulate.ENGINE_NODE] = index
                if accumulates:
                    node.meta[accumulate.GROUP] = index
            node = node.next

    # -- protocol: built-in nodes, traced through to ATen --------------------
    def bind_function(self, fn_name, fn, is_custom_function, is_traceable):
        FUNCTIONALS[fn_name] = (fn, is_traceable)
        return fn_name

    def apply_functional(self, fn_name, grads, args, output_metadata):
        fn, traceable = _functional(fn_name)
        self.structure.steps.append(("functional", fn_name))
        if not traceable:
            self._unsupported(f"autograd node {fn_name} (a C++ node not marked traceable)")
        try:
            return fn(grads, *args)
        except UnsupportedError:
            raise
        except Exception as e:   # an op without a symbolic-shape kernel, a size it cannot reason about
            self._unsupported(f"autograd node {fn_name} ({type(e).__name__}: {str(e).splitlines()[0]})", e)

    def validate_outputs(self, _, outputs, args, output_metadata):
        fn, _ = _functional("validate_outputs")
        # Off the fake-tensor dispatch cache: a static capture's keys are those of the process-wide
        # cache, which code outside this capture fills, and a view (``sum_to``'s) rebuilt from an
        # entry recorded as requiring grad already has autograd metadata: the engine's view check
        # then fails mid-backward (seen once in CI on torch 2.14.1; what made that entry, not found).
        with fake_cache_off(self.session.fake_mode):
            return fn(outputs, *args)

    def accumulate(self, old_var, new_var):
        return torch.add(old_var, new_var)

    def call_copy_slices_prologue(self, inputs, base_sizes, base_strides, base_storage_offset,
                                  view_sizes, view_strides, view_storage_offset):
        grad = inputs[0]
        result = grad.new_empty_strided(base_sizes, base_strides)
        result.copy_(grad)
        grad_slice = result.as_strided(view_sizes, view_strides, view_storage_offset - base_storage_offset)
        return [result, grad_slice, grad_slice.clone(memory_format=torch.contiguous_format)]

    def call_copy_slices_epilogue(self, needs_input_grad, result, res, grad_slice):
        out = [None] * len(needs_input_grad)
        for i, needed in enumerate(needs_input_grad):
            if needed and res[i] is not None:
                if i == 0:
                    grad_slice.copy_(res[i])
                    out[i] = result
                else:
                    out[i] = res[i]
        return out

    # -- protocol: opaque Python -------------------------------------------
    def proxy_call_backward(self, inputs, output_metadatas, saved_tensors, backward_idx, ctx,
                            maybe_backward_state_idx, opaque_object_indices=()):
        cls = ctx._forward_cls
        self.structure.steps.append(("custom_backward", cls.__qualname__, id(cls)))
        if getattr(cls, "_aotgrad_backward", None) is not None:
            return self._inline_aotgrad_backward(cls._aotgrad_backward, inputs, saved_tensors, ctx, backward_idx)
        proxy = self._opaque(opaque.call_backward, self._hook(backward_idx),
                             self._proxy(list(saved_tensors)), *self._proxy(list(inputs)))
        with disable_proxy_modes_tracing():
            grads = [None if m is None else torch.empty(m[3], dtype=m[2], layout=m[0], device=m[1])
                     for m in output_metadatas]
        self._bind_some(grads, proxy)
        return tuple(grads)

    def _inline_aotgrad_backward(self, info, inputs, saved_tensors, ctx, backward_idx):
        """aotgrad's own backward: its ATen graph is traced into this one, not called.

        The prologue (the saved symbols kept on ``ctx``) is an opaque read of the
        run's ``ctx``, each symbol lifted as a size; the graph and the epilogue
        (placing grads by ``grad_of``) are traced through.
        """
        env = self.session.shape_env
        symbols = [env.create_unspecified_symint_and_symbol(v, _source(f"ctx{backward_idx}.symbols", i),
                                                            DimDynamic.DYNAMIC) if type(v) is int else v
                   for i, v in enumerate(ctx.symbols)]
        guard = SizeGuard.of(symbols, "saved size")
        self._read_symbols(symbols, f"hook[{backward_idx}].symbols[{{}}]")
        self.ctx_guards.append((backward_idx, guard))
        symbols_proxy = self._opaque(opaque.saved_symbols, self._hook(backward_idx))
        for i, sym in enumerate(symbols):
            if isinstance(sym, torch.SymInt):
                proxy = symbols_proxy[i]
                proxy.node.meta["val"] = sym
                self.symnode_proxy[sym.node] = proxy
                track_tensor_tree(sym, proxy, constant=None, tracer=self.session.tracer)
        tangent_phs = info.graph.graph.find_nodes(op="placeholder")[len(saved_tensors) + len(symbols):]
        # None: an output no gradient reached (the Function asks autograd not to make zeros for it)
        tangents = [_zeros_as(p.meta["val"]) if inputs[k] is None else
                    inputs[k] if inputs[k].is_contiguous() else inputs[k].contiguous()
                    for k, p in zip(info.tangent_of, tangent_phs)]
        grads = info.graph(*saved_tensors, *symbols, *tangents)
        full = [None] * info.n_primals
        for i, g in zip(info.grad_of, grads):
            full[i] = g
        return tuple(full)

    def accumulate_grad(self, variable, variable_grad, grad, has_post_hooks=None):
        legacy = has_post_hooks is None
        if legacy:
            # torch 2.11 calls (variable, grad, has_post_hooks) and ignores the result.
            # Its engine lifts the current ``.grad`` all the same (an input, part of the
            # cache key) and sets it on the fake ``variable``: read it from there.
            grad, variable_grad = variable_grad, variable.grad
        self.structure.steps.append(("accumulate_grad",))
        if not accumulate.traceable(variable, variable_grad, grad):
            self._opaque(opaque.accumulate_grad, self._proxy(variable), self._proxy(grad))
        elif variable_grad is not None:
            variable_grad.add_(grad)     # eager: ``.grad += new`` in place (grad mode is off)
        else:
            value = accumulate.trace_first_grad(variable, grad)
            self._opaque(opaque.set_grad, self._proxy(variable), self._proxy(value))
        return None if legacy else variable

    def tensor_pre_hook(self, inputs, hook_id, i):
        inputs[i] = self._call_hook(hook_id, "tensor_pre_hook", inputs[i])
        return inputs

    def pre_hook(self, inputs, hook_id):
        proxy = self._opaque(opaque.call_hook, self._hook(hook_id), self._proxy(list(inputs)),
                             hook_type="pre_hook")
        return self._clones(inputs, proxy)

    def post_hook(self, outputs, inputs, hook_id):
        proxy = self._opaque(opaque.call_hook, self._hook(hook_id), self._proxy(list(outputs)),
                             self._proxy(list(inputs)), hook_type="post_hook")
        return self._clones(outputs, proxy)

    def post_acc_grad_hook(self, input, hook_id):
        return [self._call_hook(hook_id, "post_acc_grad_hook", input)]

    def cpp_tensor_pre_hook(self, inputs, hook_id, i):
        # C++ hooks (``retain_grad``) stay with the engine, which runs them by id.
        self.structure.steps.append(("cpp_tensor_pre_hook",))
        proxy = self._opaque(opaque.call_cpp_tensor_pre_hooks, hook_id, self._proxy(inputs[i]))
        with disable_proxy_modes_tracing():
            inputs[i] = _clone(inputs[i])
        self._bind([inputs[i]], [proxy])
        return inputs

    def unpack_hook(self, hook_id, data_id):
        return self._unsupported("saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, which "
                                 "torch.utils.checkpoint uses: to checkpoint, compile the forward with "
                                 "aotgrad.jit or torch.compile and keep this context for its backward)")

    def bind_backward_state(self, index):
        return self._unsupported("a Dynamo BackwardState")

    # -- helpers ------------------------------------------------------------
    def _read_symbols(self, values, read):
        for i, v in enumerate(values):
            if isinstance(v, (torch.SymInt, torch.SymFloat)) and v.node.expr.is_symbol:
                self.symbol_reads.setdefault(v.node.expr, read.format(i))

    def _unsupported(self, what, cause=None):
        raise UnsupportedError(f"aotgrad.compiled_autograd does not capture {what}; "
                               "run this backward outside the compiled_autograd context",
                               user_line=caller_line()) from cause

    def _call_hook(self, hook_id, hook_type, value):
        self.structure.steps.append((hook_type,))
        proxy = self._opaque(opaque.call_hook, self._hook(hook_id), self._proxy(value), hook_type=hook_type)
        with disable_proxy_modes_tracing():
            out = _clone(value)
        self._bind([out], [proxy])
        return out

    def _clones(self, values, proxy):
        self.structure.steps.append(("node_hook", len(values)))
        with disable_proxy_modes_tracing():
            outs = [_clone(v) for v in values]
        self._bind_some(outs, proxy)
        return outs

    def _placeholder(self, name):
        return self.session.tracer.create_proxy("placeholder", name, (), {})

    def _hook(self, idx):
        if idx not in self.hook_proxies:
            with self.session.tracer.graph.inserting_before(self._first_non_placeholder()):
                self.hook_proxies[idx] = self._placeholder(f"hook_{idx}")
        return self.hook_proxies[idx]

    def _first_non_placeholder(self):
        for n in self.session.tracer.graph.nodes:
            if n.op != "placeholder":
                return n
        return None

    def _opaque(self, fn, *args, **kwargs):
        return self.session.tracer.create_proxy("call_function", fn, args, kwargs)

    def _bind_syms(self, syms, prefix):
        proxies = [self._placeholder(f"{prefix}_{i}") for i in range(len(syms))]
        for sym, p in zip(syms, proxies):
            p.node.meta["val"] = sym
            if isinstance(sym, (torch.SymInt, torch.SymFloat)):
                self.symnode_proxy[sym.node] = p
        self._bind(syms, proxies)

    def _bind(self, objects, proxies):
        for obj, p in zip(objects, proxies):
            if isinstance(obj, torch.Tensor):
                p.node.meta["val"] = obj
        track_tensor_tree(list(objects), list(proxies), constant=None, tracer=self.session.tracer)

    def _bind_some(self, objects, proxy):
        for i, obj in enumerate(objects):
            if obj is not None:
                self._bind([obj], [proxy[i]])

    def _proxy(self, t):
        if t is None:
            return None
        if isinstance(t, (list, tuple)):
            return type(t)(self._proxy(x) for x in t)
        if isinstance(t, (torch.SymInt, torch.SymFloat)):
            return self.symnode_proxy[t.node]
        if not isinstance(t, torch.Tensor):
            return t
        return fetch_object_proxy(self.session.tracer, t).proxy


def _impure(node: fx.Node) -> bool:
    """What dead-code elimination keeps. Unused placeholders go (most lifted sizes are
    never read): the runtime picks only the engine's values the graph reads."""
    if node.op == "placeholder":
        return False
    return node.op == "output" or node.target in opaque.IMPURE or node.is_impure()


def _fake(fake_mode, x, varying, idx):
    """``x`` as a fake tensor whose dims are symbolic where they equal a size in ``varying``
    (a subclass or a sparse tensor: every dim, or none in a static capture)."""
    if not varying or type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided:
        return fake_mode.from_tensor(x, static_shapes=not varying)
    # Each its own symbol (not duck-sized): two dims equal at capture are assumed equal only
    # where the trace compared them, and then DecisionGuard holds them to it.
    dims = [DimDynamic.DYNAMIC if d in varying else DimDynamic.STATIC for d in x.size()]
    return fake_mode.from_tensor(x, source=_source("inputs", idx),
                                 symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def _clone(x):
    return None if x is None else torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)


def _zeros_as(v):
    """The zeros autograd would have made for an output with no gradient (traced: a node of the graph)."""
    return torch.zeros(v.shape, dtype=v.dtype, device=v.device)


def _source(kind, index):
    """Names a lifted value for the shape environment: ``sizes[3]``."""
    source = dynamo_source()
    return source.GetItemSource(source.LocalSource(kind), index)
