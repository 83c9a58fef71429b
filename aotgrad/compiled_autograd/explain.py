"""What a ``compiled_autograd`` block did: its captures, and why each missed the cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import OpOverload
from ..observe import timed
from ..scoped import Stack
from . import opaque
from .runtime import CompiledBackward, make_variant


@dataclass(frozen=True)
class Capture:
    """One captured backward: its graph, its structure, and why it was not a cache hit."""
    graph: fx.GraphModule
    structure: tuple
    reason: str
    seconds: float              # compiling the captured graph
    capture_seconds: float      # the engine's walk, traced (or the tape's replay)

    def count(self, kind: str) -> int:
        """Number of graph nodes of ``kind``: "aten" or "opaque"."""
        if kind == "opaque":
            return sum(self.opaque_calls().values())
        return sum(n.op == "call_function" and isinstance(n.target, OpOverload)
                   for n in self.graph.graph.nodes)

    def opaque_calls(self) -> dict[str, int]:
        """The Python calls the graph makes, by kind (what a compiler cannot see into)."""
        calls: dict[str, int] = {}
        for n in self.graph.graph.nodes:
            if n.op == "call_function" and n.target.__module__ == opaque.__name__:
                kind = n.kwargs.get("hook_type") or n.target.__name__
                calls[kind] = calls.get(kind, 0) + 1
        return calls


class CompiledAutograd:
    """State of one ``with aotgrad.compiled_autograd(...)`` block."""

    def __init__(self, compile_fn):
        self.compile_fn = compile_fn
        self.captures: list[Capture] = []
        self.runs = 0

    def on_capture(self, instance, gm):
        """The engine finished a capture: compile it; returns (runtime_wrapper, compiled_fn)."""
        structure = tuple(instance.structure.steps)
        history: list = []
        with timed(history, "compiled_autograd compile", compiler=getattr(self.compile_fn, "__name__", "?")):
            variant = make_variant(instance, gm, self.compile_fn)
        self.captures.append(Capture(gm, structure, self._miss_reason(structure),
                                     history[0].seconds, instance.capture_seconds))
        return CompiledBackward(variant, instance.tape, self.compile_fn, _Events()), variant.compiled

    def _miss_reason(self, structure) -> str:
        if not self.captures:
            return "first backward in this block (or a structure the engine had not cached)"
        prev = self.captures[-1].structure
        if prev[1:] == structure[1:] and prev[0][:2] == structure[0][:2] and prev[0][2] < structure[0][2]:
            return (f"a size changed since the previous capture: {structure[0][2]} sizes are now lifted "
                    "as symbolic inputs (automatic dynamic)")
        for i, (a, b) in enumerate(zip(prev, structure)):
            if a != b:
                return f"autograd graph differs at step {i}: was {_fmt(a)}, now {_fmt(b)}"
        if len(prev) != len(structure):
            return f"autograd graph has {len(structure)} steps, the previous capture {len(prev)}"
        return "same node sequence; the engine's key differs in edges or non-tensor saved values"

    def explain(self) -> str:
        lines = [f"compiled_autograd: {len(self.captures)} capture(s), {self.runs} run(s)"]
        for i, c in enumerate(self.captures):
            calls = ", ".join(f"{k} x{v}" for k, v in c.opaque_calls().items())
            lines.append(f"  capture {i}: {c.count('aten')} aten ops, {c.count('opaque')} opaque calls "
                         f"({calls}), captured in {c.capture_seconds * 1e3:.0f} ms, compiled in "
                         f"{c.seconds * 1e3:.1f} ms; miss: {c.reason}")
        return "\n".join(lines)


# The block active in this thread: backward runs in the calling thread (the block turns autograd's
# multithreading off), so another thread's block never counts its runs.
ACTIVE = Stack("aotgrad.compiled_autograd")


class _Events:
    """Runs and recaptures, counted by the block active when they happen: the engine's
    cache outlives a block, so a backward captured in one block runs in later ones."""

    def ran(self) -> None:
        if ACTIVE:
            ACTIVE[-1].runs += 1

    def recaptured(self, variant, instance, reason: str, seconds: float) -> None:
        if ACTIVE:
            ACTIVE[-1].captures.append(Capture(variant.graph, tuple(instance.structure.steps),
                                               f"recaptured: {reason}", seconds - instance.capture_seconds,
                                               instance.capture_seconds))


def _fmt(step) -> str:
    return " ".join(str(s) for s in step if not isinstance(s, int) or step[0] == "begin")
