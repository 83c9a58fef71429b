"""Symbolic sizes and shape conditions as data: a sympy expression by its structure, never as text to
evaluate (``sympify`` of a string runs Python, so a stored file could run code).

An expression is an int, or a one-key object: ``{"symbol": [name, {assumption: bool}]}``,
``{"rational": [p, q]}``, ``{"number": "oo"}`` (an infinity or truth value by name) or
``{"expr": ["sympy.Add", [args...]]}`` whose class is one of :func:`classes` (sympy's arithmetic,
relations and logic, and torch's size functions: ``FloorDiv``, ``ModularIndexing``...). A size kept
as text (``ir.values``: a stored graph's node values) is accepted only when every name in it is a
symbol or one of those functions (:func:`text_ok`) before anything parses it.
"""
from __future__ import annotations

import functools
import re

import sympy

from ..ir.graphs import Unserializable

TAGS = ("symbol", "rational", "number", "expr")
_SYMPY = ("Add", "Mul", "Pow", "Mod", "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan",
          "GreaterThan", "And", "Or", "Not", "Abs", "floor", "ceiling", "Max", "Min")
_ABSTRACT = frozenset({"Application", "Expr", "LatticeOp", "MinMaxBase"})
_SYMBOL = re.compile(r"^[a-z]{1,4}\d{1,9}$")    # s0, u3, zuf1: what shape environments name
_TOKEN = re.compile(r"\s*(?:\d+|[A-Za-z_][A-Za-z0-9_]*|\*\*|[-+*/(),])")


@functools.cache
def classes() -> dict:
    """``{"sympy.Add": Add, "torch.FloorDiv": FloorDiv, ...}``: the classes an expression may be built of."""
    from .._torch import sympy_functions as fns
    table = {f"sympy.{n}": getattr(sympy, n) for n in _SYMPY}
    table.update({f"torch.{k}": v for k, v in vars(fns).items()
                  if isinstance(v, type) and issubclass(v, sympy.Basic) and k not in _ABSTRACT and v.__name__ == k})
    return table


@functools.cache
def _names() -> dict:
    return {cls: name for name, cls in classes().items()}


@functools.cache
def _constants() -> dict:
    from .._torch import int_oo
    return {"oo": sympy.oo, "-oo": -sympy.oo, "int_oo": int_oo, "-int_oo": -int_oo, "true": sympy.true,
            "false": sympy.false, "nan": sympy.nan, "zoo": sympy.zoo}


def encode(e):
    """``e`` (a sympy expression or an int) as data; raises ``Unserializable`` for anything else."""
    if type(e) is int:
        return e
    if isinstance(e, sympy.Integer):
        return int(e)
    for name, c in _constants().items():
        if e is c or e == c and type(e) is type(c):
            return {"number": name}
    if isinstance(e, sympy.Symbol):
        if not _SYMBOL.match(e.name):
            raise Unserializable(f"a symbol named {e.name!r}")
        assumptions = getattr(e, "_assumptions_orig", None) or e.assumptions0
        return {"symbol": [e.name, {k: bool(v) for k, v in sorted(assumptions.items()) if v is not None}]}
    if isinstance(e, sympy.Rational):
        return {"rational": [int(e.p), int(e.q)]}
    name = _names().get(e.func) if isinstance(e, sympy.Basic) else None
    if name is None:
        raise Unserializable(f"a symbolic expression of class {type(e).__name__} ({e})")
    return {"expr": [name, [encode(a) for a in e.args]]}


def decode(tag: str, x, error):
    """The expression ``encode`` wrote under ``tag``; ``error(sentence)`` for anything else."""
    if tag == "symbol" and isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _SYMBOL.match(x[0]) \
            and isinstance(x[1], dict) and all(k.isalpha() and type(v) is bool for k, v in x[1].items()):
        try:
            return sympy.Symbol(x[0], **x[1])
        except (TypeError, ValueError, AttributeError):
            raise error(f"symbol {x[0]} has assumptions sympy does not know") from None
    if tag == "rational" and isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x) and x[1]:
        return sympy.Rational(*x)
    if tag == "number" and isinstance(x, str) and x in _constants():
        return _constants()[x]
    if tag == "expr" and isinstance(x, list) and len(x) == 2 and x[0] in classes() and isinstance(x[1], list):
        args = [decode_arg(a, error) for a in x[1]]
        try:
            return classes()[x[0]](*args)
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            raise error(f"the expression {x[0]} of {len(args)} arguments cannot be built ({e})") from None
    raise error(f"a symbolic {tag!r} value the format does not define")


def decode_arg(a, error):
    if type(a) is int:
        return a
    if isinstance(a, dict) and len(a) == 1:
        (tag, x), = a.items()
        if tag in TAGS:
            return decode(tag, x, error)
    raise error("a symbolic expression holds something other than numbers, symbols and expressions")


def text_ok(text) -> bool:
    """Whether ``text`` (a size written as sympy text) names only symbols and size functions, and holds
    nothing but numbers, operators and parentheses: safe to hand to ``sympify``."""
    if not isinstance(text, str) or len(text) > 4000:
        return False
    functions = {name.partition(".")[2] for name in classes()}
    pos = 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if m is None:
            return False
        token = m.group().strip()
        if token[0].isalpha() or token[0] == "_":
            if token not in functions and not _SYMBOL.match(token):
                return False
        pos = m.end()
    return True
