"""``aotgrad.jit`` falls back to static sizes where automatic dynamic's symbolic recompile is refused
(issue #60): programs that capture exactly with static sizes but are refused with symbolic ones (``resize_``
of an input to more elements, or of a non-contiguous one) recompile statically for each new size, as Dynamo
marks such a frame static, and keep doing so without trying symbolic sizes again. A refusal of the static
capture too, a user's explicit ``dynamic=True`` and the recompile limit stay as they were. Every call is
compared with eager.
"""
import logging
import warnings

import pytest
import torch

import aotgrad
from aotgrad import errors
from tests.eager_check import assert_refused, check

REFUSED = "is refused with symbolic sizes"


def _bigger(x, w):
    x.resize_(2 * x.shape[0])
    x.fill_(0.5)        # (a grown tensor's new elements hold whatever the storage held)
    return x.sum() * w, x


def _transposed(x, w):
    x.t().resize_(x.shape[0], 2)     # a non-contiguous view resized: refused with symbolic sizes
    return (x * w[:1]).sum()


def _fine(x, w):
    return (x.sin() * w[0]).sum(), x.cos()


PROGRAMS = {"bigger": (_bigger, lambda n: torch.randn(n)), "transposed": (_transposed, lambda n: torch.randn(n, 3)),
            "fine": (_fine, lambda n: torch.randn(n, 2))}


def _call(jitted, name, n):
    """One call of ``jitted`` with size ``n``, compared with eager on fresh inputs."""
    fn, make_x = PROGRAMS[name]
    return check(None, make=lambda: (fn, (make_x(n), torch.randn(3, requires_grad=True)), {}),
                 compile=lambda f, a, k: jitted)


def _grows_inputs() -> bool:
    """Whether this torch's functionalization grows a traced tensor's storage (``resize_`` to more elements).
    From torch 2.15 on, every traced tensor's storage is also held by its Python storage object
    (``FunctionalTensor.__new__`` reads its size), and functionalization refuses to grow a storage held twice."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    x = torch.zeros(1)
    with FunctionalTensorMode():
        t = FunctionalTensor.to_functional(x)
        try:
            t.resize_(2)
        except RuntimeError:
            return False
    return True


GROWS = _grows_inputs()
# The fallback's own tests need a program refused with symbolic sizes alone: where this torch cannot
# grow an input at all (2.15), the shrinking resize of a non-contiguous view.
FALLBACK = "bigger" if GROWS else "transposed"


def _refusals(caplog) -> int:
    return sum(REFUSED in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["bigger", "transposed"])
def test_a_refused_symbolic_recompile_captures_static_sizes_from_then_on(name, caplog):
    caplog.set_level(logging.INFO, logger="aotgrad.jit")
    jitted = aotgrad.jit(PROGRAMS[name][0])
    if name == "bigger" and not GROWS:      # refused with static sizes too: typed, naming the user's line
        e = assert_refused(None, make=lambda: (_bigger, (torch.randn(3), torch.randn(3, requires_grad=True)), {}),
                           compile=lambda f, a, k: jitted)
        assert type(e) is errors.UnsupportedError and "resize_() to more elements" in str(e), e
        assert "test_jit_static_fallback.py" in str(e) and not jitted.entries
        return
    for n in (3, 4, 5, 6):
        _call(jitted, name, n)
    assert len(jitted.entries) == 4, jitted.summary()
    assert _refusals(caplog) == 1, "symbolic sizes were tried again after their refusal"
    assert "resize_()" in jitted.static_because
    for e in jitted.entries:    # every entry static: its sizes are numbers
        assert all(isinstance(s, int) for spec in e.compiled.captured.guards.specs for s in spec.size)
    for n in (3, 5, 4):         # sizes seen before: served by their entries, nothing compiled
        _call(jitted, name, n)
    assert len(jitted.entries) == 4 and _refusals(caplog) == 1
    assert "static sizes: automatic dynamic's symbolic recompile was refused (UnsupportedError" in jitted.explain()


def test_the_fallback_is_a_trace_event_of_the_recompile():
    jitted = aotgrad.jit(PROGRAMS[FALLBACK][0])
    with aotgrad.trace() as sink:
        for n in (3, 4, 5):
            _call(jitted, FALLBACK, n)
    recompiles = [e["args"] for e in sink.events if e["name"] == "jit recompile"]
    assert len(recompiles) == 2
    assert "resize_()" in recompiles[0]["static because"]
    assert "static because" not in recompiles[1]       # static already: no symbolic attempt to refuse


def test_a_program_fine_with_symbolic_sizes_stays_dynamic(caplog):
    caplog.set_level(logging.INFO, logger="aotgrad.jit")
    jitted = aotgrad.jit(_fine)
    for n in (3, 4, 5, 6, 7, 3):
        _call(jitted, "fine", n)
    assert len(jitted.entries) == 2, jitted.summary()     # one recompile, symbolic, for every later size
    assert jitted.static_because is None and _refusals(caplog) == 0
    assert any(not isinstance(s, int) for spec in jitted.entries[1].compiled.captured.guards.specs for s in spec.size)


def _grows_past_3(x, w):
    if x.shape[0] > 3:      # static and symbolic captures alike take this branch: refused both ways
        x.untyped_storage().resize_(x.numel() * x.element_size() * 2)
    return (x * w).sum()


def test_a_refusal_of_the_static_capture_too_is_raised():
    jitted = aotgrad.jit(_grows_past_3)
    w = lambda: torch.randn(3, requires_grad=True)    # noqa: E731
    check(None, make=lambda: (_grows_past_3, (torch.randn(3), w()), {}), compile=lambda f, a, k: jitted)
    for n in (4, 5):        # the static capture's own refusal, naming the user's line
        e = assert_refused(None, make=lambda: (_grows_past_3, (torch.randn(n), w()), {}),
                           compile=lambda f, a, k: jitted)
        assert type(e) is errors.UnsupportedError and "resizing an input's storage" in str(e)
        assert "test_jit_static_fallback.py" in str(e)
    assert jitted.static_because is not None and len(jitted.entries) == 1
    check(None, make=lambda: (_grows_past_3, (torch.randn(3), w()), {}), compile=lambda f, a, k: jitted)


def test_an_explicit_dynamic_true_refusal_is_the_users():
    jitted = aotgrad.jit(_bigger, dynamic=True)
    e = assert_refused(None, make=lambda: (_bigger, (torch.randn(3), torch.randn(3, requires_grad=True)), {}),
                       compile=lambda f, a, k: jitted)
    assert type(e) is errors.UnsupportedError and "resize_()" in str(e)
    assert jitted.static_because is None and not jitted.entries


def test_the_recompile_limit_counts_static_entries():
    jitted = aotgrad.jit(PROGRAMS[FALLBACK][0], recompile_limit=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 4, 5, 6, 7):
            _call(jitted, FALLBACK, n)      # past the limit: eager, exactly
    assert len(jitted.entries) == 3 and jitted.fallbacks == 2
    assert sum("recompile limit" in str(w.message) for w in caught) == 1
