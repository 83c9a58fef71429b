"""Random ops under the Inductor backend draw eager's numbers from eager's stream: every op tagged
``nondeterministic_seeded`` in PyTorch's OpInfo database, dropout in its forms (SDPA's
``dropout_p``, ``nn.MultiheadAttention``, ``rrelu``, bf16 and float16 dropout, in-place fills of
views), compared with eager through ``tests.eager_check.check``: masks and values (a tolerance
only for Inductor's fused float arithmetic), gradients, and the RNG state after the forward and
after the backward exact. ``make test`` runs the hand-written family; the OpInfo sweep is slow."""
import contextlib
import functools
import itertools
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from torch.utils._python_dispatch import TorchDispatchMode

from tests.differential.p_functions import _fill_gapped_views
from tests.eager_check import check

# Inductor failing on a graph runs it eagerly with this warning: here that is a failure, not a pass.
pytestmark = pytest.mark.filterwarnings("error:aotgrad inductor backend:UserWarning")

TOL = dict(rtol=1e-4, atol=1e-4)


def _rg(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _fill_view(x):
    y = x * 1
    y[1:].normal_()
    y[:, :2].exponential_()
    return (y * x).sum(0)


def _low_precision_dropout(dtype):
    def f(x):
        y = F.dropout(x.to(dtype), 0.5)
        return y != 0, y.float() * x     # the mask exact; the values within the dtype's rounding
    return f


FAMILY = {
    "sdpa_dropout": (lambda q, k: F.scaled_dot_product_attention(q, k, k, dropout_p=0.3), (_rg(2, 2, 8, 4), _rg(2, 2, 8, 4))),
    "sdpa_dropout_causal": (lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.2, is_causal=True),
                            (_rg(1, 2, 6, 4),)),
    "rrelu": (lambda x: F.rrelu(x, training=True) * 2, (_rg(5, 6),)),
    "bf16_dropout": (_low_precision_dropout(torch.bfloat16), (_rg(8, 8),)),
    "fp16_dropout": (_low_precision_dropout(torch.float16), (_rg(8, 8),)),
    "fill_views": (_fill_view, (_rg(4, 5),)),
    "bernoulli_rand_like": (lambda x: torch.bernoulli(torch.sigmoid(x)) * x + torch.rand_like(x), (_rg(6, 3),)),
    "dropout_twice": (lambda x: F.dropout(F.dropout(x, 0.5) * x, 0.3), (_rg(7, 5),)),
    "fills_gapped_views": (_fill_gapped_views, (_rg(4, 8),)),
    "random_from_to": (lambda x: (x * 1).random_(0, 10) * x + (x * 1).random_(5), (_rg(4, 8),)),
    # Draws nothing reads still advance the stream (Inductor drops what no output needs).
    "draws_nothing_reads": (lambda x: (F.dropout(x, 0.5), torch.rand(3), x * 2)[-1], (_rg(4, 6),)),
    "dropout_then_unread_draw": (lambda x: (F.dropout(x, 0.5), torch.rand_like(x))[0], (_rg(4, 6),)),
}


@pytest.mark.slow      # ~7 s: three Inductor compiles
def test_graph_without_tensor_inputs_is_compiled():
    """No tensor input gives no fake mode to find: the graph's own values give it (it used to run eagerly)."""
    check(lambda: (torch.randn(5), torch.randint(0, 9, (3,)), torch.rand(2) * 2), (), fw_compiler="inductor",
          backward=False, **TOL)


@pytest.mark.parametrize("name", list(FAMILY))
def test_random_family_under_inductor(name):
    fn, args = FAMILY[name]
    # bf16/fp16 too: the backend emulates eager's casts (torch 2.11's Inductor still rounds the CPU
    # kernel's dropout scale once more: one bf16 / fp16 ulp, as torch.compile's own does there)
    old = name in ("bf16_dropout", "fp16_dropout") and torch.__version__ < (2, 13)
    check(fn, args, fw_compiler="inductor", **(dict(rtol=1e-2, atol=3e-2) if old else TOL))


def test_multihead_attention_dropout_under_inductor():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.25, batch_first=True)
    check(mha, (torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)), fw_compiler="inductor", **TOL)


class _Draws(TorchDispatchMode):
    """Records whether an operator tagged ``nondeterministic_seeded`` was dispatched."""
    drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.drew = self.drew or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _unseeded():
    """OpInfo's random ops call ``wrapper_set_seed(op, ...)``, which reseeds inside (capture refuses
    that): within this block the wrapper calls ``op`` itself, drawing from the stream as it stands."""
    mods = [m for name, m in list(sys.modules.items())
            if name.startswith("torch.testing._internal") and hasattr(m, "wrapper_set_seed")]
    saved = [m.wrapper_set_seed for m in mods]
    for m in mods:
        m.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    try:
        yield
    finally:
        for m, w in zip(mods, saved):
            m.wrapper_set_seed = w


SCANNED = 5     # samples tried per OpInfo (dropout's first ones are p=0 or eval; all of them: ~50 s)


def _samples(info):
    torch.manual_seed(0)
    return list(itertools.islice(info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd),
                                 SCANNED))


def _drawing_sample(info):
    """The index of the first float32 CPU sample (of ``SCANNED``) on which ``info`` runs and draws."""
    for i, s in enumerate(_samples(info)):
        with _Draws() as mode:
            try:
                info.op(s.input, *s.args, **s.kwargs)
            except Exception:   # noqa: BLE001 - a sample this device or dtype cannot run
                continue
        if mode.drew:
            return i
    return None


@functools.lru_cache(None)
def seeded_opinfos() -> tuple:
    """``(info, sample index)`` for every OpInfo whose ops dispatch a ``nondeterministic_seeded``
    overload on one of its samples (found by running them, not by name)."""
    from torch.testing._internal.common_methods_invocations import op_db
    found = []
    with _unseeded(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in op_db:
            i = _drawing_sample(info)
            if i is not None:
                found.append((info, i))
    return tuple(found)


def check_sample(info, s, device="cpu"):
    """The sample's op compiled with Inductor against eager on ``device``, every tensor of the
    sample (weights passed as keywords too) an input of the compiled function."""
    leaves, spec = pytree.tree_flatten(((s.input, *s.args), s.kwargs))
    leaves = [a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
              for a in leaves]
    at = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]

    def fn(*tensors):
        flat = list(leaves)
        for i, t in zip(at, tensors):
            flat[i] = t
        args, kwargs = pytree.tree_unflatten(flat, spec)
        return info.op(*args, **kwargs)
    check(fn, tuple(leaves[i] for i in at), fw_compiler="inductor",
          backward=info.supports_autograd and any(leaves[i].requires_grad for i in at), **TOL)


@pytest.mark.slow
def test_every_seeded_opinfo_under_inductor():
    """One test over every drawing OpInfo (found at run time: no collection cost in ``make test``),
    listing every op that differs from eager or that Inductor did not compile."""
    found, failed = seeded_opinfos(), []
    assert len(found) >= 10, f"the scan found too few drawing OpInfos: {[i.name for i, _ in found]}"
    for info, index in found:
        try:
            with _unseeded():
                check_sample(info, _samples(info)[index])
        except Exception as e:  # noqa: BLE001 - collected: every failing op is reported at once
            failed.append(f"{info.name}.{info.variant_test_name} [sample {index}]: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}")
    assert not failed, "\n".join(failed)
