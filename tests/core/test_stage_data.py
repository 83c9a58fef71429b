"""Stage objects are data: they do not pin the user's batch, a ``Compiled`` loaded from the
disk cache is as usable as a fresh one, and they print in one line."""
import gc
import weakref

import torch
import torch.nn as nn

import aotgrad


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch_dies(use) -> bool:
    """Whether the example batch is freed once the caller drops it, while ``use``'s result is kept."""
    x = torch.randn(3, 4)
    ref = weakref.ref(x)
    kept = use(x)
    del x
    gc.collect()
    assert kept is not None
    return ref() is None


def test_captured_and_compiled_do_not_pin_the_batch():
    m = _model()

    def use(x):
        captured = aotgrad.capture(m, x)
        compiled = captured.compile()
        compiled(x).sum().backward()
        return captured, compiled
    assert _batch_dies(use)


def test_jit_entries_do_not_pin_the_batch(monkeypatch, tmp_path):
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(tmp_path))
    m = _model()
    for loaded in (False, True):      # the second jit loads its entry from the disk cache
        step = aotgrad.jit(m)

        def use(x, step=step):
            step(x).sum().backward()
            step(x + 1)
            return step
        assert _batch_dies(use)
        assert step.entries[0].loaded == loaded
