"""Every kind of Python read the tracer can see, at every place user code can make it.

Each case builds a small module program (its own module namespace, so the code is the user's)
whose result divides by one value read in one way (``KINDS``) from one location (``WHERE``),
calls it once, changes what was read, and calls again: ``aotgrad.jit`` must recompile, say why
naming what was read, and return eager's result; a ``capture().compile()`` of the first call must
raise ``InputMismatchError`` naming it. The values are chosen so that a stale graph gives another
number (``0.0`` and ``-0.0`` flip the sign of ``x / v``).
"""
import dis
import inspect
import itertools
import re
import sys
import types

import pytest
import torch

import aotgrad
from aotgrad import errors
from aotgrad.guards import bytecode

# kind: (read expression, where ``{s}`` is the object holding the attributes; the change; the name
# the messages must show)
KINDS = {
    "attribute": ("{s}.k", lambda ns, m: setattr(m, "k", 3.0), "k`"),
    "global": ("G", lambda ns, m: ns.update(G=3.0), "G`"),
    "closure cell": ("CLO()", lambda ns, m: setattr(ns["CLO"].__closure__[0], "cell_contents", 3.0), "`v`"),
    "__code__": ("HELP()", lambda ns, m: setattr(ns["HELP"], "__code__", (lambda: 3.0).__code__), "HELP.__code__`"),
    "class attribute": ("{s}.ck", lambda ns, m: setattr(type(m), "ck", 3.0), "ck`"),
    "dict item": ("TABLE['k']", lambda ns, m: ns["TABLE"].update(k=3.0), "TABLE"),
    "list item": ("LST[0]", lambda ns, m: ns["LST"].__setitem__(0, 3.0), "LST"),
    "module state": ("cfgmod.K", lambda ns, m: setattr(ns["cfgmod"], "K", 3.0), "K`"),
    "float sign": ("{s}.eps", lambda ns, m: setattr(m, "eps", -0.0), "eps`"),
    "globals() item": ("globals()['G']", lambda ns, m: ns.update(G=3.0), "G`"),
    "library module state": ("libmod.K", lambda ns, m: setattr(ns["libmod"], "K", 3.0), "K`"),
    "vars() whole": ("sum(v for v in vars({s}).values() if type(v) is float)",
                     lambda ns, m: setattr(m, "extra", 1.0), "names in"),
}

# location: (forward body, with ``{R}`` the read made from the module's methods)
WHERE = {
    "function": "return x / ({R})",
    "list comprehension": "return [t / ({R}) for t in (x,)][0]",
    "generator expression": "return tuple(t / ({R}) for t in (x,))[0]",
    "lambda": "f = lambda t: t / ({R})\n        return f(x)",
    "nested function": "def f(t):\n            return t / ({R})\n        return f(x)",
    "functools.partial": "return functools.partial(_ph, self)(x)",
    "property": "return x / self.val",
    "__getattr__": "return x / self.o.val",
    "method of another object": "return self.o.scale(x)",
}

SOURCE = '''
import functools
import torch

G = 2.0
TABLE = {{"k": 2.0}}
LST = [2.0]


def _mk():
    v = 2.0

    def clo():
        return v
    return clo


CLO = _mk()


def HELP():
    return 2.0


def _ph(self, t):
    return t / ({R})


class Other:
    def __init__(self, m):
        self.m = m

    def scale(self, t):
        return t / ({RO})

    def __getattr__(self, name):
        if name == "val":
            return {RO}
        raise AttributeError(name)


class M(torch.nn.Module):
    ck = 2.0

    def __init__(self):
        super().__init__()
        self.k, self.eps = 2.0, 0.0
        self.o = Other(self)

    @property
    def val(self):
        return {R}

    def forward(self, x):
        {BODY}
'''

_counter = itertools.count()


