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


# --- softmax, log-softmax and the NLL backward as Inductor writes them () ---------

class LMHead(nn.Module):
    """A language model's loss: logits (in ``dtype``) upcast for a cross entropy over the classes."""

    def __init__(self, classes=300, dtype=torch.float32, **loss):
        super().__init__()
        self.proj, self.loss = nn.Linear(16, classes).to(dtype), loss

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.proj(x).float(), y, **self.loss)


LOSSES = {"mean": {}, "sum": dict(reduction="sum"), "ignored": dict(ignore_index=3),
          "weighted": dict(weight=torch.rand(300) + 0.5), "smoothed": dict(label_smoothing=0.1)}


def _lm(dtype, loss):
    def make():
        torch.manual_seed(0)
        y = torch.randint(0, 300, (24,))
        y[::5] = 3                          # rows an ignore_index drops
        return LMHead(dtype=dtype, **LOSSES[loss]), (torch.randn(24, 16, dtype=dtype), y)
    return make


def _inductor(model, args, kwargs, **opts):
    return aotgrad.capture(model, *args, **kwargs).compile(fw_compiler="inductor", **opts)


# Inductor compiles C++ per program: make test runs the bf16 loss with ignored rows, the rest is slow.
@pytest.mark.parametrize("dtype,loss", [
    pytest.param(d, loss, id=f"{str(d)[6:]}-{loss}",
                 marks=[] if (d, loss) == (torch.bfloat16, "ignored") else [pytest.mark.slow])
    for d in (torch.float32, torch.bfloat16) for loss in LOSSES])
def test_a_class_sized_float_is_neither_saved_nor_made_in_the_backward(dtype, loss):
    """The min cut saves the row statistics and the logits (or, for float logits, what is as large),
    not the float log-probabilities beside them, and the NLL backward is pointwise (no class-sized
    scatter); the model trains as eager does."""
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    check_training(_lm(dtype, loss), compile=_inductor, steps=2, rtol=tol, atol=tol)
    model, args = _lm(dtype, loss)()
    captured = aotgrad.capture(model, *args)
    joint = compact_saved(captured.joint, captured.layout.n_primals, decompose=True)
    part = get("min_cut", None)(joint, captured.layout)
    saved = list(part.forward.graph.output_node().args[0])[-part.n_saved_tensors:]
    class_sized = [o.meta["val"] for o in saved if o.meta["val"].shape == (24, 300)]
    assert [v.dtype for v in class_sized] == [dtype]
    targets = {n.target for n in part.backward.graph.nodes}
    assert not targets & {torch.ops.aten.nll_loss_backward.default, torch.ops.aten.scatter.value,
                          torch.ops.aten._log_softmax_backward_data.default}


def test_the_inductor_backend_decomposes_only_for_a_min_cut():
    """The default partition saves what the backward reads: decomposed, that would be more values."""
    model, args = _lm(torch.float32, "mean")()
    default = aotgrad.capture(model, *args).compile(fw_compiler="inductor", partitioner="default")
    assert any(n.target is torch.ops.aten._log_softmax.default for n in default.partition.forward.graph.nodes)
    cut = aotgrad.capture(model, *args).compile(fw_compiler="inductor")
    assert not any(n.target is torch.ops.aten._log_softmax.default for n in cut.partition.forward.graph.nodes)


@pytest.mark.parametrize("case", ["2d mean", "2d sum", "2d none", "1d", "weighted ignored"])
def test_the_pointwise_nll_backward_is_the_decompositions_values(case):
    """Against PyTorch's decomposition bitwise (the scatter of -1.0 into zeros is the where), and
    against the ATen kernel to rounding."""
    from torch._decomp import decomposition_table

    from aotgrad.passes.compact_saved import _nll_loss_backward
    torch.manual_seed(0)
    op = torch.ops.aten.nll_loss_backward.default
    one_d = case == "1d"
    x = torch.randn(7) if one_d else torch.randn(5, 7)
    t = torch.tensor(2) if one_d else torch.tensor([0, 6, 3, 3, 1])
    w = torch.rand(7) + 0.5 if "weighted" in case else None
    reduction = {"2d sum": 2, "2d none": 0}.get(case, 1)
    ignore = 3 if "ignored" in case else -100
    out, total = torch.ops.aten.nll_loss_forward(x, t, w, reduction, ignore)
    g = torch.randn_like(out)
    args = (g, x, t, w, reduction, ignore, total)
    got = _nll_loss_backward(*args)
    assert torch.equal(got, decomposition_table[op](*args))
    torch.testing.assert_close(got, op(*args))


@pytest.mark.slow
def test_softmax_attention_under_the_inductor_backend_trains_like_eager():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            a = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1)
            return (a @ v).square().mean() + torch.log_softmax(q, -1).mean()

    def make():
        torch.manual_seed(0)
        return Attn(), (torch.randn(2, 5, 8),)
    check_training(make, compile=_inductor, steps=2, rtol=1e-5, atol=1e-5)
