"""A capture's protocol calls, recorded so the capture can be redone without the engine.

The engine caches one backward per autograd-graph structure and never asks for
a second capture of the same structure. When a run's sizes break what the
capture assumed (a size that was 0 or 1, a comparison between sizes; see
``guards.py``), the runtime recaptures by replaying this tape: the same calls,
in the same order, on fresh fake tensors whose sizes are the run's.

Every value the engine passes in is recorded by where it came from: the
lifted inputs, sizes and scalars of ``begin_capture``, a path into an earlier
call's result, a hook/``ctx`` index, or a literal (ints, dtypes, devices,
strings). A value with no such origin (a tensor or size the engine made in C++
between calls) makes the tape incomplete, and such a capture is not replayed.
"""
from __future__ import annotations

import torch

# The engine's calls that shape the graph, in the order it makes them.
RECORDED = frozenset({
    "set_node_origin", "apply_functional", "validate_outputs", "accumulate",
    "call_copy_slices_prologue", "call_copy_slices_epilogue", "proxy_call_backward",
    "accumulate_grad", "tensor_pre_hook", "pre_hook", "post_hook", "post_acc_grad_hook",
    "cpp_tensor_pre_hook", "unpack_hook", "bind_backward_state",
})
_LITERALS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
             torch.memory_format)


class Incomplete(Exception):
    """A value with no recorded origin: this capture cannot be replayed."""


class Tape:
    """Wraps the object the engine drives, recording each call (engine-facing)."""

    def __init__(self, instance):
        self._instance = instance
        instance.tape = self
        self.steps: list[tuple] = []       # (method, encoded args, output paths)
        self.begin: tuple | None = None    # begin_capture's non-lifted arguments
        self.end = None                    # end_capture's encoded outputs
        self.missing: str | None = None    # why the tape is incomplete, if it is
        self._origin: dict[int, tuple] = {}
        self._alive: list = []             # keeps recorded objects' ids unique

    def __getattr__(self, name):
        method = getattr(self._instance, name)
        if name == "begin_capture":
            return self._begin
        if name == "end_capture":
            return self._end
        if name in RECORDED:
            return lambda *args: self._call(name, method, args)
        return method

    def _begin(self, inputs, sizes, scalars, origins, accumulate_grad, check_nans):
        result = self._instance.begin_capture(inputs, sizes, scalars, origins, accumulate_grad, check_nans)
        self.begin = (accumulate_grad, check_nans)
        _, fakes, syms, lifted_scalars = result
        for kind, values in (("input", fakes), ("size", syms), ("scalar", lifted_scalars)):
            for i, v in enumerate(values):
                self._remember(v, (kind, i))
        return result

    def _call(self, name, method, args):
        if self.missing is None:
            recorded = args
            if name == "set_node_origin":
                recorded = args[:2] + (None,)
            elif name == "accumulate_grad" and len(args) == 3:
                # torch <= 2.11 passes (variable, grad, has_post_hooks), the lifted ``.grad``
                # set on the fake variable: record it as torch 2.13's call, which names it.
                recorded = (args[0], args[0].grad, *args[1:])
            try:
                encoded = self._encode(recorded, name)
            except Incomplete as e:
                self.missing = f"{name}: {e}"
        result = method(*args)
        if self.missing is None:
            result = _distinct(result, set())
            paths = []
            self._outputs(result, (), len(self.steps), paths)
            self.steps.append((name, encoded, tuple(paths)))
        return result

    def _end(self, outputs):
        if self.missing is None:
            try:
                self.end = self._encode(outputs, "end_capture")
            except Incomplete as e:
                self.missing = f"end_capture: {e}"
        self._origin.clear()
        self._alive.clear()
        return self._instance.end_capture(outputs)

    # -- origins -------------------------------------------------------------
    def _remember(self, value, origin):
        key = _key(value)
        if key is not None:
            self._origin[key] = origin
            self._alive.append(value)

    def _outputs(self, value, path, step, paths):
        """Every value a call returns now comes from there, even one it was given:
        on replay the call may return a new one in its place (``validate_outputs``
        reduces a gradient whose broadcast the capture did not need)."""
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._outputs(v, path + (i,), step, paths)
        elif _key(value) is not None:
            self._remember(value, ("out", step, path))
            paths.append(path)

    def _encode(self, value, method):
        if isinstance(value, (list, tuple)):
            if type(value) not in (list, tuple, torch.Size):
                raise Incomplete(f"an argument of type {type(value).__name__}")
            return (type(value), tuple(self._encode(v, method) for v in value))
        key = _key(value)
        if key is not None:
            if key in self._origin:
                return ("ref", self._origin[key])
            if isinstance(value, torch.SymInt) and value.node.maybe_as_int() is not None:
                return ("lit", value.node.maybe_as_int())
            raise Incomplete(f"a {type(value).__name__} the engine made between calls")
        if isinstance(value, _LITERALS):
            return ("lit", value)
        if method == "proxy_call_backward" and hasattr(value, "_forward_cls"):
            return ("ctx",)        # the autograd ctx: this run's is the hook at backward_idx
        raise Incomplete(f"an argument of type {type(value).__name__}")


def _distinct(value, seen: set):
    """The same tensor twice in one result (``a + b``'s backward passes one gradient to
    both) becomes two objects, an alias for the second, so each position has its own
    origin: on replay the two may differ."""
    if isinstance(value, (list, tuple)):
        items = [_distinct(v, seen) for v in value]
        if isinstance(value, list):
            value[:] = items
            return value
        return type(value)(items) if type(value) is tuple else value
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            value = torch.ops.aten.alias.default(value)
        seen.add(id(value))
    return value


def _key(value):
    if isinstance(value, torch.Tensor):
        return id(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return id(value.node)
    return None


def replay(tape: Tape, instance, inputs, sizes, scalars, hooks):
    """Drive ``instance`` through ``tape``'s calls with this run's lifted values;
    returns what its ``end_capture`` returns."""
    values: dict[tuple, object] = {}
    _, fakes, syms, lifted = instance.begin_capture(list(inputs), list(sizes), list(scalars),
                                                    [[], [], []], *tape.begin)
    for kind, vs in (("input", fakes), ("size", syms), ("scalar", lifted)):
        values.update(((kind, i), v) for i, v in enumerate(vs))
    try:
        for step, (name, encoded, paths) in enumerate(tape.steps):
            args = _decode(encoded, values)
            if name == "proxy_call_backward":
                args = list(args)
                args[4] = hooks[args[3]]      # (inputs, metadatas, saved, backward_idx, ctx, ...)
            result = getattr(instance, name)(*args)
            for path in paths:
                values[("out", step, path)] = _at(result, path)
    except BaseException:
        instance.close()
        raise
    return instance.end_capture(_decode(tape.end, values))


def _decode(encoded, values):
    tag = encoded[0]
    if tag in (list, tuple, torch.Size):
        items = [_decode(e, values) for e in encoded[1]]
        return items if tag is list else tag(items)
    if tag == "ref":
        return values[encoded[1]]
    if tag == "lit":
        return encoded[1]
    return None   # "ctx": filled in by the caller


def _at(value, path):
    for i in path:
        value = value[i]
    return value