def _program(kind, where):
    """A fresh module namespace holding the program and a fresh model."""
    read = KINDS[kind][0]
    body = WHERE[where].format(R=read.format(s="self"))
    src = SOURCE.format(R=read.format(s="self"), RO=read.format(s="self.m"), BODY=body)
    name = f"_read_table_{next(_counter)}"
    mod = types.ModuleType(name)
    cfgmod = types.ModuleType(name + "_cfg")
    # A library's module (its name under the standard library's ``json``): a flag its code assigns.
    libmod = types.ModuleType(f"json.{name}_lib")
    cfgmod.K = libmod.K = 2.0
    sys.modules[name], sys.modules[cfgmod.__name__], sys.modules[libmod.__name__] = mod, cfgmod, libmod
    mod.cfgmod, mod.libmod = cfgmod, libmod
    exec(compile(src, f"<{name}>", "exec"), vars(mod))
    return vars(mod), mod.M()


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "0")


CASES = list(itertools.product(KINDS, WHERE))
# One pass over every kind and every location runs by default; the whole table is slow.
_FAST = {(k, w) for k, w in zip(KINDS, itertools.cycle(WHERE))}


@pytest.mark.parametrize("kind,where", [pytest.param(k, w, marks=() if (k, w) in _FAST else pytest.mark.slow)
                                        for k, w in CASES])
def test_jit_recompiles_and_capture_refuses(kind, where):
    ns, m = _program(kind, where)
    x = torch.tensor([1.0, -2.0, 4.0])
    f = aotgrad.jit(m)
    first = f(x)        # before any eager call: a code object that never ran is traced as it is
    compiled = aotgrad.capture(m, x).compile()
    before = m(x)
    torch.testing.assert_close(first, before)
    torch.testing.assert_close(compiled(x), before)
    KINDS[kind][1](ns, m)
    expected = m(x)
    assert not torch.equal(expected, before), "the change must change eager's result"
    torch.testing.assert_close(f(x), expected)
    name = KINDS[kind][2]
    assert len(f.entries) == 2 and name in f.entries[1].reason, f.entries[1].reason
    assert name in aotgrad.explain(f)
    with pytest.raises(errors.InputMismatchError, match=re.escape(name)):
        compiled(x)


def test_nan_keeps_its_entry_and_signed_zero_does_not():
    ns, m = _program("float sign", "generator expression")
    x = torch.tensor([1.0, -2.0])
    f = aotgrad.jit(m)
    for eps in (float("nan"), float("nan"), 0.0, -0.0, -0.0):
        m.eps = eps
        out = f(x)
        torch.testing.assert_close(out, m(x), equal_nan=True)
    assert len(f.entries) == 3, [e.reason for e in f.entries]


def _spelled_as_313(code, edit):
    """``code``'s instructions with ``edit`` applied: how Python 3.13 spells the same code (on 3.13
    and later, as it is)."""
    ins = list(dis.get_instructions(code))
    return ins if sys.version_info >= (3, 13) else edit(ins)


def test_reads_are_found_in_newer_pythons_instructions():
    """3.13 loads two locals with one ``LOAD_FAST_LOAD_FAST (x, self)`` and puts ``PUSH_NULL`` between
    a called function and its arguments; the scanner read ``x * self.k`` without ``self.k`` and
    ``inspect.getattr_static(self, "k")`` without its callee there (CI runs 3.11: spelled by hand)."""
    def product(self, x):
        return x * self.k

    def static(self):
        return inspect.getattr_static(self, "k")

    def paired(ins):
        i = next(i for i, x in enumerate(ins) if x.opname == "LOAD_FAST" and x.argval == "x")
        return ins[:i] + [ins[i]._replace(opname="LOAD_FAST_LOAD_FAST", argval=("x", "self"))] + ins[i + 2:]

    def null_first(ins):
        i = next(i for i, x in enumerate(ins) if x.opname == "LOAD_FAST" and x.argval == "self")
        return ins[:i] + [ins[i]._replace(opname="PUSH_NULL", argval=None)] + ins[i:]
    for fn, edit in ((product, paired), (static, null_first)):
        found, _ = bytecode._scan(fn.__code__, _spelled_as_313(fn.__code__, edit))
        assert any(c.name == "self" and c.steps == (("attr", "k"),) for c in found), (fn.__name__, found)
