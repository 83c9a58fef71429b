"""Per-call values of a repeated block (``aotgrad/capture/per_call.py``): a varying int such as
``layer_idx`` is traced as a stand that escapes on any use but being passed along, and a KV cache
argument reaches the template as a stand-in that only ``update`` by index may touch. The twin
stacks of ``tests/differential/p_blocks.py`` (``blocks_cache_*``) compare every entry point with
eager and with the flat trace; these tests pin the mechanism's edges."""
import copy
import operator
import queue
import threading

import pytest
import torch

import aotgrad
from aotgrad.capture import caches, per_call
from aotgrad.guards import reads
from tests.differential import p_blocks as P
from tests.eager_check import check

USES = {
    "add": lambda s: s + 1, "radd": lambda s: 1 + s, "mul": lambda s: s * 2, "eq": lambda s: s == 0,
    "lt": lambda s: s < 3, "hash": hash, "bool": bool, "int": int, "float": float, "str": str,
    "format": lambda s: f"layer{s}", "list index": lambda s: [1, 2, 3][s], "slice": lambda s: [1, 2, 3][:s],
    "range": range, "dict key": lambda s: {0: 1}.get(s), "index": operator.index, "neg": operator.neg,
    "bit_length": lambda s: s.bit_length(), "real": lambda s: s.real, "copy": copy.copy,
    "torch op": lambda s: torch.ones(2) * s, "torch size": lambda s: torch.zeros(s),
    "in a set": lambda s: s in {1, 2},
}


# Torch's argument parser turns the escape into its own TypeError: the stand's log still has it.
CONVERTED = {"torch size"}


@pytest.mark.parametrize("use", USES)
def test_any_use_of_a_stand_escapes_even_where_the_program_catches_exceptions(use):
    log: list = []
    s = per_call.Stand(0, 5, log, [])
    try:
        try:
            USES[use](s)
        except Exception:       # a program's own handler must not hide it
            pass
    except per_call.Escaped:
        escaped = True
    else:
        escaped = False
    assert log and escaped == (use not in CONVERTED)
    assert isinstance(s, int)    # passed along, it looks like the int it stands for


def test_a_substituted_attribute_is_read_by_the_watching_thread_alone():
    m = torch.nn.Linear(2, 2)
    m.layer_idx = 3
    seen: queue.Queue = queue.Queue()
    raw: list = []
    with reads.attribute_reads([(m, {"layer_idx"})], [{"layer_idx": "stand"}], raw) as read:
        mine = m.layer_idx
        t = threading.Thread(target=lambda: seen.put(m.layer_idx))
        t.start()
        t.join()
        through_dict = vars(m)["layer_idx"]
    assert (mine, seen.get(), through_dict) == ("stand", 3, 3)
    assert read[0] == {"layer_idx"} and raw == [True]      # vars() saw the real value
    assert m.layer_idx == 3 and type(m) is torch.nn.Linear


def test_the_cache_stand_in_lets_only_updates_and_questions_through():
    cache, log, record = P.KVCache(2), [], []
    stand_in = caches.stand_ins((cache,), (0,), log, record, [])[0]
    assert isinstance(stand_in, P.KVCache) and stand_in.offloading is False     # a plain attribute: keyed
    for use in (lambda c: c.layers, lambda c: vars(c), len, bool, list, lambda c: c == c):
        with pytest.raises(per_call.Escaped):
            use(stand_in)
    assert stand_in.seen() == 0         # a question: asked again of each call's cache
    k = torch.ones(1, 2, 2)
    stand_in.update(k, k, 1)
    with pytest.raises(per_call.Escaped):       # the same layer twice: the second finds it full
        stand_in.update(k, k, 1)
    assert [type(r).__name__ for r in record] == ["Ask", "Update"]
    assert not cache.layers[1].is_initialized     # the real cache is untouched
    cache.layers[0].update(k, k)
    with pytest.raises(per_call.Escaped):       # a layer that holds tensors: no template stands for it
        caches.stand_ins((cache,), (0,), [], [], [])[0].update(k, k, 0)
    with pytest.raises(per_call.Escaped):       # a question that computes with a tensor
        caches.stand_ins((cache,), (0,), [], [], [])[0].total()


def test_a_question_is_asked_again_of_each_calls_cache():
    fresh, full = P.KVCache(2), P.KVCache(2)
    k = torch.ones(1, 3, 2)
    full.layers[0].update(k, k)
    record: list = []
    caches.stand_ins((fresh,), (0,), [], record, [])[0].seen()
    assert caches.bind(tuple(record), (fresh,), ()) == []
    assert caches.bind(tuple(record), (full,), ()) is None     # seen() answers 3 there, not 0


class Peeking(P.CachedAttention):
    """Another thread reads this block's ``layer_idx`` while its forward is traced."""

    def forward(self, x, cache=None):
        t = threading.Thread(target=lambda: PEEKS.put(type(self.layer_idx)))
        t.start()
        t.join()
        return super().forward(x, cache)


PEEKS: queue.Queue = queue.Queue()


def test_another_thread_reads_the_real_layer_index_while_a_template_is_traced():
    m = P.CachedStack([Peeking(i) for i in range(3)])
    x = torch.randn(2, 4, 4)
    captured = aotgrad.capture(m, x)
    assert next(s.info["reused whole blocks"] for s in captured.history if s.name == "trace joint") == 3
    types = set()
    while not PEEKS.empty():
        types.add(PEEKS.get())
    assert types == {int}
    check(m, (x,))


def _stack():
    torch.manual_seed(0)
    return P._cached(), torch.randn(2, 4, 4, requires_grad=True)


def test_a_layer_index_changed_after_capture_is_guarded(monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "0")
    m, x = _stack()
    step = aotgrad.capture(m, x).compile()
    step(x)
    m.blocks[2].layer_idx = 1      # now blocks 1 and 2 update one layer: eager concatenates
    with pytest.raises(aotgrad.errors.InputMismatchError, match="layer_idx"):
        step(x)
    m2, x2 = _stack()
    fast = aotgrad.jit(m2)
    fast(x2)
    m2.blocks[2].layer_idx = 1
    m3, _ = _stack()
    m3.blocks[2].layer_idx = 1
    torch.testing.assert_close(fast(x2), m3(x2), rtol=0, atol=0)
    assert "layer_idx" in aotgrad.explain(fast)


@pytest.mark.parametrize("src, asks", [
    ("x is None", False), ("x is not True", False), ("isinstance(x, int)", False), ("x.__class__", False),
    ("x is y", True), ("type(x) is int", True), ("id(x) == id(y)", True), ("__import__('operator').is_(x, y)", True),
])
def test_what_a_stand_cannot_answer_as_an_int_is_found_in_the_bytecode(src, asks):
    """``type(v)``, ``id(v)`` and ``v is w`` reach no method of a stand: code that asks them gets none."""
    from aotgrad.guards import bytecode
    ns: dict = {}
    exec(f"def f(x, y):\n    return {src}", ns)
    assert bytecode.asks_type_or_identity(ns["f"].__code__) is asks
