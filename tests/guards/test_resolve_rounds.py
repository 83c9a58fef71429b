"""``guards.resolve.Resolver.resolve`` runs a frame again in a later round only where the paths of its
``self`` or arguments changed since its last round (``_looked``): every other frame would make the
same calls, all no-ops. Each program here is captured (its call's reads and its twins' proofs), and
every resolution the capture made is made again both ways, skipping and not: the reads must be the
same, in the same order, with the same paths (a ContextVar read is no longer listed once per round)."""
import sys
import types

import pytest
import torch

import aotgrad
from aotgrad.guards import resolve
from tests.core import test_twin_reads as twins

LATE = """
import torch
import torch.nn as nn


class Cfg:
    pass


CFG = Cfg()
CFG.k = 2.0
HOLD = [CFG]


def scale(c):           # runs first: its argument gets its path from a frame that runs later
    return c.k


def owner(m):
    return m.cfg.k


class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = nn.Linear(4, 4)
        s.cfg = CFG

    def forward(self, x):
        return self.fc(x) * scale(HOLD[0]) + owner(self)
"""


CACHED = """
import functools
import torch
import torch.nn as nn

K = {"s": 3.0}


@functools.lru_cache
def factor(n):          # a hit runs no body: its frame is added in the first round, resolved in the second
    return K["s"] * n


factor(2)


class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * factor(2)
"""


def _source(name, src):
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(src, f"<{name}>", "exec"), vars(mod))
    return mod


PROGRAMS = {
    "late path": lambda: _source("_resolve_rounds_late", LATE),
    "lru_cache body": lambda: _source("_resolve_rounds_cached", CACHED),
    **{f"scoped {c} {s}": (lambda c=c, s=s: twins._scoped(c, s == "same"))
       for c in twins.CHANNELS for s in ("differ", "same")},
    **{f"own {r}": (lambda r=r: twins._own(twins.OWN[r])) for r in twins.OWN},
    "keyed dict": lambda: twins._keyed("{}"),
}


SPY = """
def spy(self, *args, **kwargs):
    made.append((args, kwargs))
    init(self, *args, **kwargs)
"""


def _key(r):
    return r.source, r.path, r.kind, r.key, type(r.where).__name__


def _distinct(reads):
    """The reads, a ContextVar's listed once (each frame's read of it holds a wrapper of its own)."""
    keys = [_key(r) for r in reads]
    return [r for i, (r, k) in enumerate(zip(reads, keys)) if k[-1] != "_ContextValue" or k not in keys[:i]]


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_a_later_round_skips_only_frames_whose_lookups_are_unchanged(program, monkeypatch):
    made = []
    init = resolve.Resolver.__init__
    # Our own bookkeeping, compiled as aotgrad's generated code is: the recording does not take the
    # spy (it runs inside the trace, for the twins' proofs) for the program's code writing a list.
    ns = {"made": made, "init": init}
    exec(compile(SPY, "<aotgrad test spy>", "exec"), ns)
    spy = ns["spy"]
    monkeypatch.setattr(resolve.Resolver, "__init__", spy)
    mod = PROGRAMS[program]()
    torch.manual_seed(0)
    model, x = mod.Model(), torch.randn(2, 4, requires_grad=True)
    aotgrad.capture(model, x)
    monkeypatch.setattr(resolve.Resolver, "__init__", init)
    assert made
    for args, kwargs in made:
        fast = resolve.Resolver(*args, **kwargs)
        slow = resolve.Resolver(*args, **kwargs)
        slow._looked = lambda f: None       # every frame in every round, as before
        got, want = _distinct(fast.resolve()), _distinct(slow.resolve())
        assert [_key(r) for r in got] == [_key(r) for r in want]
        for a, b in zip(got, want):
            assert a.value is b.value or a.value == b.value, a.source
        assert fast.paths == slow.paths and fast.done == slow.done
