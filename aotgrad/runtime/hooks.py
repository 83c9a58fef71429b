"""Python a traced program leaves for autograd to run later: tensor hooks,
``retain_grad`` and the backwards of custom ``autograd.Function``s.

Traced naively, a hook registered inside the program runs once, at trace time,
and never again. While a program is traced (its inputs are functional
tensors), registration is intercepted instead:

* on an **input** (a parameter, a user tensor) the hook is recorded and
  registered on the real tensor by every call, as eager registers it each call
  (:func:`install_input_hooks`, run by the compiled forward);
* on an **intermediate** the graph gets an ``aotgrad::tensor_hook`` node where
  the backward reaches that tensor's gradient: at run time it calls the hook on
  the real gradient and continues with what the hook returns;
* ``retain_grad()`` on an input is replayed per call; on an intermediate that
  never leaves the program nothing could read its ``.grad``, so it is a no-op;
  on one the program returns, an ``aotgrad::retain_grad`` node of the backward
  sets the whole gradient on the real output the forward returned.

A custom Function's backward is traced through; one that writes in place to a
tensor the caller holds (an input or output of the program, ``ctx.x.zero_()``, or
the gradient ``backward(gradient)`` was given) is refused, since the traced graph
would apply the write at the wrong time or drop it; one that writes a tensor it
holds only inside the program makes a second backward through the call raise
(``Analysis.rewritten``), as the functional graph would read the forward's value.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Callable

import torch

from .._torch import FunctionalTensor, dynamo_saved_values
from .. import errors
from .. import tracing
from ..scoped import Stack
from ..ir.records import HookRecord, InputHook
from ..tracing.patches import FUNCTIONS, TENSOR_DATA, TENSOR_HOOKS

# id -> user hook, read by aotgrad::tensor_hook at run time. A registry, not scoped state: each
# id comes from _ids once, so threads never share an entry (a backward may run on another thread).
HOOKS: dict[int, Callable] = {}
_ids = itertools.count()


_LIB = torch.library.Library("aotgrad", "FRAGMENT")
_LIB.define("tensor_hook(Tensor grad, int hook_id) -> Tensor")


def _tensor_hook(grad: torch.Tensor, hook_id: int) -> torch.Tensor:
    """Run user hook ``hook_id`` on a real gradient; ``None`` keeps the gradient."""
    result = HOOKS[hook_id](grad)
    if result is None or result is grad:
        return grad.clone()
    if result.shape != grad.shape or result.dtype != grad.dtype or result.device != grad.device:
        raise errors.UnsupportedError(
            f"a tensor hook returned a gradient of shape {tuple(result.shape)}, {result.dtype} for one of "
            f"shape {tuple(grad.shape)}, {grad.dtype}; a hook must keep the gradient's shape and dtype")
    shares = result.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    return result.clone() if shares or result._is_view() else result


_LIB.impl("tensor_hook", _tensor_hook, "CompositeExplicitAutograd")
torch.library.register_fake("aotgrad::tensor_hook", lambda grad, hook_id: torch.empty_like(grad), lib=_LIB)


_LIB.define("retain_grad(Tensor grad, int slot) -> Tensor")
# The ctx of each compiled backward running now in this thread (innermost last).
RUNNING = Stack("aotgrad.running_backward")


def _retain_grad(grad: torch.Tensor, slot: int) -> torch.Tensor:
    """Complete ``.grad`` of the real output the running backward's forward returned for ``slot``.
    The output called ``retain_grad()`` after the call (runtime/function.py), so the engine has
    already added the caller's part, ``ctx.outer[slot]``; ``grad`` is the whole gradient."""
    ctx = RUNNING[-1] if RUNNING else None
    out = ctx.retained[slot]() if ctx is not None else None
    if out is not None:
        with warnings.catch_warnings():     # reading a non-leaf's unset .grad warns
            warnings.simplefilter("ignore")
            before = out.grad
        out.grad = grad.detach().clone() if before is None else before + (grad - ctx.outer[slot])
    return grad.clone()


_LIB.impl("retain_grad", _retain_grad, "CompositeExplicitAutograd")
torch.library.register_fake("aotgrad::retain_grad", lambda grad, slot: torch.empty_like(grad), lib=_LIB)


def is_opaque(target) -> bool:
    """Graph targets that call user Python: a graph holding one cannot be stored on disk."""
    return target in (torch.ops.aotgrad.tensor_hook.default, torch.ops.aotgrad.retain_grad.default)


