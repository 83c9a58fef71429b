"""Input guards of one captured graph, generated as one Python function.

Checked on every call: dtype, device, rank, sizes, strides and storage offset
(exact where static; symbolic ones bind the shape environment's symbols and
its guards and value ranges must hold) and requires_grad. Non-tensor values
baked into the graph are checked by the call path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from .._torch import (PythonPrinter, TensorGuards, backed_symbols, int_oo, set_torch_function_state, tensors_check,
                      torch_function_state)
from ..runtime.codegen import compile_source
from .. import _native



@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    device: torch.device
    size: tuple            # ints, or sympy expressions of the shape environment's symbols
    requires_grad: bool
    layout: tuple = ()     # strides then storage offset, the same way
    filled: bool = False   # its storage must hold its elements (the function resizes it after reading it)


def _expr(s):
    return s.node.expr if isinstance(s, torch.SymInt) else int(s)


def _layout_sources(i, ndim):
    return [f"flat[{i}].stride({d})" for d in range(ndim)] + [f"flat[{i}].storage_offset()"]


def tensor_spec(fake: torch.Tensor, real: torch.Tensor) -> TensorSpec:
    return TensorSpec(real.dtype, real.device, tuple(map(_expr, fake.shape)), real.requires_grad,
                      tuple(map(_expr, (*fake.stride(), fake.storage_offset()))))


def shape_conditions(shape_env) -> list:
    """The shape environment's guards and value ranges as sympy booleans."""
    conds = [g.expr for g in shape_env.guards]
    backed = backed_symbols(shape_env)
    for sym, vr in shape_env.var_to_range.items():
        if sym not in backed:
            continue            # unbacked symbols are outputs, not inputs
        if _finite(vr.lower):
            conds.append(sympy.Ge(sym, int(vr.lower)))
        if _finite(vr.upper):
            conds.append(sympy.Le(sym, int(vr.upper)))
    for sym, rep in shape_env.replacements.items():
        if sym in backed and rep != sym:
            conds.append(sympy.Eq(sym, rep))
    return conds


@dataclass(frozen=True)
class InputGuards:
    specs: tuple            # TensorSpec per flat tensor
    descs: tuple            # descriptor per flat tensor (``ir.descriptors``)
    conditions: tuple       # sympy booleans over symbols
    source: str             # generated checker, for reading
    check: object           # (flat) -> None, or a failing index / condition text
    bind: object            # (flat) -> {symbol name: int}
    numbers: tuple = ()     # (index, symbol) of number inputs that are symbols

    @property
    def bound(self) -> set:
        """The names of the symbols ``bind`` gives values to."""
        return {str(v) for spec in self.specs if spec is not None for v in (*spec.size, *spec.layout)
                if isinstance(v, sympy.Symbol)} | {str(sym) for _, sym in self.numbers}

    def explain(self, flat, failed) -> str:
        if isinstance(failed, str):
            return f"inputs violate the shape assumption {failed} made while tracing (sizes {self.bind(flat)})"
        spec, t, name = self.specs[failed], flat[failed], self.descs[failed]
        if not isinstance(t, torch.Tensor):
            return f"{name} was a tensor when captured, now {type(t).__name__}"
        for what, was, now in (("dtype", spec.dtype, t.dtype), ("device", spec.device, t.device),
                               ("rank", len(spec.size), t.dim()), ("requires_grad", spec.requires_grad, t.requires_grad)):
            if was != now:
                return f"{name}: {what} was {was} when captured, now {now}"
        for d, (was, now) in enumerate(zip(spec.size, t.shape)):
            if isinstance(was, int) and was != now:
                return f"{name}: size({d}) was {was} when captured, now {now}"
        if spec.filled and t.untyped_storage().nbytes() < t.numel() * t.element_size():
            return (f"{name}: its storage held its values when captured, now {t.untyped_storage().nbytes()} bytes "
                    "(freed): the graph reads them")
        if all(isinstance(s, int) for s in spec.size):
            return (f"{name}: strides {t.stride()} and storage offset {t.storage_offset()} differ from the "
                    f"captured layout {spec.layout[:-1]} and offset {spec.layout[-1]}")
        return f"{name}: sizes {tuple(t.shape)} or layout do not fit the captured shape {spec.size}"


