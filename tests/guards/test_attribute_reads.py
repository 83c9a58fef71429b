"""``guards.reads.attribute_reads``: which named attributes of given objects this thread reads,
however it reads them; block reuse uses it to let twins differ in values their template never read
(``layer_idx``). Each case compares what is counted with what the code did, and checks that the
object is left as it was and that other threads see nothing but the same values."""
import threading

import pytest
import torch
import torch.nn as nn

from aotgrad.guards.reads import attribute_reads


class Mod(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = 1, 2.5, "x"
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(x)

    @property
    def twice(self):
        return self.a * 2


READS = {
    "attribute": (lambda m: m.a, {"a"}),
    "getattr": (lambda m: getattr(m, "b"), {"b"}),
    "hasattr": (lambda m: hasattr(m, "c"), {"c"}),
    "property": (lambda m: m.twice, {"a"}),
    "vars": (lambda m: vars(m), {"a", "b", "c"}),        # the whole dict: every name counts
    "dict": (lambda m: m.__dict__.get("b"), {"a", "b", "c"}),
    "parameter": (lambda m: m.fc.weight, set()),           # nn.Module's own lookups read no name
    "forward_of_child": (lambda m: m.fc(torch.ones(2)), set()),
    "nothing": (lambda m: None, set()),
}


@pytest.mark.parametrize("how", sorted(READS))
def test_each_way_of_reading_is_counted(how):
    read, expected = READS[how]
    m = Mod()
    with attribute_reads([(m, {"a", "b", "c"})]) as (seen,):
        read(m)
        assert m.__class__ is Mod and isinstance(m, Mod)
    assert seen == expected
    assert type(m) is Mod


def test_the_object_is_restored_when_the_block_raises():
    m = Mod()
    with pytest.raises(ZeroDivisionError):
        with attribute_reads([(m, {"a"})]):
            m.a / 0
    assert type(m) is Mod


def test_nested_watches_each_count_and_the_class_comes_back_after_the_last():
    m = Mod()
    with attribute_reads([(m, {"a"})]) as (outer,):
        with attribute_reads([(m, {"b"})]) as (inner,):
            m.a, m.b
        assert type(m) is not Mod       # still watched by the outer block
        m.b
    assert (outer, inner, type(m)) == ({"a"}, {"b"}, Mod)


def test_another_threads_reads_are_not_counted_and_see_the_same_values():
    m, got = Mod(), []
    with attribute_reads([(m, {"a", "b"})]) as (seen,):
        t = threading.Thread(target=lambda: got.append((m.a, m.b, m.__class__, m(torch.ones(2)) is None)))
        t.start()
        t.join(timeout=30)
    assert seen == set() and got == [(1, 2.5, Mod, False)]


def test_a_class_that_refuses_subclasses_counts_every_name():
    class Closed(nn.Module):
        def __init_subclass__(cls, **kw):
            raise RuntimeError("no subclasses")
    m = Closed()
    m.a = 1
    with attribute_reads([(m, {"a"})]) as (seen,):
        pass
    assert seen == {"a"} and type(m) is Closed
