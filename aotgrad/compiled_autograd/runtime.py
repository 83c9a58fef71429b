"""From a captured backward graph to what the engine runs on every later backward.

The captured graph's placeholders are the engine's lifted values, flat and in
order: tensors, sizes, scalars, then the hooks/ctx objects it uses. The
engine calls ``runtime_wrapper(compiled_fn, inputs, sizes, scalars, hooks,
packed)`` — here a ``CompiledBackward`` holding every capture made for one
autograd-graph structure, each valid for the sizes its guards admit. It picks
the first whose guards pass, recaptures (by replaying the first capture's
``tape``) when none does, switches compiled autograd off (a hook may call
``backward`` itself) and calls the compiled graph.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import compiled_autograd_engine
from .. import backends
from ..errors import InputMismatchError, UnsupportedError, caller_line
from ..observe import timed
from . import opaque, tape
from .guards import DecisionGuard, picker
from .segments import SegmentedBackward

_engine = compiled_autograd_engine


@dataclass
class Variant:
    """One capture: its graph compiled, and the size assumptions it holds under."""
    graph: fx.GraphModule
    compiled: object
    pick: list              # (engine list, index) per placeholder
    guards: list            # (where the values are, SizeGuard or DecisionGuard)

    def __post_init__(self):
        # Runs of placeholders reading one engine list, each picked by one C-level call.
        self._picks = [(kind, picker([i for _, i in run]))
                       for kind, run in itertools.groupby(self.pick, key=operator.itemgetter(0))]

    def violation(self, lifted: dict) -> str | None:
        for where, guard in self.guards:
            if where == "decisions":
                why = guard.violation(lifted["size"], lifted["scalar"], lifted["hook"], lifted["input"])
            elif isinstance(where, str):
                why = guard.violation(lifted[where])
            else:
                why = guard.violation(lifted["hook"][where].symbols)
                why = why and f"aotgrad backward {where}: {why}"
            if why is not None:
                return why
        return None

    def run(self, lifted: dict):
        flat = []
        for kind, pick in self._picks:
            flat.extend(pick(lifted[kind]))
        prior = _engine.set_autograd_compiler(None, False)   # a hook may run a backward itself
        opaque.collect_callbacks()
        try:
            return list(self.compiled(*flat))
        finally:
            opaque.stop_collecting()
            _engine.set_autograd_compiler(*prior)


def make_variant(instance, gm, compile_fn) -> Variant:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if compile_fn is backends.eager:   # runs opaque Python calls itself: one graph
        compiled = compile_fn(gm, [n.meta.get("val") for n in placeholders])
    else:
        compiled = SegmentedBackward(gm, compile_fn)
    decisions = DecisionGuard.of(instance.session.decisions, instance.symbol_reads, instance.tensor_symbols)
    guards = [("size", instance.size_guard), ("scalar", instance.scalar_guard), *instance.ctx_guards,
              ("decisions", decisions)]
    if instance.layout_guard is not None:
        guards.insert(0, ("input", instance.layout_guard))
    return Variant(gm, compiled, [_lifted_position(n.target) for n in placeholders], guards)


# Captures kept per autograd-graph structure: past this, sizes vary too much to compile for.
MAX_VARIANTS = 8


class CompiledBackward:
    """What the engine caches for one autograd-graph structure (its ``runtime_wrapper``)."""

    def __init__(self, first: Variant, recording: tape.Tape, compile_fn, events):
        self.variants = [first]
        self.tape = recording
        self.compile_fn = compile_fn
        self.events = events    # .ran() and .recaptured(variant, reason, seconds)

    def __call__(self, compiled_fn, inputs, sizes, scalars, hooks, packed_inputs):
        if torch.is_grad_enabled():   # a cached structure met again under create_graph=True
            raise UnsupportedError("aotgrad.compiled_autograd cannot run a double backward "
                                   "(create_graph=True); run this backward outside the context",
                                   user_line=caller_line())
        lifted = {"input": inputs, "size": sizes, "scalar": scalars, "hook": hooks}
        reason = None
        for variant in self.variants:
            why = variant.violation(lifted)
            if why is None:
                self.events.ran()
                return variant.run(lifted)
            reason = reason or why
        variant = self._recapture(reason, inputs, sizes, scalars, hooks)
        self.events.ran()
        return variant.run(lifted)

    def _recapture(self, reason, inputs, sizes, scalars, hooks) -> Variant:
        if len(self.variants) >= MAX_VARIANTS:
            raise InputMismatchError(
                f"compiled_autograd: {reason}, and this backward was already captured "
                f"{MAX_VARIANTS} times for other sizes (MAX_VARIANTS); sizes that change this "
                "often belong outside the context, or call aotgrad.compiled_autograd.reset()",
                user_line=caller_line())
        if self.tape.missing is not None:
            raise InputMismatchError(
                f"compiled_autograd: {reason}, and this backward cannot be recaptured "
                f"({self.tape.missing}); call aotgrad.compiled_autograd.reset() before it",
                user_line=caller_line())
        from .capture import CaptureInstance   # capture imports this module's users
        history: list = []
        instance = CaptureInstance(lambda inst, gm: make_variant(inst, gm, self.compile_fn))
        with timed(history, "compiled_autograd recapture", reason=reason):
            variant = tape.replay(self.tape, instance, inputs, sizes, scalars, hooks)
        self.variants.append(variant)
        self.events.recaptured(variant, instance, reason, history[0].seconds)
        return variant


def _lifted_position(placeholder_name: str) -> tuple[str, int]:
    """``"size_12"`` -> ``("size", 12)``: which engine list and index a placeholder reads."""
    kind, index = placeholder_name.rsplit("_", 1)
    return kind, int(index)