def build(specs, descs, conditions, numbers=()) -> InputGuards:
    """The guards of inputs ``specs`` (None for a number input); ``numbers`` pairs the index of a
    number input whose value is a symbol (a Dynamo graph's SymInt) with that symbol, which ``bind``
    then reads from the input itself (its own frontend guards it)."""
    slow, bind_src, used = _source("check_all", specs, conditions, numbers)
    env = {"torch": torch, "math": math}        # a symbolic size's guard may print as math.ceil / math.floor
    k, fast, offsets_checked = _static_prefix(specs, descs)
    src = slow
    if k:
        rest, _, _ = _source("check_rest", [None] * k + list(specs[k:]), conditions)
        offsets = "".join(f" and flat[{i}].storage_offset() == {specs[i].layout[-1]}" for i in range(k)
                          if not descs[i].is_state() and not offsets_checked)
        check = (f"def check(flat):\n    if len(flat) == {len(specs)} and fast(flat){offsets}:\n"
                 "        return check_rest(flat)\n    return check_all(flat)\n\n" + rest)
        src = check + "\n\n" + slow
        env["fast"] = fast
        exec(compile_source(check + "\n\n" + bind_src, "input guards"), env)
        env["check_all"] = _compiled_on_first_call(slow, env)
    else:
        exec(compile_source(slow + "\n\n" + bind_src, "input guards"), env)
        env["check"] = env["check_all"]
    return InputGuards(tuple(specs), tuple(descs), tuple(used), src + "\n\n" + bind_src, env["check"], env["bind"],
                       tuple(numbers))


def _compiled_on_first_call(src: str, env: dict):
    """``check_all``, the check that says which input failed, compiled when the fast check first
    fails: its source has a few lines per input (a tenth of a deep model's capture to compile)."""
    def check_all(flat):
        exec(compile_source(src, "input guards"), env)      # replaces this stub in env
        return env["check_all"](flat)
    return check_all


