"""The size assumptions a capture made, checked before each run of it.

The engine keys a captured backward on its autograd graph's structure and, at
first, on every size in it: the first capture is static, and ``LayoutGuard``
holds it to its tensors' sizes and strides, which the engine does not key on.
A size that changes is lifted from then on as its own symbol, and the engine
captures once more (automatic dynamic). The trace assumed two things about the
lifted sizes: a size that was 0 or 1 keeps that value (broadcasting and
empty-tensor paths were decided on it), and any other size stays >= 2
(``SizeGuard``); every comparison between sizes that it decided keeps its
answer (``DecisionLog`` / ``DecisionGuard``). A run whose sizes break one of
these would compute with the wrong graph: it is recaptured instead
(``runtime.CompiledBackward``), and ``explain()`` names the size.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch

from ..runtime.codegen import compile_source


@dataclass(frozen=True)
class SizeGuard:
    constants: tuple    # (index, value): sizes traced as constants, or symbols seen as 0 or 1
    symbolic: tuple     # indices of symbols seen as >= 2
    what: str = "lifted size"
    # The same checks as one C-level pick each (this runs before every backward).
    _constant_values: tuple = field(default=(), compare=False, repr=False)
    _pick_constants: object = field(default=None, compare=False, repr=False)
    _pick_symbolic: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, lifted: list, what: str = "lifted size") -> "SizeGuard":
        constants, symbolic = [], []
        for i, v in enumerate(lifted):
            hint = v.node.hint if isinstance(v, torch.SymInt) else v
            if isinstance(v, torch.SymInt) and hint >= 2:
                symbolic.append(i)
            elif isinstance(hint, int):
                # 0 and 1 decide broadcasting and empty-tensor paths, which the trace
                # took on the capture's values.
                constants.append((i, hint))
        return cls(tuple(constants), tuple(symbolic), what, tuple(v for _, v in constants),
                   picker([i for i, _ in constants]), picker(symbolic))

    def violation(self, values) -> str | None:
        """Why ``values`` may not use this capture, or ``None``."""
        if (self._pick_constants(values) == self._constant_values
                and min(self._pick_symbolic(values), default=2) >= 2):
            return None
        for i, v in self.constants:
            if values[i] != v:
                return f"{self.what} {i} was {v} when captured (0 and 1 are specialised), now {values[i]}"
        for i in self.symbolic:
            if values[i] < 2:
                return f"{self.what} {i} was symbolic (>= 2) when captured, now {values[i]}"
        return None


@dataclass(frozen=True)
class LayoutGuard:
    """The lifted tensors keep the sizes and strides the trace took as constants.

    The engine's key holds their dtype, device and requires_grad but not their layout.
    A static capture bakes every size and stride in (a saved tensor's strides decide
    whether ``.grad`` is the computed buffer or a copy); a capture with lifted sizes
    makes symbolic only the dims equal to one of them (``varying``), and a tensor with
    such a dim has symbolic strides. Storage offsets are not compared: the graph's ops
    read each input through its own offset, and the offsets a trace uses
    (``copy_slices``, ``as_strided`` backwards) are sizes the engine keys on."""
    layouts: tuple          # (sizes, strides) per tensor, None for what is symbolic
    _fast: object = field(default=None, compare=False, repr=False)    # (*tensors) -> bool, in C++

    @classmethod
    def of(cls, tensors: list, varying=frozenset()) -> "LayoutGuard":
        layouts = tuple(_layout(t, varying) for t in tensors)
        return cls(layouts, _tensor_guards(tensors, layouts))

    def violation(self, tensors) -> str | None:
        """Why ``tensors`` may not use this capture, or ``None``."""
        if self._fast is not None and self._fast(*tensors):
            return None
        for i, (t, want) in enumerate(zip(tensors, self.layouts)):
            have = _layout(t)
            if want is not None and (have is None or not (_fits(have[0], want[0]) and _fits(have[1], want[1]))):
                return f"lifted tensor {i} had (sizes, strides) {want} when captured, now {have}"
        return None


def _layout(t: torch.Tensor, varying=frozenset()):
    """(sizes, strides) with None for a dim in ``varying`` and for the strides of a
    tensor with such a dim; None for a tensor that is not strided."""
    if t.layout != torch.strided or t.is_mkldnn:
        return None
    sizes = tuple(None if d in varying else d for d in t.size())
    return sizes, t.stride() if None not in sizes else (None,) * t.dim()


def _fits(have, want) -> bool:
    return len(have) == len(want) and all(w is None or h == w for h, w in zip(have, want))


def _tensor_guards(tensors, layouts):
    """A C++ tensor check over every tensor (sizes, strides, dtype, device, type, dispatch
    keys) in one call: aotgrad's own (``_tensors.cpp``) where every layout is static,
    else PyTorch's; None where it cannot express one of them.
    A failed fast check is only a cue: ``violation`` then compares layouts alone."""
    if not tensors or any(v is None for v in layouts):
        return None
    sizes, strides = [list(v[0]) for v in layouts], [list(v[1]) for v in layouts]
    from .. import _native      # aotgrad's own loop, where built for this torch: static layouts
    if _native.TensorCheck is not None and all(None not in (*s, *st) for s, st in zip(sizes, strides)):
        check = _native.TensorCheck(list(tensors), sizes, strides, [None] * len(tensors)).check
        return lambda *values: check(values)
    try:
        from .._torch import TensorGuards
        return TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides).check
    except Exception:   # an older checker's signature, a tensor type it rejects
        return None


def picker(indices: list):
    """``values -> tuple(values[i] for i in indices)``, in C."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    if indices:
        return lambda values: (values[indices[0]],)
    return lambda values: ()


