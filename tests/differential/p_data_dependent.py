"""Data-dependent ops inside the traced code (wav2vec2's SpecAugment ``hidden_states[mask] = embed``,
a boolean-mask read, ``nonzero``). ``capture``/``jit`` trace them with unbacked sizes; under
``torch.compile(backend="aotgrad")``, where Dynamo's fake tensors make the joint trace raise torch's own
data-dependent exception (``index_put_``'s backward takes ``nonzero(mask)``), the backend re-raises that
exception, as PyTorch's own backends do, so Dynamo splits its graph there and trains like eager, rather
than failing the compile with ``BackendCompilerFailed``.

Python reads of a value (LayerDrop's ``torch.rand([]) < p``, BatchNorm's ``momentum=None`` average,
an ``.item()`` branch): the staged entries refuse them, ``jit`` hands them to Dynamo (issue #60).
"""
import torch

from .programs import fn, program, r

DD = "data_dependent"


def _mask(*shape):
    return torch.rand(*shape) > 0.5


@program("dd_masked_embed_in_backward", DD)
def _(n=4):
    def f(h, w, mask, embed):
        h = h * w
        h[mask] = embed           # index_put_ with a bool mask: its backward takes nonzero(mask)
        return (h.sin() * 2).sum()
    return fn(f, r(n, 5, 3), r(3, rg=True), _mask(n, 5), r(3, rg=True))


@program("dd_masked_embed_on_an_input", DD)
def _(n=4):
    def f(h, mask, embed):
        h[mask] = embed           # the caller's h is written where the mask is set
        return h.cos()
    return fn(f, r(n, 5, 3), _mask(n, 5), r(3, rg=True))


class _Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x, mask, embed):
        h = self.lin1(x).relu() * 1     # (relu saves its output: written in place, eager's backward raises)
        h[mask] = embed
        return self.lin2(h).tanh()


@program("dd_masked_embed_between_layers", DD)
def _(n=4):
    return fn(_Layers(), r(n, 5, 3, rg=True), _mask(n, 5), r(3, rg=True))


@program("dd_boolean_mask_read", DD)
def _(n=6):
    def f(x, w):
        y = x * w
        return y[y > 0].sum() + y.mean()
    return fn(f, r(n, 3), r(3, rg=True))


@program("dd_nonzero_gather", DD)
def _(n=6):
    def f(x, w, m):
        idx = torch.nonzero(m).squeeze(1)
        return (x[idx] * w).exp().sum()
    return fn(f, r(n, 3), r(3, rg=True), torch.arange(n) % 2 == 0)


# --- Python reads of a value (issue #60): one graph holds one path. ``capture`` refuses them
# (DataDependentError naming the read); ``jit`` hands the function to torch.compile(backend="aotgrad"),
# whose Dynamo splits its graph at the read; eager's branch, buffers and RNG stream either way.

class _DropLayer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(d, d), torch.nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(self.fc(x).tanh())


class _LayerDrop(torch.nn.Module):
    """BART's encoder loop: a layer is skipped where a draw falls under ``p`` (its dropout draws nothing)."""

    def __init__(self, p, d=5, layers=3):
        super().__init__()
        self.p, self.layers = p, torch.nn.ModuleList(_DropLayer(d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = layer(x)
        return x


for _p in (0.0, 0.5, 1.0):
    program(f"dd_layerdrop_p{_p}", DD, calls=3)(
        lambda n=4, p=_p: fn(_LayerDrop(p), r(n, 5, rg=True)))


@program("dd_layerdrop_eval", DD, calls=2)
def _(n=4):
    return fn(_LayerDrop(0.5).eval(), r(n, 5, rg=True))


class _Normed(torch.nn.Module):
    def __init__(self, norm, d=4):
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(d, d), norm

    def forward(self, x):
        h = self.fc(x.transpose(1, -1)).transpose(1, -1) if x.dim() > 2 else self.fc(x)
        return self.norm(h).sin()


@program("dd_batchnorm1d_momentum_none", DD, calls=3)
def _(n=5):
    return fn(_Normed(torch.nn.BatchNorm1d(4, momentum=None)), r(n, 4))


@program("dd_batchnorm2d_momentum_none", DD, calls=3)
def _(n=2):
    return fn(_Normed(torch.nn.BatchNorm2d(4, momentum=None)), r(n, 4, 3, 3))


@program("dd_item_branch_with_dropout", DD, calls=2)
def _(n=4):
    def f(x, w):
        y = x * w
        if y.sum().item() > 0:          # one branch draws, the other does not
            return torch.nn.functional.dropout(y, 0.5).exp()
        return y.cos()
    return fn(f, r(n, 3), r(3, rg=True))