def _static_prefix(specs, descs):
    """``(k, checker, offsets)``: the first ``k`` tensors (parameters and buffers come first) have static
    sizes and strides, and one native call ``checker(flat)`` checks their Python type, dispatch keys,
    dtype, device, requires_grad, sizes and strides (aotgrad's own C++ loop, else a guard manager's
    ``TENSOR_MATCH`` leaves, else ``TensorGuards``: PyTorch primitives), and their storage offsets too
    where ``offsets``; ``check_all`` still says which failed. Storage offsets of parameters and buffers
    are not checked: a module's own state does not move within its storage between calls, and the
    graph reads values, not offsets."""
    k = 0
    while k < len(specs) and specs[k] is not None and not specs[k].filled and \
            all(isinstance(v, int) for v in (*specs[k].size, *specs[k].layout)):
        k += 1
    if k == 0:
        return 0, None, False
    exemplars = [_exemplar(s, d.is_param()) for s, d in zip(specs[:k], descs[:k])]
    sizes, strides = [list(s.size) for s in specs[:k]], [list(s.layout[:-1]) for s in specs[:k]]
    if _native.TensorCheck is not None:
        offsets = [None if d.is_state() else s.layout[-1] for s, d in zip(specs[:k], descs[:k])]
        return k, _native.TensorCheck(exemplars, sizes, strides, offsets).check, True
    check = tensors_check(exemplars, sizes, strides) if _MANAGER else None
    if check is None:
        try:
            guards = TensorGuards(*exemplars, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        except Exception:   # a layout this torch's checker cannot express: the Python check does it all
            return 0, None, False
        check = lambda flat: len(flat) >= k and guards.check(*flat[:k])     # noqa: E731
    return k, _no_raise(check), False


def _no_raise(check):
    """PyTorch's checks raise on a tensor without strides (a nested one) in a strided one's place: a
    mismatch, which the whole check then names. A guard manager's check failing on one leaves
    ``__torch_function__`` disabled for the whole thread (a subclass's override, fx's tracing of a
    ``torch.ops`` call, silently off after it): the state is put back."""
    def fast(flat):
        state = torch_function_state()
        try:
            if check(flat):
                return True
        except RuntimeError:
            pass
        if torch_function_state() != state:
            set_torch_function_state(state)
        return False
    return fast


_MANAGER = True     # False: ``TensorGuards`` (what a torch without ``tensors_check``'s manager runs; tests)


def _exemplar(spec: TensorSpec, is_param: bool) -> torch.Tensor:
    """An empty tensor of the type, dtype, device and requires_grad the checker compares against
    (it compares the Python type exactly: a module's parameters are ``nn.Parameter``)."""
    t = torch.empty(0, dtype=spec.dtype, device=spec.device)
    return torch.nn.Parameter(t, requires_grad=spec.requires_grad) if is_param else t.requires_grad_(spec.requires_grad)


def _source(name: str, specs, conditions, numbers=()):
    """``def name(flat)`` checking ``specs`` and the shape conditions over their symbols, and
    ``def bind(flat)``; with the conditions it checks."""
    lines, bound, later = [f"def {name}(flat):"], {}, []
    bind_lines = ["def bind(flat):", "    return {"]
    for i, spec in enumerate(specs):
        if spec is None:
            continue            # a number input (a Dynamo graph's SymInt): its own frontend guards it
        lines += [f"    t = flat[{i}]",
                  f"    if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor) or t.dtype is not "
                  f"{_dtype(spec.dtype)} or t.requires_grad is not {spec.requires_grad} or "
                  f"t.device != torch.device({str(spec.device)!r}) or t.dim() != {len(spec.size)}: return {i}"]
        exact = [f"t.shape[{d}] != {s}" for d, s in enumerate(spec.size) if isinstance(s, int)]
        for d, s in enumerate(spec.size):
            if isinstance(s, sympy.Symbol) and s not in bound:
                bound[s] = f"flat[{i}].shape[{d}]"
                bind_lines.append(f"        {str(s)!r}: flat[{i}].shape[{d}],")
            elif not isinstance(s, int) and s.free_symbols <= bound.keys():
                exact.append(f"t.shape[{d}] != ({PythonPrinter().doprint(_subst(s, bound))})")
            elif not isinstance(s, int):    # of a symbol a later input binds (``1 + s1``, s1 its size)
                later.append((i, d, s))
        if spec.filled:
            exact.append("t.untyped_storage().nbytes() < (t.storage_offset() + 1 + sum((n - 1) * s for n, s in "
                         "zip(t.shape, t.stride()))) * t.element_size()")
        if exact:
            lines.append(f"    if {' or '.join(exact)}: return {i}")
    for i, spec in enumerate(specs):     # symbols seen only in strides or offsets (views of a base)
        if spec is None:
            continue
        for s, src in zip(spec.layout, _layout_sources(i, len(spec.size))):
            if isinstance(s, sympy.Symbol) and s not in bound:
                bound[s] = src
                bind_lines.append(f"        {str(s)!r}: {src},")
    for i, d, s in later:       # every input's type and rank checked by now (a number input's symbol: its frontend's)
        if s.free_symbols <= bound.keys():
            lines.append(f"    if flat[{i}].shape[{d}] != ({PythonPrinter().doprint(_subst(s, bound))}): return {i}")
    for i, spec in enumerate(specs):
        if spec is not None:
            lines += _layout_checks(i, spec, bound)
    conditions = [c for c in conditions if c.free_symbols <= set(bound)]
    for c in conditions:
        text = PythonPrinter().doprint(_subst(c, bound))
        lines.append(f"    if not ({text}): return {str(c)!r}")
    lines.append("    return None")
    for i, sym in numbers:
        if sym not in bound:
            bound[sym] = f"flat[{i}]"
            bind_lines.append(f"        {str(sym)!r}: int(flat[{i}]),")
    bind_lines.append("    }")
    return "\n".join(lines), "\n".join(bind_lines) + "\n", conditions


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype)       # "torch.float32": the dtype object itself, by name


def _layout_checks(i: int, spec: TensorSpec, bound: dict) -> list:
    """Strides and storage offset are part of what a graph assumed: the trace may have decided on
    them (``contiguous()`` returning its input, ``reshape`` viewing or copying) and outputs that
    view an input are regenerated with them. Static ones are compared as one tuple."""
    if not spec.layout:
        return []
    if all(isinstance(s, int) for s in spec.layout):
        return [f"    if flat[{i}].stride() != {tuple(spec.layout[:-1])!r} "
                f"or flat[{i}].storage_offset() != {spec.layout[-1]}: return {i}"]
    checks = [f"{src} != {s}" if isinstance(s, int) else f"{src} != ({PythonPrinter().doprint(_subst(s, bound))})"
              for s, src in zip(spec.layout, _layout_sources(i, len(spec.size)))
              if not (isinstance(s, sympy.Symbol) and bound.get(s) == src)]
    return [f"    if {' or '.join(checks)}: return {i}"] if checks else []


def _finite(v) -> bool:
    return v not in (int_oo, -int_oo, sympy.oo, -sympy.oo)


def _subst(expr, bound):
    return expr.xreplace({s: sympy.Symbol(src, integer=True) for s, src in bound.items()})
