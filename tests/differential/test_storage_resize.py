"""Storage resizes of inputs (FSDP's free and re-allocate): what is refused, naming the line, before anything
runs; the start size guarded; versions as eager's. The programs that run (compared with eager through every
entry point) are the ``resize_storage_*`` family of ``p_storage.py``. Also the storages a call leaves the caller
(``set_()``, out= resizes): what a caller sees through its tensors after the call, which ``check`` cannot."""
import pytest
import torch

import aotgrad
from aotgrad.errors import InputMismatchError, MutationError, UnsupportedError
from tests.eager_check import assert_refused, check, check_usage

from .entries import ENTRIES


def _freed(n=4):
    t = torch.randn(n, 3)
    t.untyped_storage().resize_(0)
    return t


def _grow(a):
    a.untyped_storage().resize_(a.numel() * 4)


def _read_freed(a, s):
    return a.sin()                                      # line: never written, freed by the caller


def _read_grown(a, s):
    _grow(a)
    return a + s                                        # line: grown, holds nothing yet


def _partial_fill(a, s):
    _grow(a)
    with torch.no_grad():
        a[:2].copy_(s[:2])                              # line: the rest would hold nothing
    return a + s


def _write_freed(a, s):
    with torch.no_grad():
        a.copy_(s)                                      # line: no storage to write into
    return s * 2


def _read_after_free(a, s):
    _grow(a)
    with torch.no_grad():
        a.copy_(s)
    a.untyped_storage().resize_(0)
    return a * 2                                        # line: freed again


REFUSED_USES = [_read_freed, _read_grown, _partial_fill, _write_freed, _read_after_free]


@pytest.mark.parametrize("body", REFUSED_USES, ids=lambda b: b.__name__)
def test_a_use_of_an_input_whose_storage_holds_no_values_is_refused_at_its_line(body):
    e = assert_refused(None, make=lambda: (body, (_freed(), torch.randn(4, 3)), {}))     # (deepcopy reads storage)
    assert isinstance(e, UnsupportedError) and "does not hold its values" in str(e), e
    assert e.user_line and "# line:" in e.user_line, e.user_line


def _resize_intermediate(a, s):
    b = a * 2
    b.untyped_storage().resize_(0)                      # line
    return b


def _resize_view(a, s):
    a[1:].untyped_storage().resize_(0)                  # line: a view's storage is the base's
    return s * 2


def _grow_beyond(a, s):
    a.untyped_storage().resize_(a.numel() * 8)          # line: neither size is zero
    return s * 2


def _free_rg_unwritten(a, s):
    out = a.sin()
    a.untyped_storage().resize_(0)                      # line: autograd saved a for sin's backward
    return out


@pytest.mark.parametrize("body,rg", [(_resize_intermediate, False), (_resize_view, False), (_grow_beyond, False),
                                     (_free_rg_unwritten, True)], ids=lambda v: getattr(v, "__name__", ""))
def test_a_resize_torch_cannot_replay_is_refused_at_its_line(body, rg):
    e = assert_refused(None, make=lambda: (body, (torch.randn(4, 3, requires_grad=rg), torch.randn(4, 3)), {}))
    assert isinstance(e, UnsupportedError) and "storage" in str(e), e
    assert e.user_line and "# line" in e.user_line, e.user_line


def _symbolic_bytes(a, s):
    a.untyped_storage().resize_(a.numel() * 4)          # a symbolic size under dynamic=True: evaluated per call
    with torch.no_grad():
        a.copy_(s)
    return a + s


@pytest.mark.slow
def test_a_symbolic_size_is_evaluated_per_call():
    compiled = aotgrad.capture(_symbolic_bytes, _freed(4), torch.randn(4, 3), dynamic=True).compile()
    for n in (4, 6):
        a, b, s = _freed(n), _freed(n), torch.randn(n, 3)
        torch.testing.assert_close(compiled(b, s), _symbolic_bytes(a, s))
        assert b.untyped_storage().nbytes() == a.untyped_storage().nbytes() == n * 12
        torch.testing.assert_close(b, a)


def test_a_resized_input_sharing_its_storage_is_refused():
    def f(a, v):
        out = v * 2
        a.untyped_storage().resize_(0)
        return out
    a = torch.randn(4, 3)
    e = assert_refused(f, (a, a[1:]))
    assert isinstance(e, MutationError) and "sharing its storage" in str(e) and "resize_(0)" in e.user_line, e


def _fsdp(a, s):
    _grow(a)
    with torch.no_grad():
        a.copy_(s)
    out = a * 3
    a.untyped_storage().resize_(0)
    return out


def _read_then_free(a, s):
    out = a * 3 + s
    a.untyped_storage().resize_(0)
    return out


def test_the_start_size_is_guarded_where_the_trace_read_the_values():
    compiled = aotgrad.capture(_read_then_free, torch.randn(4, 3), torch.randn(4, 3)).compile()
    freed = _freed()
    with pytest.raises(InputMismatchError, match="input"):
        compiled(freed, torch.randn(4, 3))      # the graph would read the freed storage
    assert freed.untyped_storage().nbytes() == 0


