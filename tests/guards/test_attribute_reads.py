"""``guards.reads.attribute_reads``: which named attributes of given objects this thread reads,
however it reads them; block reuse uses it to let twins differ in values their template never read
(``layer_idx``). Each case compares what is counted with what the code did, and checks that the
object is left as it was and that other threads see nothing but the same values."""
import threading

import pytest
import torch
import torch.nn as nn

from aotgrad.guards.reads import attribute_reads, watched


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
        assert watched(m) and type(m) is Mod        # still watched by the outer block, its class unchanged
        m.b
    assert (outer, inner, type(m), watched(m)) == ({"a"}, {"b"}, Mod, False)
    assert "__getattribute__" not in vars(Mod)      # the class's own lookup is back


def test_another_threads_reads_are_not_counted_and_see_the_same_values():
    m, got = Mod(), []
    with attribute_reads([(m, {"a", "b"})]) as (seen,):
        t = threading.Thread(target=lambda: got.append((m.a, m.b, m.__class__, m(torch.ones(2)) is None)))
        t.start()
        t.join(timeout=30)
    assert seen == set() and got == [(1, 2.5, Mod, False)]


def test_a_class_that_refuses_subclasses_is_watched_all_the_same():
    class Closed(nn.Module):
        def __init_subclass__(cls, **kw):
            raise RuntimeError("no subclasses")
    m = Closed()
    m.a, m.b = 1, 2
    with attribute_reads([(m, {"a", "b"})]) as (seen,):
        m.b
    assert seen == {"b"} and type(m) is Closed


def test_a_class_with_its_own_getattribute_keeps_it():
    class Own(Mod):
        def __getattribute__(self, name):
            return 7 if name == "seven" else super().__getattribute__(name)
    m = Own()
    own = vars(Own)["__getattribute__"]
    with attribute_reads([(m, {"a", "seven"})]) as (seen,):
        assert (m.seven, m.a) == (7, 1)
    assert seen == {"a", "seven"} and vars(Own)["__getattribute__"] is own and m.seven == 7


def test_a_c_type_counts_every_name():
    with attribute_reads([(1, {"real"})]) as (seen,):
        pass
    assert seen == {"real"}


def test_other_instances_and_other_threads_copies_are_not_counted_and_keep_the_class():
    """A twin read meanwhile is not the watched object; another thread's ``deepcopy`` (an EMA copy)
    and ``torch.save`` see the plain class, and the copy is never watched."""
    import copy
    import io
    m, twin, got = Mod(), Mod(), {}

    def elsewhere():
        got["clone"] = copy.deepcopy(m)
        got["buf"] = io.BytesIO()
        torch.save(m, got["buf"])
        got["type"] = type(m)
    with attribute_reads([(m, {"a"})]) as (seen,):
        twin.a
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(timeout=30)
        got["clone"].a
    assert seen == set() and got["type"] is Mod and type(got["clone"]) is Mod and not watched(got["clone"])
    got["buf"].seek(0)
    assert type(torch.load(got["buf"], weights_only=False)) is Mod
