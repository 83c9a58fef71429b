"""The per-call state check's shortcuts (issue #61) against the full check: each module's ``__dict__``
by its version tag (covering its ids, values, absent names and which hook and parameter dicts it
holds), held hook and parameter dicts by their contents, one generated expression for it all.

Every kind of state the guards watch is changed in the ways that would fool a version-tag shortcut:
through the API, through ``__dict__``, by ``object.__setattr__``, a dict replaced wholesale (by an
equal one first, then written), mutated then restored, a same-size replacement, a container written in
place while its holder stays untouched, from another thread. After each change: ``aotgrad.jit``
gives eager's result, recompiling exactly where the change is real; a staged step raises
``InputMismatchError`` exactly there; and the fast check agrees with the per-read loop."""
from __future__ import annotations

import collections
import sys
import threading

import pytest
import torch
from torch import nn

import aotgrad
from aotgrad.errors import InputMismatchError

SHIFT = 1.0


def _hook(m, i, o):
    return o * 10


def _pre(m, args):
    return (args[0] + 1,)


class Branch(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x * 3


class Opts:
    """A plain config object (HF's ``PretrainedConfig`` is one): its attributes live in its ``__dict__``."""

    def __init__(self):
        self.gain = 1.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Tanh()
        self.c = Branch()
        self.scale = 2.0
        self.cfg = [1.0, 2.0]
        self.offset = torch.zeros(3)        # a plain tensor attribute: baked, guarded with its version
        self.opts = Opts()

    def forward(self, x):
        return self.c(self.b(self.a(x))) * self.scale * self.opts.gain + self.cfg[0] + SHIFT + self.offset


def _in_thread(fn):
    def run(m):
        t = threading.Thread(target=fn, args=(m,))
        t.start()
        t.join()
    return run


def _set_global(v):
    def run(m):
        globals()["SHIFT"] = v
    return run


def _swap_then_restore_hooks(m):
    m.a._forward_hooks[99] = _hook
    del m.a._forward_hooks[99]


def _new_param(m):
    with torch.no_grad():
        m.a.weight = nn.Parameter(torch.randn(3, 3))


# name: steps, each (change, whether it is real: a recompile under jit, a mismatch for a staged step)
CHANGES = {
    "hook registered": [(lambda m: m.a.register_forward_hook(_hook), True)],
    "hook written into the dict": [(lambda m: m.a._forward_hooks.__setitem__(99, _hook), True)],
    "pre-hook written into the dict": [(lambda m: m.b._forward_pre_hooks.__setitem__(5, _pre), True)],
    "hook dict replaced by setattr": [
        (lambda m: setattr(m.a, "_forward_hooks", collections.OrderedDict([(0, _hook)])), True)],
    "hook dict replaced through __dict__": [
        (lambda m: m.a.__dict__.__setitem__("_forward_hooks", collections.OrderedDict([(0, _hook)])), True)],
    "hook dict replaced by object.__setattr__": [
        (lambda m: object.__setattr__(m.c, "_forward_pre_hooks", collections.OrderedDict([(0, _pre)])), True)],
    "hook dict replaced by an equal one, then written": [
        (lambda m: setattr(m.a, "_forward_hooks", collections.OrderedDict()), False),
        (lambda m: m.a._forward_hooks.__setitem__(3, _hook), True)],
    "hook written then removed, then written": [
        (_swap_then_restore_hooks, False), (lambda m: m.a._forward_hooks.__setitem__(4, _hook), True)],
    "hook written from another thread": [(_in_thread(lambda m: m.a._forward_hooks.__setitem__(7, _hook)), True)],
    "parameter replaced, same shape": [(_new_param, False)],
    "parameter written into the dict": [
        (lambda m: m.a._parameters.__setitem__("bias", nn.Parameter(torch.randn(3))), False)],
    "parameter dict replaced by an equal one, then written": [
        (lambda m: setattr(m.a, "_parameters", dict(m.a._parameters)), False),
        (lambda m: m.a._parameters.__setitem__("bias", None), True)],
    "parameter dict replaced, same size, a parameter missing": [
        (lambda m: setattr(m.a, "_parameters", {"weight": m.a.weight, "bias": None}), True)],
    "module type swapped": [(lambda m: setattr(m.b, "__class__", nn.Sigmoid), True)],
    "training by train()": [(lambda m: m.train(False), True)],
    "training through __dict__": [(lambda m: m.c.__dict__.__setitem__("training", False), True)],
    "training as an int": [(lambda m: setattr(m.c, "training", 1), True)],
    "training set to what it was": [(lambda m: setattr(m.c, "training", True), False)],
    "training flipped and back": [(lambda m: (m.c.train(False), m.c.train(True)), False),
                                  (lambda m: m.c.train(False), True)],
    "attribute equal, another object": [(lambda m: setattr(m, "scale", float("2.0")), False),
                                        (lambda m: setattr(m, "scale", 3.0), True)],
    "attribute as an int": [(lambda m: setattr(m, "scale", 2), True)],
    "attribute through __dict__": [(lambda m: m.__dict__.__setitem__("scale", -1.0), True)],
    "attribute from another thread": [(_in_thread(lambda m: setattr(m, "scale", 4.0)), True)],
    "attribute added (was absent)": [(lambda m: setattr(m.a, "forward", lambda x: x), True)],
    "attribute added and deleted": [(lambda m: (setattr(m.a, "forward", lambda x: x), delattr(m.a, "forward")),
                                     False)],
    "list written in place, its holder untouched": [(lambda m: m.cfg.__setitem__(0, 7.0), True)],
    "list replaced, same size": [(lambda m: setattr(m, "cfg", [7.0, 2.0]), True)],
    "list replaced by an equal one, then written": [(lambda m: setattr(m, "cfg", [1.0, 2.0]), False),
                                                    (lambda m: m.cfg.__setitem__(0, 5.0), True)],
    "tensor attribute written in place, its holder untouched": [(lambda m: m.offset.add_(1), True)],
    "tensor attribute written and written back": [(lambda m: (m.offset.add_(1), m.offset.sub_(1)), True)],
    "tensor attribute replaced by an equal one": [(lambda m: setattr(m, "offset", torch.zeros(3)), True)],
    "child replaced": [(lambda m: setattr(m, "b", nn.ReLU()), True)],
    "child replaced through _modules": [(lambda m: m._modules.__setitem__("b", nn.Sigmoid()), True)],
    "children dict replaced by an equal one, then written": [
        (lambda m: setattr(m, "_modules", dict(m._modules)), False),
        (lambda m: m._modules.__setitem__("b", nn.Sigmoid()), True)],
    "children dict written then restored": [(lambda m: m._modules.__setitem__("c", m._modules.pop("c")), False)],
    "children reordered in place": [(lambda m: m._modules.__setitem__("a", m._modules.pop("a")), True)],
    "global changed": [(_set_global(2.0), True)],
    "global changed and restored": [(lambda m: (_set_global(5.0)(m), _set_global(1.0)(m)), False)],
    "global hook registered": [(lambda m: _global_hook(), True)],
    # A module's whole __dict__ rebound: every attribute at once, no dict written (a new graph even when equal)
    "module __dict__ rebound, a new weight": [
        (lambda m: _rebind(m.a, _parameters={**m.a._parameters, "weight": nn.Parameter(torch.ones(3, 3))}), True)],
    "module __dict__ rebound, a hook": [
        (lambda m: _rebind(m.a, _forward_hooks=collections.OrderedDict([(0, _hook)])), True)],
    "module __dict__ rebound, training": [(lambda m: _rebind(m.c, training=False), True)],
    "root __dict__ rebound, an attribute": [(lambda m: _rebind(m, scale=5.0), True)],
    "module __dict__ rebound by object.__setattr__": [
        (lambda m: object.__setattr__(m.b, "__dict__", {**vars(m.b), "_forward_hooks": collections.OrderedDict([(0, _hook)])}),
         True)],
    "module __dict__ rebound to an equal one, then written": [
        (lambda m: _rebind(m.c), True), (lambda m: m.c.__dict__.__setitem__("training", False), True)],
    "module __dict__ rebound from another thread": [(_in_thread(lambda m: _rebind(m, scale=6.0)), True)],
    # A plain object's: the same, without a version tag of the module kind (held by identity)
    "config attribute changed": [(lambda m: setattr(m.opts, "gain", 3.0), True)],
    "config __dict__ rebound": [(lambda m: setattr(m.opts, "__dict__", {"gain": 3.0}), True)],
    "config __dict__ rebound to an equal one, then written": [
        (lambda m: setattr(m.opts, "__dict__", dict(vars(m.opts))), True),
        (lambda m: vars(m.opts).__setitem__("gain", 4.0), True)],
    "config __dict__ rebound by object.__setattr__": [
        (lambda m: object.__setattr__(m.opts, "__dict__", {"gain": -1.0}), True)],
    "config __dict__ rebound from another thread": [
        (_in_thread(lambda m: setattr(m.opts, "__dict__", {"gain": 2.5})), True)],
}


def _rebind(module, **entries):
    module.__dict__ = {**vars(module), **entries}


_HANDLES = []


def _global_hook():
    _HANDLES.append(nn.modules.module.register_module_forward_hook(lambda m, i, o: o + 1 if m.__class__ is nn.Tanh else o))


@pytest.fixture(autouse=True)
def _restore():
    yield
    globals()["SHIFT"] = 1.0
    while _HANDLES:
        _HANDLES.pop().remove()


def _has_c():
    from aotgrad.guards.tags import StateCheck
    return StateCheck is not None


def _agree(guards):
    """The fast check and the per-read loop say the same."""
    fast = guards.check()
    slow = guards.check.__self__._slow()
    assert (fast is None) == (slow is None), (fast, slow)


def _calls(step, model, x, n):
    for _ in range(n):
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("warm", [1, 6], ids=["python tags", "C tags"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_jit_recompiles_exactly_where_the_full_check_fails(change, warm):
    """``warm`` calls before the change: after a few, the tags, types and empty dicts are one C loop."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    _calls(step, model, x, warm)
    first = step.entries[0].state
    assert (first.check.__self__.cpp is not None) == (warm > 3 and _has_c())
    expected = 1
    for do, real in CHANGES[change]:
        do(model)
        _agree(first)
        expected += real
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
        assert len(step.entries) == expected, [e.reason for e in step.entries]
        _agree(first)
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)      # a second call: the refreshed check
        assert len(step.entries) == expected


@pytest.mark.parametrize("warm", [0, 1, 6], ids=["first call", "python tags", "C tags"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_staged_step_refuses_exactly_where_the_full_check_fails(change, warm):
    """``warm`` 0: changed between the capture and the first call, whose check knows no tag yet (jit's
    first check after a change is its ``warm`` 1)."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.capture(model, x).compile()
    _calls(step, model, x, warm)
    for do, real in CHANGES[change]:
        do(model)
        _agree(step.captured.state)
        if real:
            with pytest.raises(InputMismatchError):
                step(x)
            return
        out = step(x)
        out.sum().backward()
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_a_module_written_every_call_is_checked_by_its_reads():
    """``model.step = i`` each call changes the root's tag: its reads are checked one by one and the new tag
    expected; the result stays eager's, no recompile, and a real change after it still recompiles."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    for i in range(8):
        model.calls = i
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
    assert len(step.entries) == 1
    model.a._forward_hooks[1] = _hook
    model.calls = 9
    torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
    assert len(step.entries) == 2


def test_reads_resolved_again_are_checked_before_their_tags_are_trusted():
    """A check built over reads that do not hold (the disk cache resolves stored reads in a new process)
    fails on its first call, whatever the tags are then."""
    from aotgrad.guards import state
    m = Net()
    d = vars(m)
    read = state.Read("m.extra", None, d, "extra", None, "absent")
    typed = state.Read("type(m)", None, m, "__class__", Net, "type")
    m.extra = 1
    guards = state.build([read, typed])
    assert guards.check() is not None
    assert guards.check() is not None
    del m.extra
    assert guards.check() is None
    m.extra = 2
    assert guards.check() is not None


@pytest.mark.parametrize("when", ["after the resolver", "before the build"])
@pytest.mark.parametrize("change", ["scale", "training", "forward"])
def test_a_write_after_the_resolver_read_the_module_is_found_at_the_first_check(change, when, monkeypatch):
    """A write after the resolver read the module (another thread's) is found at the staged step's
    first call: the build trusts a module's tag only where its dict was not written since the
    watermark taken before the resolver read it, and a shortcut that expected the tags the modules
    have at the build would miss it. (``jit`` checks a new entry's state as it builds it.)"""
    from aotgrad.guards import resolve, state
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    write = {"scale": lambda: setattr(model, "scale", 3.0), "training": lambda: model.c.train(False),
             "forward": lambda: setattr(model.b, "forward", lambda t: t)}[change]
    owner, name = (resolve, "assumed") if when == "after the resolver" else (state, "build")
    real = getattr(owner, name)

    def late(*args, **kwargs):
        if owner is state:
            write()
        out = real(*args, **kwargs)
        if owner is resolve:
            write()
        return out
    monkeypatch.setattr(owner, name, late)
    step = aotgrad.capture(model, x).compile()
    assert state.watermark() is None or step.captured.state.check.__self__.tags != [None] * len(
        step.captured.state.check.__self__.tags), "the tags of the dicts not written are trusted"
    with pytest.raises(InputMismatchError):
        step(x)


@pytest.mark.parametrize("change", ["hook", "type", "scale"])
def test_each_entry_of_several_keeps_its_own_tags(change):
    """Two entries over one model (train and eval): switching between them retags each; a real change
    afterwards still makes both miss."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    for training in (True, False, True, False):
        model.train(training)
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
    assert len(step.entries) == 2
    {"hook": lambda: model.a._forward_hooks.__setitem__(1, _hook),
     "type": lambda: setattr(model.b, "__class__", nn.Sigmoid),
     "scale": lambda: setattr(model, "scale", 0.5)}[change]()
    for training in (True, False):
        model.train(training)
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
    assert len(step.entries) == 4


def test_the_cpp_check_is_dropped_at_a_write_and_built_again_a_bounded_number_of_times():
    """Writes to a module every few calls: the C check (built over the old tags) is dropped at each, built
    again after calm calls, at most ``BUILDS`` times; results stay eager's and a real change still recompiles."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3)
    step = aotgrad.jit(model)
    checker = None
    for i in range(40):
        if i % 5 == 4:
            model.b.calls = i
        torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
        checker = step.entries[0].state.check.__self__
    assert len(step.entries) == 1
    assert checker.builds == checker.BUILDS     # (without the C module: the first try gives up for good)
    model.b.__class__ = nn.Sigmoid
    torch.testing.assert_close(step(x), model(x), rtol=0, atol=0)
    assert len(step.entries) == 2


@pytest.mark.skipif(not _has_c(), reason="aotgrad's C module is not built here")
def test_the_c_state_check_fails_at_each_change():
    """``tags.state_check`` alone: each change to a tagged dict (an owner's ``__dict__`` read through the
    owner, a held dict), an object's type and a held empty dict fails it, a write undone included (a tag
    never comes back); a write of the object already there, or to another dict, does not."""
    from aotgrad.guards.tags import dict_version, state_check

    class Holder:
        pass

    def world():
        owner = Holder()
        owner.k = 1
        return {"owner": owner, "ds": [{"a": 1}, {}], "objs": [nn.Tanh(), nn.Linear(1, 1)],
                "empties": [{}, collections.OrderedDict(), nn.Linear(1, 1)._forward_hooks]}

    def check_of(w):
        dicts = (vars(w["owner"]), *w["ds"])
        return state_check((w["owner"],), dicts, list(map(dict_version, dicts)), w["objs"],
                           [type(o) for o in w["objs"]], w["empties"])
    w = world()
    check = check_of(w)
    assert check() and check()
    unrelated = {}
    unrelated["x"] = 1          # a dict it was not given
    assert check()
    w["ds"][0]["a"] = w["ds"][0]["a"]       # the same object again: nothing changed, the tag stays
    w["ds"][1].clear()
    assert check()
    for change in (lambda w: w["ds"][0].__setitem__("a", 2), lambda w: w["ds"][1].__setitem__("b", None),
                   lambda w: w["ds"][0].pop("a"), lambda w: w["ds"][0].clear(),
                   lambda w: w["ds"][0].update(b=0) or w["ds"][0].pop("b"),    # a write undone
                   lambda w: setattr(w["owner"], "k", 2),
                   lambda w: setattr(w["owner"], "__dict__", dict(vars(w["owner"]))),   # another dict, equal
                   lambda w: setattr(w["objs"][0], "__class__", nn.Sigmoid),
                   lambda w: w["empties"][0].__setitem__(0, 0), lambda w: w["empties"][1].__setitem__(0, 0),
                   lambda w: w["empties"][2].__setitem__(0, print)):
        w = world()
        check = check_of(w)
        assert check()
        change(w)
        assert not check()


def test_the_c_state_check_refuses_what_it_cannot_read():
    """A held "empty" dict whose length its own class defines, a non-dict tagged or a non-type expected:
    refused when built (the caller checks those in Python), never misread."""
    from aotgrad.guards.tags import state_check
    if state_check((), (), (), (), (), ()) is None:
        pytest.skip("aotgrad's C module is not built here")

    class Sized(dict):
        def __len__(self):
            return 1
    for args in (((), (), (), (), (), (Sized(),)), ((), ([],), (0,), (), (), ()),
                 ((), (), (), (1,), (int(),), ()), ((object(),), (), (), (), (), ())):
        with pytest.raises((TypeError, ValueError)):
            state_check(*args)


def test_the_c_state_check_is_built_wherever_it_can_be():
    """``pip install`` builds ``guards/_tags.c`` (optional: a failed build installs the package without
    it). Where CPython keeps version tags and a C compiler is at hand, it must have been built, or every
    call would check its state in Python, six times slower, unseen."""
    import shutil
    import sysconfig
    from aotgrad.guards import tags
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info < (3, 14) \
            or shutil.which(compiler) is None:
        pytest.skip("no C state check on this Python, or no compiler")
    from aotgrad.guards._tags import StateCheck
    # Used, unless tags miss writes here (Python 3.13's inline values: no check by tag at all).
    assert tags.StateCheck is StateCheck or tags.dict_version is None