class _TraceHandle:
    """The handle a hook registered during tracing returns."""

    def __init__(self, line):
        self.line = line

    def remove(self):
        raise errors.UnsupportedError("removing a hook inside the compiled function cannot be replayed; "
                                      "register and remove hooks outside it", user_line=errors.caller_line())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class Recorder:
    """What one trace of the program registered."""

    def __init__(self, flat):
        self.inputs = {id(t): i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)}
        self.input_hooks: list[InputHook] = []
        self.retained: list[tuple[torch.Tensor, str | None]] = []
        self.graph_hooks: list[int] = []
        self.retained_outputs: list[tuple[int, int, str | None]] = []     # (output, slot, line)
        self.returned_inputs: list[tuple[int, int]] = []    # (output, input) a custom Function returned as is
        self.rewritten: list[tuple[str | None, bool]] = []  # (line, saved): a custom backward wrote its state
        self.flat, self.outs = flat, ()

    def register(self, original, tensor, hook, method):
        line = errors.caller_line()
        if not tensor.requires_grad:
            return original(tensor, hook)       # eager's own error
        i = self.inputs.get(id(tensor))
        if i is not None:       # (a traced input is never a leaf: the real one is checked when registered)
            self.input_hooks.append(InputHook(i, method, hook, line))
            return _TraceHandle(line)
        if method != "register_hook":
            return original(tensor, hook)       # eager's own error (post-accumulate hooks need a leaf)
        hook_id = next(_ids)
        HOOKS[hook_id] = hook
        self.graph_hooks.append(hook_id)
        original(tensor, lambda g: torch.ops.aotgrad.tensor_hook(g, hook_id))
        return _TraceHandle(line)

    def retain(self, original, tensor):
        line = errors.caller_line()
        if not tensor.requires_grad:
            return original(tensor)             # eager's own error
        i = self.inputs.get(id(tensor))
        if i is not None:
            if not tensor.is_leaf:
                self.input_hooks.append(InputHook(i, "retain_grad", None, line))
        elif tensor.requires_grad and not tensor.is_leaf:
            self.retained.append((tensor, line))

    def record(self) -> HookRecord:
        """What this trace registered, as data (no traced tensor in it)."""
        return HookRecord(tuple(self.input_hooks), tuple(self.graph_hooks), tuple(self.retained_outputs),
                          tuple(self.returned_inputs))

    def applied(self, cls, args, out, line) -> None:
        """A custom Function ran in the program: refuse its backward's in-place writes (:func:`_watch`)."""
        _watch(cls, args, out, line, self)

    def _same_as_input(self, o):
        """The input a custom Function returned unchanged (``return x``, ``x.view_as(x)``) as output ``o``."""
        if not isinstance(o, torch.Tensor) or not custom_view(o):
            return None
        for t in self.flat:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata == o.untyped_storage()._cdata and \
                    (t.shape, t.stride(), t.storage_offset()) == (o.shape, o.stride(), o.storage_offset()):
                return self.inputs[id(t)]
        return None

    def visible(self, t) -> bool:
        """Whether ``t`` shares storage with an input or an output of the program, or with the gradient
        of an output as the joint's backward is given it (the caller's ``backward(gradient)``)."""
        key = t.untyped_storage()._cdata
        return any(isinstance(o, torch.Tensor) and o.untyped_storage()._cdata == key
                   for o in (*self.flat, *self.outs, *tracing.current().tangents))

    def check_outputs(self, outs):
        """A retained intermediate the program returns gets its whole gradient (from inside the
        program and from the caller) at run time: an ``aotgrad::retain_grad`` node sets it on
        the real output, see :func:`retained_outputs`."""
        self.outs = tuple(outs)
        for j, o in enumerate(outs):
            i = self._same_as_input(o)
            if i is not None:
                self.returned_inputs.append((j, i))
        for t, line in self.retained:
            j = next((j for j, o in enumerate(outs) if o is t), None)
            if j is None or any(j == k for k, _, _ in self.retained_outputs):
                continue
            slot = next(_ids)
            self.retained_outputs.append((j, slot, line))
            t.register_hook(lambda g, slot=slot: torch.ops.aotgrad.retain_grad(g, slot))


def _tracing(flat) -> bool:
    return any(isinstance(t, FunctionalTensor) for t in flat)


def observed(flat_fn, records: list):
    """``flat_fn`` that, while traced, intercepts hook registration (see module docstring) and
    appends each trace's :class:`Recorder` to ``records``. Eager calls pass straight through."""
    def run(*flat):
        if tracing.current().hooks is not None or not _tracing(flat):     # an inner one defers to the outer
            return flat_fn(*flat)
        rec = Recorder(flat)
        with TENSOR_HOOKS(), FUNCTIONS(), TENSOR_DATA(), tracing.scope(hooks=rec):
            outs = flat_fn(*flat)
        rec.check_outputs(outs)
        records.append(rec)
        return outs
    run.__name__ = flat_fn.__name__
    if hasattr(flat_fn, "module_state"):
        run.module_state = flat_fn.module_state
    return run


