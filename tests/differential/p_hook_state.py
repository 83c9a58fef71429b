"""Module attributes a forward (or its pre-hook) rebinds to tensors it computes: the hook-style
``torch.nn.utils.weight_norm`` / ``spectral_norm`` (``module.weight = ...`` before every forward;
spectral norm's power iteration also writes its ``weight_u``/``weight_v`` buffers in training), and
the variants that would make the replay wrong: an attribute rebound in a nested module, to a view of
an input, to a detached value, twice in one call; and state carried from call to call in a plain
attribute (read, then rebound: the graph would read the first value forever, refused naming the line).

The compiled call binds each attribute to the graph's output after every call (``runtime.call.Rebound``),
so the module holds a tensor equal to eager's (``tests/trust/test_rebound_attrs.py`` compares it).
"""
import warnings

import torch
import torch.nn as nn

from .programs import fn, program, r

H = "hook_state"


def _normed(kind, module, **kw):
    with warnings.catch_warnings():      # weight_norm: deprecated in favour of parametrizations
        warnings.simplefilter("ignore")
        return (nn.utils.spectral_norm if kind == "spectral" else nn.utils.weight_norm)(module, **kw)


for _kind in ("spectral", "weight"):
    @program(f"{_kind}_norm_linear", H, must_match=True, calls=3)
    def _(n=4, _kind=_kind):
        return fn(_normed(_kind, nn.Linear(5, 3)), r(n, 5, rg=True))

    @program(f"{_kind}_norm_conv_transpose", H, must_match=True, calls=2)
    def _(n=2, _kind=_kind):       # spectral norm's dim=1, weight norm's dim=0 of a transposed conv
        return fn(_normed(_kind, nn.ConvTranspose1d(3, 4, 2)), r(n, 3, 5, rg=True))

    @program(f"{_kind}_norm_eval", H, must_match=True, calls=2)
    def _(n=4, _kind=_kind):
        return fn(_normed(_kind, nn.Linear(5, 3)).eval(), r(n, 5, rg=True))

    @program(f"{_kind}_norm_nested", H, must_match=True, calls=2)
    def _(n=4, _kind=_kind):
        return fn(nn.Sequential(nn.Linear(5, 5), nn.Tanh(), _normed(_kind, nn.Linear(5, 3))), r(n, 5))


@program("spectral_norm_two_iterations", H, must_match=True, calls=2)
def _(n=4):
    return fn(_normed("spectral", nn.Linear(5, 3), n_power_iterations=2), r(n, 5, rg=True))


@program("spectral_norm_under_no_grad", H, must_match=True, calls=2, outer=torch.no_grad)
def _(n=4):
    return fn(_normed("spectral", nn.Linear(5, 3)), r(n, 5))


class _Keeps(nn.Module):
    """Rebinds ``self.last`` each call (never reading the old one) to ``how(x, y)``."""

    def __init__(self, how):
        super().__init__()
        self.lin, self.how, self.last = nn.Linear(4, 4), how, torch.zeros(1)

    def forward(self, x):
        y = self.lin(x)
        self.last = self.how(x, y)
        return y * self.last.sum()


for _name, _how in {"computed": lambda x, y: y * 2, "detached": lambda x, y: y.detach() + 1,
                    "input_view": lambda x, y: x[0], "input_itself": lambda x, y: x}.items():
    @program(f"rebound_attr_{_name}", H, must_match=True, calls=2)
    def _(n=3, _how=_how):
        return fn(_Keeps(_how), r(n, 4, rg=True))


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.t = nn.Linear(4, 4), torch.zeros(4)

    def forward(self, x):
        self.t = x.sum(0)
        h = self.lin(x) + self.t
        self.t = h.mean(0)          # the second binding is the one that stays
        return h * self.t


@program("rebound_attr_twice", H, must_match=True, calls=2)
def _(n=3):
    return fn(_Twice(), r(n, 4, rg=True))


class _Carry(nn.Module):
    """State carried between calls in a plain attribute: read, then rebound."""

    def __init__(self):
        super().__init__()
        self.lin, self.t = nn.Linear(4, 4), torch.ones(4)

    def forward(self, x):
        self.t = self.t * 0.5 + x.detach().mean(0)
        return self.lin(x) * self.t


@program("rebound_attr_carried", H, calls=2)
def _(n=3):
    return fn(_Carry(), r(n, 4, rg=True))
