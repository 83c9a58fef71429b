"""tracing.tree lists a module tree as nn.Module's own walks do, and inputs.flatten's signature
(lifted parameters and buffers, their slots, tied places) from it is the one torch's walks give.

Each tree is a variant that would tell a shortcut apart: a module at two paths (and its subtree),
a tensor at two places, None children and members, an empty container (falsy), non-persistent
buffers, a class with its own ``named_modules`` / ``named_parameters``, one hashing by value.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from aotgrad.inputs import flatten
from aotgrad.tracing import tree


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


class Shared(nn.Module):
    """One block at two paths, and a buffer registered twice."""
    def __init__(self):
        super().__init__()
        block = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
        self.a = block
        self.b = nn.ModuleList([nn.Linear(3, 3), block, nn.ModuleList()])
        self.register_buffer("stat", torch.zeros(3))
        self.b[0].register_buffer("stat_again", self.stat)
        self.register_buffer("temp", torch.ones(2), persistent=False)


class Holes(nn.Module):
    """None in ``_modules``, ``_parameters`` and ``_buffers``."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_module("gone", None)
        self.register_parameter("nothing", None)
        self.register_buffer("empty", None)
        self.inner = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2))))


class OwnModules(nn.Module):
    """A class whose ``named_modules`` hides a child: the capture must see what it says."""
    def __init__(self):
        super().__init__()
        self.seen = nn.Linear(2, 2)
        self.hidden = nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        for name, m in super().named_modules(memo, prefix, remove_duplicate):
            if not name.endswith("hidden"):
                yield name, m


class OwnParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.other = nn.Linear(2, 2)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield from reversed(list(super().named_parameters(prefix, recurse, remove_duplicate)))


class ByValue(nn.Linear):
    """Equal and hashed by shape: ``named_modules``' set takes two of them for one."""
    def __eq__(self, other):
        return isinstance(other, ByValue) and other.weight.shape == self.weight.shape

    def __hash__(self):
        return hash(tuple(self.weight.shape))


class TwoByValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = ByValue(2, 2)
        self.y = ByValue(2, 2)


def _wrapped_own():
    m = nn.Sequential(OwnModules(), nn.Linear(2, 2))
    return m


TREES = {"gpt-like tied": Tied, "shared block and buffer": Shared, "holes": Holes, "own named_modules": OwnModules,
         "own named_modules inside": _wrapped_own, "own named_parameters": OwnParameters,
         "hashed by value": TwoByValue, "leaf": lambda: nn.Linear(2, 2), "nested": lambda: nn.Sequential(Shared(), Tied())}


OWN_WALKS = {"own named_modules", "own named_modules inside", "own named_parameters", "hashed by value"}


@pytest.mark.parametrize("name", TREES)
def test_places_and_members_are_torch_walks(name):
    m = TREES[name]()
    where = tree.places(m)
    if where is not None:
        assert [(p, id(x)) for p, x in where] == [(p, id(x)) for p, x in m.named_modules(remove_duplicate=False)]
    owners = dict(m.named_modules(remove_duplicate=False))
    for store, walk in (("_parameters", m.named_parameters), ("_buffers", m.named_buffers)):
        for dedup in (True, False):
            got = tree.members(m, where, store, remove_duplicate=dedup)
            # a class walking its own way is left to its walks (user code, which the recording watches)
            assert (got is None) == (name in OWN_WALKS)
            got = got if got is not None else tree.own_members(m, store, remove_duplicate=dedup)
            want = list(walk(remove_duplicate=dedup))
            assert [(n, id(t)) for n, t, _, _ in got] == [(n, id(t)) for n, t in want]
            for n, t, owner, attr in got:
                prefix, _, key = n.rpartition(".")
                assert owner is owners[prefix] and attr == key and getattr(owner, store)[attr] is t


def _reference(module):
    """The slots and ties as torch's walks give them (flatten's code before the one walk)."""
    state = []
    owners = dict(module.named_modules(remove_duplicate=False))
    for is_param, items in ((True, module.named_parameters()), (False, module.named_buffers())):
        for n, t in items:
            owner, _, attr = n.rpartition(".")
            state.append((n, t, flatten.Slot(owners.get(owner) or module.get_submodule(owner), attr, is_param)))
    own = {(id(s.module), s.is_param, s.attr) for _, _, s in state}
    first = {id(t): i for i, (_, t, _) in reversed(list(enumerate(state)))}
    ties = []
    for is_param, items in ((True, module.named_parameters(remove_duplicate=False)),
                            (False, module.named_buffers(remove_duplicate=False))):
        for n, t in items:
            owner, _, attr = n.rpartition(".")
            sub = owners.get(owner) or module.get_submodule(owner)
            if (id(sub), is_param, attr) not in own and id(t) in first:
                ties.append((n, flatten.Slot(sub, attr, is_param), first[id(t)]))
    return [(n, id(t), s) for n, t, s in state], ties


@pytest.mark.parametrize("name", TREES)
def test_signature_lifts_what_torch_walks_list(name):
    m = TREES[name]()
    sig, tensors, _ = flatten.signature(m, (torch.zeros(2),), {})
    state, ties = _reference(m)
    assert list(sig.state_names) == [n for n, _, _ in state]
    assert [id(t) for t in tensors[:len(state)]] == [i for _, i, _ in state]
    assert list(sig.slots) == [s for _, _, s in state]
    assert list(sig.ties) == ties
    if name == "gpt-like tied":
        assert [n for n, _, _ in sig.ties] == ["head.weight"]


class _OwnParameter(nn.Parameter):
    """A parameter class of the user's: its methods are user code the recording must see."""


def test_signature_pauses_the_recording_only_over_torch_classes():
    from aotgrad.guards import reads
    seen = []

    def probe(classes):
        with flatten._unwatched(classes):
            seen.append(reads.watching() is None)
    with reads.record():
        probe({torch.Tensor, nn.Parameter})
        probe({torch.Tensor, _OwnParameter})
        probe(set())
    assert seen == [True, False, True]
