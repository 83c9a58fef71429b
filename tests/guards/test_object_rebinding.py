"""A plain object's attribute found through its class or its own ``__dict__``, and callables C code
calls: each rebinding that changes what the trace read, under ``aotgrad.jit`` (recompiles: eager's
result, the disk cache's entry included) and a staged step (``InputMismatchError``). Each was a stale
graph before (the resolver held the old ``__dict__``, read no absence of an instance attribute that
would shadow a class one, no class of the object, and the cache fingerprinted a ``functools.partial``
by its class)."""
from __future__ import annotations

import functools

import pytest
import torch

import aotgrad
from aotgrad.errors import InputMismatchError


class Cfg:
    scale = 2.0

    def get(self):
        return self.scale


class Sub(Cfg):
    scale = 5.0


def _own():
    c = Cfg()
    c.scale = 3.0
    return c


def _times(a, b):
    return a * b


ATTACKS = {     # name: (make the held object, the change, the function of (x, held))
    "__class__ reassigned, class attribute": (Cfg, lambda c: setattr(c, "__class__", Sub), lambda x, c: x * c.scale),
    "__class__ reassigned, method": (Cfg, lambda c: setattr(c, "__class__", Sub), lambda x, c: x * c.get()),
    "method shadowed on the instance": (Cfg, lambda c: setattr(c, "get", lambda: 9.0), lambda x, c: x * c.get()),
    "class attribute shadowed on the instance": (Cfg, lambda c: setattr(c, "scale", 4.0), lambda x, c: x * c.scale),
    "instance attribute deleted": (_own, lambda c: delattr(c, "scale"), lambda x, c: x * c.scale),
    "__dict__ rebound": (_own, lambda c: setattr(c, "__dict__", {"scale": 6.0}), lambda x, c: x * c.scale),
    "__dict__ rebound by object.__setattr__": (
        _own, lambda c: object.__setattr__(c, "__dict__", {"scale": 7.0}), lambda x, c: x * c.get()),
    "partial replaced, other arguments": (
        lambda: [functools.partial(_times, 2.0)], lambda c: c.__setitem__(0, functools.partial(_times, 3.0)),
        lambda x, c: c[0](x)),
}


@pytest.mark.parametrize("entry", ["jit", "staged"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_rebinding_is_seen(attack, entry):
    make, change, body = ATTACKS[attack]
    held = make()

    def f(x):
        return body(x, held)
    x = torch.randn(3)
    step = aotgrad.jit(f) if entry == "jit" else aotgrad.capture(f, x).compile()
    assert torch.equal(step(x), f(x))
    change(held)
    if entry == "jit":
        assert torch.equal(step(x), f(x)), "a stale graph"
        assert len(step.entries) == 2
    else:
        with pytest.raises(InputMismatchError):
            step(x)


def test_the_first_jit_entry_is_reused_from_the_disk_cache_only_where_the_partial_is_equal():
    """A fresh jit of the same function finds the stored entry of an equal partial, not of another."""
    held = [functools.partial(_times, 2.0)]

    def f(x):
        return held[0](x)
    x = torch.randn(3)
    aotgrad.jit(f)(x)
    held[0] = functools.partial(_times, 2.0)
    again = aotgrad.jit(f)
    assert torch.equal(again(x), f(x)) and again.entries[0].loaded
    held[0] = functools.partial(_times, -1.0)
    other = aotgrad.jit(f)
    assert torch.equal(other(x), f(x)) and not other.entries[0].loaded


class _Shifted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("shift", None)
        self.register_parameter("gain", None)

    def forward(self, x):
        y = self.fc(x)
        y = y if self.shift is None else y + self.shift
        return y if self.gain is None else y * self.gain


class _Twins(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Shifted() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


SLOTS = {     # an empty parameter or buffer slot, filled after the capture: the same length, no input
    "bias": lambda m: setattr(m.layers[0].fc, "bias", torch.nn.Parameter(torch.full((4,), 0.5))),
    "buffer": lambda m: setattr(m.layers[0], "shift", torch.full((4,), 0.5)),
    "parameter": lambda m: setattr(m.layers[0], "gain", torch.nn.Parameter(torch.full((4,), 2.0))),
    "one twin's buffer": lambda m: setattr(m.layers[1], "shift", torch.ones(4)),
}


@pytest.mark.parametrize("entry", ["jit", "staged"])
@pytest.mark.parametrize("slot", list(SLOTS))
def test_an_empty_slot_filled_is_seen(slot, entry):
    """``nn.Linear(bias=False)`` then ``m.bias = Parameter(...)``, ``register_buffer(name, None)`` then
    a tensor: the old graph ignored the new tensor (a wrong output, no gradient for it)."""
    torch.manual_seed(0)
    m, x = _Twins(), torch.randn(2, 4)
    step = aotgrad.jit(m) if entry == "jit" else aotgrad.capture(m, x).compile()
    assert torch.equal(step(x), m(x))
    SLOTS[slot](m)
    if entry == "staged":
        with pytest.raises(InputMismatchError, match="was None when captured"):
            step(x)
        return
    out, want = step(x), m(x)
    assert torch.equal(out, want), "a stale graph"
    grads = torch.autograd.grad(out.sum(), list(m.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(want.sum(), list(m.parameters()))))
    m.layers[0].fc.bias = m.layers[0].shift = m.layers[0].gain = m.layers[1].shift = None
    assert torch.equal(step(x), m(x)) and len(step.entries) == 2      # emptied again: the first entry