class DecisionLog:
    """Every size comparison the trace decided, with the answer it took.

    Guards are not recorded in the shape environment (see capture.py: that makes
    tracing a large backward many times slower); instead each expression the
    environment is asked to evaluate is logged here with its answer, and
    ``DecisionGuard`` re-checks them on each run's values.
    """

    def __init__(self, shape_env):
        self.answers: dict = {}
        evaluate = shape_env.evaluate_expr

        self.paused = False

        def logged(expr, *args, **kwargs):
            answer = evaluate(expr, *args, **kwargs)
            if getattr(expr, "free_symbols", None) and not self.paused:
                self.answers.setdefault(expr, answer)
            return answer

        shape_env.evaluate_expr = logged

    @contextlib.contextmanager
    def pause(self):
        """Not logged: what making the lifted tensors' fakes asks (whether a view's fake
        storage needs growing), which ``TensorSymbols`` settles by their exact layout."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


@dataclass(frozen=True)
class DecisionGuard:
    """The logged decisions as one generated Python function over the lifted values."""
    check: object           # (size, scalar, hook) -> index of the first broken decision, or None
    texts: tuple            # the decisions, printed

    @classmethod
    def of(cls, log: DecisionLog, where: dict, tensors=()) -> "DecisionGuard":
        """``where`` maps each symbol to the Python that reads its run-time value;
        ``tensors`` are the lifted tensors made with symbolic dims (``TensorSymbols``)."""
        from .._torch import PythonPrinter
        printer, lines, texts = PythonPrinter(), [], []
        for ts in tensors:
            ts.lines(printer, where, lines, texts)
        for expr, answer in log.answers.items():
            if not expr.free_symbols <= where.keys():
                continue    # a symbol made inside the trace: decided by the others
            if _implied_by_size_guards(expr):
                continue
            lines.append(f"    if ({printer.doprint(expr)}) != {answer!r}: return {len(texts)}")
            texts.append(f"{expr} was {answer}")
        binds = [f"    {sym} = {read}" for sym, read in where.items()
                 if any(sym.name in line for line in lines)]
        source = "\n".join(["def check(size, scalar, hook, input):", *binds, *lines, "    return None"])
        scope = {"torch": torch, "math": __import__("math")}
        exec(compile_source(source, "compiled_autograd guard"), scope)
        return cls(scope["check"], tuple(texts))

    def violation(self, size, scalar, hook, input) -> str | None:
        broken = self.check(size, scalar, hook, input)
        return None if broken is None else f"size decision {self.texts[broken]} when captured"


@dataclass(frozen=True)
class TensorSymbols:
    """A lifted tensor traced with symbolic dims (a capture after a size changed).

    Each symbol is read from the first place it appears (a size, a stride or the offset),
    for the decisions too; every size and stride must still equal its expression (a
    contiguous tensor's strides are products of its sizes: a run with other strides would
    use a graph traced for that layout), and each symbol keeps its 0, 1 or ``>= 2`` class
    (``_implied_by_size_guards`` relies on it), or the run recaptures."""
    index: int
    sizes: tuple            # sympy expression per dim
    strides: tuple
    hints: tuple            # (symbol, value at capture) for the symbols first read here

    @classmethod
    def of(cls, index: int, fake: torch.Tensor, where: dict) -> "TensorSymbols | None":
        """Records ``fake``'s symbols in ``where``; None when nothing of it is symbolic."""
        import sympy
        n, i = fake.dim(), index
        values = (*fake.size(), *fake.stride(), fake.storage_offset())
        if not any(isinstance(v, torch.SymInt) for v in values):
            return None
        reads = ([f"input[{i}].size({d})" for d in range(n)] + [f"input[{i}].stride({d})" for d in range(n)]
                 + [f"input[{i}].storage_offset()"])
        exprs, hints = [], []
        for v, read in zip(values, reads):
            e = v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(v)
            if e.is_Symbol and e not in where:
                where[e] = read
                hints.append((e, int(v.node.hint)))
            exprs.append(e)
        return cls(index, tuple(exprs[:n]), tuple(exprs[n:2 * n]), tuple(hints))

    def lines(self, printer, where: dict, lines: list, texts: list) -> None:
        if not all(e.free_symbols <= where.keys() for e in (*self.sizes, *self.strides)):
            return      # a symbol the engine does not hand us: the decisions on it settle it
        for sym, hint in self.hints:
            lines.append(f"    if not ({sym} {'>= 2' if hint >= 2 else f'== {hint}'}): return {len(texts)}")
            texts.append(f"{where[sym]} was {'>= 2' if hint >= 2 else hint}")
        for what, exprs in (("size", self.sizes), ("stride", self.strides)):
            want = "".join(printer.doprint(e) + ", " for e in exprs)
            lines.append(f"    if tuple(input[{self.index}].{what}()) != ({want}): return {len(texts)}")
            texts.append(f"lifted tensor {self.index}'s {what}s were ({', '.join(map(str, exprs))})")


def _implied_by_size_guards(expr) -> bool:
    """``s == 1``, ``s >= 0``, ``s > 1``...: one symbol against -1, 0 or 1 (an inequality
    against up to 1). The ``SizeGuard``s already hold every symbol to its captured 0 or 1,
    or to >= 2, which settles these; they are most of the log (checked every run)."""
    if not getattr(expr, "is_Relational", False) or len(expr.free_symbols) != 1:
        return False
    lhs, rhs = expr.lhs, expr.rhs
    if lhs.is_Integer and rhs.is_Symbol:
        lhs, rhs = rhs, lhs
    if not (lhs.is_Symbol and rhs.is_Integer):
        return False
    if type(expr).__name__ in ("Equality", "Unequality"):
        return -1 <= int(rhs) <= 1
    return int(rhs) <= 1

