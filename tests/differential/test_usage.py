"""Every usage pattern x every kind of output (``usage.py``), compiled for the cudagraphs backend
(null runner; recording on the first call, or after one warm-up call so that inputs at a stable
address are read in place) through ``capture`` (static and ``dynamic=True``), ``aotgrad.jit`` and
``torch.compile``, and for the eager backend, compared with eager through
``tests.eager_check.check_usage``: each must behave exactly like eager, raising where eager raises.
Patterns that call with other batch sizes (``RESHAPING``) run through the entries that accept them.
``make test`` runs a fixed eighth of the static cudagraphs column; the rest is ``slow``."""
import zlib

import pytest
import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg
from tests.eager_check import check_usage

from .entries import ENTRIES
from .usage import KINDS, RESHAPING, USAGES


def _warm(fn, args, kwargs):
    return aotgrad.capture(fn, *args, **kwargs).compile(fw_compiler=cg.configure(warmup=1))


def _dynamic(fw_compiler):
    def compile(fn, args, kwargs):
        return aotgrad.capture(fn, *args, dynamic=True, **kwargs).compile(fw_compiler=fw_compiler)
    return compile


def _jit_cudagraphs(fn, args, kwargs):
    return aotgrad.jit(fn, fw_compiler="cudagraphs", cudagraphs={"warmup": 0})


def _dynamo_cudagraphs(fn, args, kwargs):
    torch._dynamo.reset()
    return torch.compile(fn, backend=aotgrad.backend(fw_compiler="cudagraphs", cudagraphs={"warmup": 0}))


# name -> (compile, accepts other batch sizes)
COMPILERS = {"cudagraphs": (ENTRIES["capture_cudagraphs"].compile, False), "cudagraphs_warm": (_warm, False),
             "cudagraphs_dynamic": (_dynamic(cg.configure(warmup=0)), True),
             "jit_cudagraphs": (_jit_cudagraphs, True), "dynamo_cudagraphs": (_dynamo_cudagraphs, True),
             "capture": (ENTRIES["capture"].compile, False), "capture_dynamic": (_dynamic("eager"), True)}


# Not the cudagraphs backend's: aotgrad's own, seen on every backend (the eager one included).
KNOWN = {("aliases_input", "autograd_grad_kept_across_steps"):
         "the input's gradient, summed from x.view(-1), x.t() and x * w, comes back with x.t()'s strides "
         "(1, 4) where eager's is contiguous (3, 1); values are eager's",
         **{(k, "autograd_grad_kept_across_steps"):
            "nn.Linear's weight gradient, eager's t(t(mm(...))) (a view), comes back as the mm itself: "
            "passes/views.py folds view chains that end where they began; values, strides and storage "
            "sharing are eager's, _is_view() is not"
            for k in ("saved_exp", "saved_sigmoid", "saved_tanh", "saved_softmax", "saved_relu",
                      "saved_exp_float64", "buffers_updated_in_place")}}


# A capture()d step runs only under the grad mode it was captured in (a call under no_grad raises
# InputMismatchError before anything runs: tests/core/test_call_modes.py); jit and Dynamo recompile.
CAPTURED = {"cudagraphs", "cudagraphs_warm", "cudagraphs_dynamic", "capture", "capture_dynamic"}
OTHER_GRAD_MODE = {"no_grad_call_between_forward_and_backward"}


def _params():
    for c, (_, reshapes) in COMPILERS.items():
        for k in KINDS:
            for u in USAGES:
                if u in RESHAPING and not reshapes or c in CAPTURED and u in OTHER_GRAD_MODE:
                    continue
                # make test runs a fixed eighth of the static cudagraphs column; the rest is slow
                fast = c == "cudagraphs" and zlib.crc32(f"{k}/{u}".encode()) % 8 == 0
                marks = [pytest.mark.fast] if fast else [pytest.mark.slow]
                if (k, u) in KNOWN:
                    marks.append(pytest.mark.xfail(reason=KNOWN[k, u], strict=True))
                yield pytest.param(c, k, u, marks=marks, id=f"{k}-{u}-{c}")


@pytest.mark.parametrize("compiler,kind,pattern", list(_params()))
def test_usage_matches_eager(compiler, kind, pattern):
    check_usage(KINDS[kind], USAGES[pattern], compile=COMPILERS[compiler][0])
