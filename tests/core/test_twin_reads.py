"""Twins are proven equal by what their traces read (``capture/blocks.Reuse._proven``).

Three structurally identical layers each read one value through one channel (``CHANNELS``) that the
parent sets, around each call, to a value of its own (``differ``), or to one value for all
(``same``). Each program trains through ``aotgrad.jit`` and the staged step and is compared with
eager through ``tests/eager_check.py`` (two calls each): a template stood for a layer whose read differs would give
another output and other gradients. Where the reads are the same for every layer, one template
still stands for all three (reuse is not lost to the proof).
"""
import itertools
import sys
import types

import pytest
import torch

import aotgrad
from aotgrad.partition.blocks import is_call
from tests.eager_check import check

HEADER = """
import contextlib, contextvars, inspect, threading, types, weakref
import torch
import torch.nn as nn


class Body(nn.Module):
    def __init__(s, k=1.0):
        super().__init__()
        s.fc = nn.Linear(4, 4)
        s.scale = k
"""

# channel: (setup, the layer's read, a statement setting it to ``v``, how the old value is read)
CHANNELS = {
    "global dict item": ("G = {'s': 1.0}", "G['s']", "G['s'] = v", "G['s']"),
    "global list item": ("LST = [1.0]", "LST[0]", "LST[0] = v", "LST[0]"),
    "shared object attribute": ("class Cfg: pass\nCFG = Cfg(); CFG.s = 1.0", "CFG.s", "CFG.s = v", "CFG.s"),
    "class attribute": ("", "type(self).s", "Layer.s = v", "Layer.s"),
    "ContextVar": ("V = contextvars.ContextVar('v', default=1.0)", "V.get()", "V.set(v)", "V.get()"),
    "threading.local": ("T = threading.local(); T.s = 1.0", "T.s", "T.s = v", "T.s"),
}

# per-layer attribute reads the attribute watch does not see: (read, per layer values)
OWN = {
    "object.__getattribute__": "object.__getattribute__(self, 'scale')",
    "inspect.getattr_static": "inspect.getattr_static(self, 'scale')",
    "super().__getattribute__": "super().__getattribute__('scale')",
}

_n = itertools.count()


def _module(src):
    name = f"_twin_reads_{next(_n)}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(HEADER + src, f"<{name}>", "exec"), vars(mod))
    return mod


def _stack(each: str) -> str:
    """A model of three ``Layer`` s whose forward runs ``each`` (a statement calling ``layer``) per layer ``i``."""
    body = "".join(f"            {line}\n" for line in each.splitlines())
    return f"""

class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.layers = nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
{body}        return x
"""


def _scoped(channel, same):
    setup, read, put, get = CHANNELS[channel]
    return _module(f"""
{setup}


@contextlib.contextmanager
def scaled(v):
    old = {get}
    {put}
    try:
        yield
    finally:
        v = old
        {put}


class Layer(Body):
    s = 1.0

    def forward(self, x):
        return torch.tanh(self.fc(x)) * {read}


""" + _stack(f"with scaled({'2.0' if same else 'float(i + 2)'}):\n    x = layer(x)"))


def _own(read):
    return _module(f"""
class Layer(Body):
    def forward(self, x):
        return torch.tanh(self.fc(x)) * {read}


class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.layers = nn.ModuleList([Layer(float(i + 1)) for i in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
""")


def _keyed(registry):
    return _module(f"""
REG = {registry}


class Layer(Body):
    def forward(self, x):
        return torch.tanh(self.fc(x)) * REG[self]


class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.layers = nn.ModuleList([Layer() for _ in range(3)])
        for i, layer in enumerate(s.layers):
            REG[layer] = float(i + 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
""")


def _present(which):
    """The parent defines a global name, or a dict entry, for the middle layer alone: the template's
    trace (the first layer) found it absent."""
    read, put, drop = {"global name": ("S if 'S' in globals() else 1.0", "global S; S = 3.0", "del S"),
                       "dict entry": ("G['s'] if 's' in G else 1.0", "G['s'] = 3.0", "del G['s']"),
                       "attribute": ("getattr(CFG, 's', 1.0)", "CFG.s = 3.0", "del CFG.s")}[which]
    return _module(f"""
G = {{}}
CFG = types.SimpleNamespace()


class Layer(Body):
    def forward(self, x):
        return torch.tanh(self.fc(x)) * ({read})
""" + _stack(f"if i == 1:\n    {put}\nx = layer(x)\nif i == 1:\n    {drop}"))


def _make(mod):
    def make():
        torch.manual_seed(0)
        return mod.Model(), (torch.randn(2, 4, requires_grad=True),), {}
    return make


def _jit(fn, args, kwargs, **opts):
    return aotgrad.jit(fn)


def _templates(compiled) -> int:
    return len({n.target for n in compiled.forward_graph.graph.nodes if is_call(n) and n.target.kind == "forward"})


@pytest.mark.parametrize("same", [False, True], ids=["differ", "same"])
@pytest.mark.parametrize("channel", list(CHANNELS))
def test_a_read_through_scope_the_parent_set(channel, same):
    mod = _scoped(channel, same)
    make = _make(mod)
    check(None, make=make, calls=2)
    check(None, make=make, calls=2, compile=_jit)
    if same:
        model, args, _ = make()
        assert _templates(aotgrad.capture(model, *args).compile()) == 1


@pytest.mark.parametrize("read", list(OWN))
def test_a_per_layer_value_read_around_the_attribute_watch(read):
    make = _make(_own(OWN[read]))
    check(None, make=make, calls=2)
    check(None, make=make, calls=2, compile=_jit)


@pytest.mark.parametrize("which", ["global name", "dict entry", "attribute"])
def test_a_name_absent_for_the_template_present_for_a_twin(which):
    """The dict entry: the template's trace read an empty dict (its read's kind: a dict of modules),
    the twin's a filled one (another kind); the proof compared them as the template's kind and
    crashed the capture. The attribute: read reflectively (``getattr``), so the twin's trace reads
    a value the template's never saw (a proof by the template's read places alone would miss it)."""
    make = _make(_present(which))
    check(None, make=make, calls=2)
    check(None, make=make, calls=2, compile=_jit)


@pytest.mark.parametrize("registry", ["{}", "weakref.WeakKeyDictionary()"])
def test_a_registry_keyed_by_the_block(registry):
    make = _make(_keyed(registry))
    check(None, make=make, calls=2)


def test_checkpointed_dropout_inside_each_layer():
    """HF's ``gradient_checkpointing_enable()``: each layer's forward is a non-reentrant checkpoint
    whose body draws dropout; the recomputation redraws eager's mask."""
    mod = _module("""
from torch.utils.checkpoint import checkpoint


class Layer(Body):
    def body(self, x):
        return nn.functional.dropout(self.fc(x), 0.5, True)

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.layers = nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
""")
    check(None, make=_make(mod), calls=2)
    check(None, make=_make(mod), calls=2, compile=_jit)