def test_a_storage_freed_on_entry_may_come_with_any_size():
    def make(freed):
        return lambda: (_fsdp, (_freed() if freed else torch.randn(4, 3), torch.randn(4, 3)), {})
    compiled = aotgrad.capture(_fsdp, _freed(), torch.randn(4, 3)).compile()
    for freed in (True, False, True):       # (eager's resize_ of a full storage to its size does nothing)
        check(None, make=make(freed), compile=lambda f, a, k: compiled, backward=False)


def test_jit_compiles_again_for_another_start_size():
    def make(freed):
        return lambda: (_read_then_free, (_freed() if freed else torch.randn(4, 3), torch.randn(4, 3)), {})
    jitted = aotgrad.jit(_read_then_free)
    check(None, make=make(False), compile=lambda f, a, k: jitted, backward=False)
    with pytest.raises(UnsupportedError, match="does not hold its values"):
        jitted(_freed(), torch.randn(4, 3))     # compiled again: the trace refuses the read


@pytest.mark.parametrize("free", [False, True])
def test_versions_are_eagers(free):
    def f(a, s):
        _grow(a)
        with torch.no_grad():
            a.copy_(s)
        out = a * 2
        if free:
            a.untyped_storage().resize_(0)
        return out
    a, b, s = _freed(), _freed(), torch.randn(4, 3)
    f(a, s)
    aotgrad.capture(f, b, s).compile()(b, s)
    assert (b._version, b.untyped_storage().nbytes()) == (a._version, a.untyped_storage().nbytes())


def test_fsdp_parameter_trains_like_eager():
    """Freed on entry, requires grad, filled under no_grad, used, freed: the joint's copy of the written input
    is made without reading it (a clone would read the freed storage: a segfault), its gradient is eager's."""
    def f(a, s, x):
        _grow(a)
        with torch.no_grad():
            a.copy_(s)
        out = x.sin() * 2 + a
        a.untyped_storage().resize_(0)
        return out

    def make():
        torch.manual_seed(0)
        return f, (_freed().requires_grad_(True), torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)), {}
    fn, args, _ = make()
    captured = aotgrad.capture(fn, *args)
    first = next(iter(captured.joint.graph.find_nodes(op="placeholder")))
    assert [n.target for n in first.users] == [torch.ops.aten.empty_like.default], captured.joint.code
    check(None, make=make)


def test_a_function_without_inputs_resizing_an_intermediate_is_refused():
    def f():
        b = torch.ones(3) * 2
        b.untyped_storage().resize_(0)                  # line
        return b
    e = assert_refused(f, ())
    assert isinstance(e, UnsupportedError) and "not an input" in str(e) and "# line" in e.user_line, e


def _resize_bigger(x):
    x.resize_(3 * x.shape[0], 2)                        # line: more elements
    return x * 3


def _resize_non_contiguous(x):
    x.t().resize_(x.shape[1], 2)                        # line: a transposed view
    return x * 3


@pytest.mark.parametrize("body", [_resize_bigger, _resize_non_contiguous], ids=lambda b: b.__name__)
def test_a_symbolic_resize_it_cannot_trace_is_refused_at_its_line(body):
    e = assert_refused(body, (torch.randn(4, 2),), dynamic=True)
    assert isinstance(e, UnsupportedError) and "symbolic sizes" in str(e) and "# line" in e.user_line, e


def _extent(shape, stride, offset):
    return offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _grow_to_reach(a):
    nbytes = (a.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))) * a.element_size()
    a.untyped_storage().resize_(nbytes)


def _down_up(a, s, x):
    a.untyped_storage().resize_(0)
    _grow_to_reach(a)
    with torch.no_grad():
        a.copy_(s + 1)
    return a + x


def _at(t, stride, offset):
    out = torch.zeros(_extent(t.shape, stride, offset)).as_strided(t.shape, stride, offset)
    with torch.no_grad():
        out.copy_(t)
    return out.detach().requires_grad_(t.requires_grad)


@pytest.mark.parametrize("offset", [3, 5])
def test_dynamo_recompiling_for_another_offset_resizes_like_eager(offset):
    """Dynamo splits at each resize and, recompiling for another storage offset, passes the grow's size
    over symbols of which the trace fixes one (at offset 3, a stride equal to it): the size is kept over the
    settled symbols, each bound per call, rather than refused after Dynamo's free already ran."""
    torch._dynamo.reset()
    compiled = torch.compile(_down_up, backend="aotgrad")
    base = (torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3, requires_grad=True))
    for stride, at in (((3, 1), 0), ((1, 4), 0), ((3, 1), offset), ((3, 1), offset + 1)):
        def make():
            return _down_up, tuple(_at(t, stride, at) for t in base), {}
        run = check(None, make=make, compile=lambda f, a, k: compiled)
        assert run.args[0].untyped_storage().nbytes() == (at + 12) * 4
    torch._dynamo.reset()