def _watch(cls, args, out, line, rec):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    node = next((o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
    if node is None or not hasattr(node, "register_prehook"):
        return
    given = [a for a in args if isinstance(a, torch.Tensor)]
    versions: list = []
    name = "(traced by Dynamo)" if cls.__name__ == "ApplyTemplate" else cls.__name__

    def before(grad_outputs):
        # Read raw (an unpack runs saved-tensor hooks): a saved output's data shares its version counter.
        saved, kept = dynamo_saved_values(node)
        saved = [*(s.data for s in getattr(node, "_raw_saved_tensors", ()) if s.unpack_hook is None), *saved]
        held = [t for t in (*given, *saved, *kept, *vars(node).values(), *grad_outputs) if isinstance(t, torch.Tensor)]
        versions[:] = [(t, t._version, any(t is s for s in saved)) for t in held]

    def after(grad_inputs, grad_outputs):
        written = [(t, was_saved) for t, v, was_saved in versions if t._version != v]
        for t, _ in written:
            if rec.visible(t):      # a temporary's write is functionalized like any
                raise errors.UnsupportedError(
                    f"the backward of custom autograd.Function {name} writes in place to a tensor the caller "
                    f"holds (shape {tuple(t.shape)}: an input or output of the compiled function, or the gradient "
                    "backward() was given); a compiled backward cannot replay that write when eager does; "
                    "return a new tensor instead, or keep the Function out of the compiled code", user_line=line)
        if any(not any(t is g for g in grad_outputs) for t, _ in written):     # a gradient is fresh each time
            rec.rewritten.append((line, any(was_saved for _, was_saved in written)))
    node.register_prehook(before)
    node.register_hook(after)


def has_opaque_calls(captured) -> bool:
    """Whether ``captured`` calls user hooks or returns an input through a custom Function (then it is
    not stored on disk: the hooks are live objects, and the store does not keep the latter fact)."""
    rec = captured.hooks
    return bool(rec.input_hooks or rec.graph_hooks or rec.retained_outputs or rec.returned_inputs)


def input_hooks(captured) -> tuple:
    """The input hooks the forward of ``captured`` must register on every call."""
    hooks = captured.hooks.input_hooks
    if hooks and captured.is_inference:
        raise errors.UnsupportedError(
            f"{hooks[0].method} on an input inside a function called without grad cannot be replayed by "
            "its compiled inference graph; register it outside the compiled function", user_line=hooks[0].line)
    return hooks


def retained_outputs(captured) -> tuple:
    """``(slot, forward value index)`` of each returned tensor the program called retain_grad on:
    the compiled forward keeps a weak reference to that output for the backward's retain_grad node."""
    rec = captured.hooks
    if not rec.retained_outputs:
        return ()
    outs, n_mut = captured.analysis.outputs, len(captured.analysis.mutated())
    found = []
    for j, slot, line in rec.retained_outputs:
        if outs[j].kind != "plain":
            raise errors.UnsupportedError(
                "retain_grad() inside the compiled function on a returned tensor that aliases an input or "
                "another output; call retain_grad() on it after the call", user_line=line)
        found.append((slot, n_mut + sum(o.kind == "plain" for o in outs[:j])))
    return tuple(found)


def returned_inputs(captured) -> tuple:
    """``(forward value index, input index)`` of each output a custom Function returned as its
    input: the graph computes it (so the custom backward runs), and the compiled forward returns
    the input itself in its place, so it is a view of the input as in eager."""
    outs, n_mut = captured.analysis.outputs, len(captured.analysis.mutated())
    return tuple((n_mut + sum(o.kind == "plain" for o in outs[:j]), i)
                 for j, i in captured.hooks.returned_inputs if outs[j].kind == "plain")


def install_input_hooks(hooks, primals) -> None:
    """What eager does each call: register the recorded hooks on the real inputs."""
    for h in hooks:
        t = primals[h.index]
        if h.hook is None:
            t.retain_grad()
        else:
            getattr(t, h.method)(h.hook)


_VIEW_NODES = frozenset(f"{op}Backward0" for op in (
    "View", "UnsafeView", "AsStrided", "Slice", "Select", "T", "Transpose", "Permute", "Expand", "Unsqueeze",
    "Squeeze", "Alias", "Diagonal", "Unbind", "Split", "SplitWithSizes", "Narrow", "Unfold", "ViewAsReal",
    "ViewAsComplex", "Real", "Imag", "Chunk", "Reshape", "ExpandAs", "ViewAs", "Detach"))


def custom_view(t: torch.Tensor) -> bool:
    """Whether a view's autograd path to its base passes through a custom Function (one that
    returned its input, or a view of it, with its own backward): ``base.as_strided(...)``
    would regenerate the view but skip that backward, so it must come from the graph."""
    node = t.grad_fn
    for _ in range(64):
        if node is None:
            return False
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            # aotgrad's own block calls return fresh tensors: the view's base is their output
            return not getattr(node._forward_cls, "aotgrad_returns_fresh", False)
        if type(node).__name__ not in _VIEW_NODES:
            return False
        node = next((n for n, _ in node.next_functions if n is not None), None)
    return False
