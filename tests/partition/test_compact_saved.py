"""Values the backward reads cross from the forward in a smaller form (passes.compact_saved):
max-pool indices as 1-byte window offsets, dropout masks as bools. The backward recomputes exactly
eager's values, for every pooling geometry, and the smaller form is what is saved."""
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.partition import get
from aotgrad.passes.compact_saved import compact_saved
from tests.eager_check import check_training

GEOMETRIES = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),
    dict(kernel_size=(3, 2), stride=2, dilation=(1, 2), ceil_mode=True),
]


class Net(nn.Module):
    def __init__(self, pool, batched=True):
        super().__init__()
        self.conv, self.pool, self.batched = nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(**pool), batched

    def forward(self, x):
        y = self.pool(torch.tanh(self.conv(x)))
        return (y * y.flip(-1)).sum()


def _make(pool, batched=True):
    def make():
        torch.manual_seed(0)
        shape = (2, 2, 9, 11) if batched else (2, 9, 11)
        return Net(pool, batched), (torch.randn(*shape),)
    return make


def _with_offsets(model, args, kwargs, **opts):
    captured = aotgrad.capture(model, *args, **kwargs)
    return replace(captured, joint=compact_saved(captured.joint, captured.layout.n_primals)).compile(**opts)


def _saved_dtypes(make, partitioner):
    model, args = make()
    captured = aotgrad.capture(model, *args)
    part = get(partitioner, None)(compact_saved(captured.joint, captured.layout.n_primals), captured.layout)
    outs = list(part.forward.graph.output_node().args[0])[-part.n_saved_tensors:]
    return [o.meta["val"].dtype for o in outs]


@pytest.mark.parametrize("pool", GEOMETRIES)
@pytest.mark.parametrize("batched", [True, False])
def test_gradients_equal_eager_for_every_geometry(pool, batched):
    check_training(_make(pool, batched), compile=_with_offsets, steps=2, rtol=0, atol=0)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_offsets_are_saved_not_indices(partitioner):
    dtypes = _saved_dtypes(_make(GEOMETRIES[1]), partitioner)
    assert torch.int8 in dtypes and torch.int64 not in dtypes


def test_indices_read_elsewhere_stay_indices():
    """Indices the program itself uses (returned, or read in the forward) are left as they are."""
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = nn.MaxPool2d(2, return_indices=True)

        def forward(self, x):
            y, idx = self.pool(x)
            return y.sum(), idx
    model, x = Returns(), torch.randn(1, 2, 4, 4, requires_grad=True)
    captured = aotgrad.capture(model, x)
    assert compact_saved(captured.joint, captured.layout.n_primals) is captured.joint


def test_large_kernels_keep_their_indices():
    """Offsets of a window of more than 127 elements do not fit a byte."""
    model, args = _make(dict(kernel_size=12))()
    args = (torch.randn(1, 2, 24, 24),)
    captured = aotgrad.capture(model, *args)
    assert compact_saved(captured.joint, captured.layout.n_primals) is captured.joint


class Dropped(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 16), nn.Dropout(p), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x)))).square().mean()


@pytest.mark.parametrize("p", [0.25, 0.5, 0.1])
def test_dropout_masks_are_saved_as_bools_and_train_like_eager(p):
    def make():
        torch.manual_seed(0)
        return Dropped(p).train(), (torch.randn(32, 6),)
    # Every step draws a new mask: the global RNG after each call is compared too.
    check_training(make, compile=_with_offsets, steps=3, rtol=0, atol=0)
    for partitioner in ("default", "min_cut"):
        model, args = make()
        captured = aotgrad.capture(model, *args)
        part = get(partitioner, None)(compact_saved(captured.joint, captured.layout.n_primals), captured.layout)
        saved = list(part.forward.graph.output_node().args[0])[-part.n_saved_tensors:]
        assert [o.meta["val"].dtype for o in saved].count(torch.bool) == 1
        assert not any(o.target is torch.ops.aten.div.Scalar for o in saved)      # the float mask


def test_inductor_backend_saves_the_compact_forms():
    """The pass runs for the Inductor backend (the partition it compiles saves int8 and bool)."""
    from examples import models
    model, args = models.make_cnn(batch=4, dropout=0.25)
    compiled = aotgrad.capture(model, *args).compile(fw_compiler="inductor")
    outs = list(compiled.partition.forward.graph.output_node().args[0])[-compiled.partition.n_saved_tensors:]
    dtypes = {o.meta["val"].dtype for o in outs}
    assert torch.int8 in dtypes and torch.bool in dtypes
    assert all(o.op == "placeholder" for o in outs if o.meta["val"].dtype == torch.int64)     # the labels only
