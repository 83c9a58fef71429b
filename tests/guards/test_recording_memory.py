"""The read recording of a capture (``guards.reads.Recording``: frames, copies of the state a write
could change) is freed by reference counting when the capture is done, not left as a cycle for the
garbage collector: a deep model's recording is hundreds of objects a layer, and collecting them
after every capture cost about as much as tracing another layer."""
import gc
from dataclasses import replace

import aotgrad
from aotgrad.guards.reads import Frame
from aotgrad.guards.writes import Snap
from examples import models


def test_a_capture_leaves_no_recording_to_collect(monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "0")
    make = lambda: models.make_gpt(replace(models.GPT_TINY, n_layer=2, d_model=32))    # noqa: E731
    model, args = make()
    aotgrad.capture(model, *args).compile()     # the first capture's imports (a failed import keeps its frames)
    model, args = make()
    gc.collect()
    gc.disable()
    try:
        aotgrad.capture(model, *args).compile()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (Frame, Snap))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, f"{len(left)} recording objects were freed only by the collector"
