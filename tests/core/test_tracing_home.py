"""Tracing has one home (``aotgrad/tracing``): every process-wide patch a capture applies is in
``tracing/patches.py``, and the running thread's trace state is one context (``tracing.context``)."""
import ast
import threading
from pathlib import Path

import pytest
import torch

import aotgrad
from aotgrad import tracing
from benchmarks import code_shape
from aotgrad.tracing import patches

ROOT = Path(aotgrad.__file__).resolve().parent
# _torch.py holds version shims installed once at import (fx fixes) and the undo-returning helpers
# the patches and the run-time engine swap call; nothing else may change torch's attributes.
HOMES = {"tracing/patches.py", "_torch.py"}


def torch_writes(source: str) -> list:
    return code_shape.torch_writes(ast.parse(source))


def test_every_process_wide_patch_is_in_tracing_patches():
    outside = {str(p.relative_to(ROOT)): torch_writes(p.read_text()) for p in ROOT.rglob("*.py")
               if str(p.relative_to(ROOT)) not in HOMES}
    assert {k: v for k, v in outside.items() if v} == {}
    # the scan sees the patches where they are (so the check above can fail)
    found = torch_writes((ROOT / "tracing/patches.py").read_text())
    for target in ("torch.nn.Module.__call__", "torch.manual_seed", "torch.autograd.backward", "Function.apply",
                   "T.retain_grad", "FunctionalTensor.grad", "torch.compiler.is_compiling"):
        assert any(f.endswith(f": {target}") for f in found), target
    assert torch_writes("import torch\nT = torch.Tensor\nT.foo = 1\nsetattr(torch.nn, 'x', 2)\n") == \
        ["3: T.foo", "4: setattr(torch.nn, 'x', 2)"]


def test_every_patch_is_in_the_listing():
    doc = patches.__doc__
    assert all(f"``{name}``" in doc or f"``{name.rsplit('_', 1)[0]}``" in doc for name in patches.PATCHES)
    shared = {name for name, v in vars(patches).items() if isinstance(v, aotgrad.scoped.Shared)}
    assert shared == set(patches.PATCHES)


def _state_seen_in_thread():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("state", tracing.current()))
    t.start()
    t.join(30)
    return box["state"]


def test_the_trace_context_nests_and_is_private_to_its_thread():
    empty = tracing.current()
    assert empty == tracing.Trace()
    seeds = []
    with tracing.scope(traceable=True, seeds=seeds):
        with tracing.scope(blocks="outer"):
            with tracing.scope(blocks="inner", eager_path=True):
                t = tracing.current()
                assert (t.traceable, t.seeds, t.blocks, t.eager_path) == (True, seeds, "inner", True)
                assert _state_seen_in_thread() == empty
            assert tracing.current().blocks == "outer" and not tracing.current().eager_path
        with pytest.raises(KeyError):
            with tracing.scope(blocks="x"):
                raise KeyError
        assert tracing.current().blocks is None and tracing.current().seeds is seeds
    assert tracing.current() == empty


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                                                torch.nn.Dropout(0.1)) for _ in range(3)])

    def forward(self, x):
        h = self.blocks(x)
        h.register_hook(lambda g: g * 2)
        return torch.utils.checkpoint.checkpoint(lambda t: t.sin(), h, use_reentrant=False).sum()


def test_a_capture_leaves_no_trace_context_and_no_patch():
    """A capture that uses every field (hooks, seeds, RNG positions, reused blocks) and one that
    fails half-way both leave this thread's context empty and every patch undone."""
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(2, 4, requires_grad=True)

    aotgrad.capture(model, x)      # the first capture imports torch._dynamo, which wraps torch.manual_seed
    before = (torch.nn.Module.__dict__["__call__"], torch.Tensor.__dict__.get("register_hook"),
              torch.get_rng_state, torch.manual_seed, torch.autograd.backward)
    captured = aotgrad.capture(model, x)
    assert captured.hooks.graph_hooks and tracing.current() == tracing.Trace()
    assert next(s.info for s in captured.history if s.name == "trace joint")["reused blocks"] == 3

    def bad(x):
        x.sum().backward()
        return x
    with pytest.raises(aotgrad.errors.UnsupportedError, match="backward"):
        aotgrad.capture(bad, x)
    after = (torch.nn.Module.__dict__["__call__"], torch.Tensor.__dict__.get("register_hook"),
             torch.get_rng_state, torch.manual_seed, torch.autograd.backward)
    assert after == before and tracing.current() == tracing.Trace()
    assert not any(p.users for p in patches.PATCHES.values())
