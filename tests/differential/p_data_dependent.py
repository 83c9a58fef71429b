"""Data-dependent ops inside the traced code (wav2vec2's SpecAugment ``hidden_states[mask] = embed``,
a boolean-mask read, ``nonzero``). ``capture``/``jit`` trace them with unbacked sizes; under
``torch.compile(backend="aotgrad")``, where Dynamo's fake tensors make the joint trace raise torch's own
data-dependent exception (``index_put_``'s backward takes ``nonzero(mask)``), the backend re-raises that
exception, as PyTorch's own backends do, so Dynamo splits its graph there and trains like eager, rather
than failing the compile with ``BackendCompilerFailed``.
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