# --- the size of a traced storage: no guard checks it, and the trace's wrapper keeps its size on entry ------------

def _size_after_free(a, s):
    a.untyped_storage().resize_(0)
    return s * (2 if a.untyped_storage().size() == 0 else 3)        # line: eager takes the first branch


def _nbytes_after_grow(a, s):
    _grow(a)
    with torch.no_grad():
        a.copy_(s)
    return a + s * a.untyped_storage().nbytes()                     # line


def _len_on_entry(a, s):
    return s * len(a.untyped_storage())                             # line: a larger storage would pass the guards


def _nbytes_of_a_view(a, s):
    return s + a[1:].untyped_storage().nbytes()                     # line: the base's storage


@pytest.mark.parametrize("entry", ["capture", "jit"])
@pytest.mark.parametrize("body,freed", [(_size_after_free, False), (_nbytes_after_grow, True), (_len_on_entry, False),
                                        (_nbytes_of_a_view, False)], ids=lambda v: getattr(v, "__name__", ""))
def test_a_read_of_a_storage_size_is_refused_at_its_line(body, freed, entry):
    compile = {"capture": None, "jit": lambda fn, args, kwargs, **o: aotgrad.jit(fn)}[entry]
    e = assert_refused(None, make=lambda: (body, (_freed() if freed else torch.randn(4, 3), torch.randn(4, 3)), {}),
                       **({"compile": compile} if compile else {}))
    assert isinstance(e, UnsupportedError) and "size of a traced tensor's storage" in str(e), e
    assert e.user_line and "# line" in e.user_line, e.user_line


def test_a_storage_size_read_outside_decides_per_call():
    """The same decision taken outside the captured function: each call's own branch, like eager."""
    step = aotgrad.jit(lambda a, s, freed: s * (2 if freed else 3))
    for freed in (True, False, True):
        a = _freed() if freed else torch.randn(4, 3)
        s = torch.randn(4, 3)
        torch.testing.assert_close(step(a, s, a.untyped_storage().size() == 0), s * (2 if freed else 3))


# --- the storages a call leaves the caller (set_(), out=), seen through the caller's tensors after it

def _emptied(x, w):
    x.set_()                # eager: a fresh empty storage; the caller's other views keep the old one
    return w * 2


def _emptied_usage(call, fn, args, kwargs):
    x = args[0]
    alias = x.view(-1)
    out = call(*args)
    x.resize_(3).fill_(7.0)
    return out, alias


def _set_written(x, w):
    y = torch.empty(0)
    y.set_(x)               # eager: y is a tensor of its own over the caller's storage
    y.mul_(2)
    return y, x * w


def _set_written_usage(call, fn, args, kwargs):
    y, out = call(*args)
    y.add_(10)              # writes the caller's x, as eager's
    return out, y


def _set_with_view(x, w):
    y = x.new_empty(0)
    y.set_(x)
    return y, x.view(-1), w * 2


def _set_with_view_usage(call, fn, args, kwargs):
    y, v, out = call(*args)
    y.unsqueeze_(0)         # y is not x: x keeps its shape
    return out, v, y


def _out_resized(a, b, c):
    b.mul_(10)              # another input written before the resize is replayed
    torch.add(a, b, out=c)
    return c


def _out_resized_usage(call, fn, args, kwargs):
    c = args[2]
    alias = c.view(-1)      # the caller's view of c's storage, grown with it
    out = call(*args)
    c.add_(1)
    return out, alias


@pytest.mark.parametrize("entry", ["capture", "jit"])
@pytest.mark.parametrize("body,usage,inputs", [
    (_emptied, _emptied_usage, lambda: (torch.randn(3), torch.randn(3, requires_grad=True))),
    (_set_written, _set_written_usage, lambda: (torch.randn(3), torch.randn(3, requires_grad=True))),
    (_set_with_view, _set_with_view_usage, lambda: (torch.randn(2, 3), torch.randn(3, requires_grad=True))),
    (_out_resized, _out_resized_usage, lambda: (torch.randn(3), torch.randn(3), torch.empty(0))),
], ids=lambda v: getattr(v, "__name__", ""))
def test_the_caller_holds_eagers_storages_after_the_call(body, usage, inputs, entry):
    check_usage(lambda: (body, inputs(), {}), usage, compile=ENTRIES[entry].compile)


def _set_onto_requiring_grad(x):
    y = torch.empty(0)
    y.set_(x)                                           # line: eager's y has set_'s history, whose backward raises
    return y, x * 2


@pytest.mark.parametrize("entry", ["capture", "jit"])
def test_a_tensor_set__onto_an_input_requiring_grad_and_returned_is_refused_at_its_line(entry):
    e = assert_refused(_set_onto_requiring_grad, (torch.randn(3, requires_grad=True),),
                       compile=lambda fn, args, kwargs: ENTRIES[entry].compile(fn, args, kwargs))
    assert isinstance(e, MutationError) and "set_()" in str(e) and "requires grad" in str(e), e
    assert e.user_line and "# line" in e.user_line, e.user_line
