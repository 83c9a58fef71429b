"""Every usage pattern x every kind of output (``usage.py``), compiled for the cudagraphs backend
(null runner; recording on the first call, or after one warm-up call so that inputs at a stable
address are read in place) and for the eager backend, compared with eager through
``tests.eager_check.check_usage``: each must behave exactly like eager, raising where eager raises.
``make test`` runs a fixed quarter of the cudagraphs column; the rest is ``slow``."""
import zlib

import pytest

import aotgrad
from aotgrad.backends import cudagraphs as cg
from tests.eager_check import check_usage

from .entries import ENTRIES
from .usage import KINDS, USAGES


def _warm(fn, args, kwargs):
    return aotgrad.capture(fn, *args, **kwargs).compile(fw_compiler=cg.configure(warmup=1))


COMPILERS = {"cudagraphs": ENTRIES["capture_cudagraphs"].compile, "cudagraphs_warm": _warm,
             "capture": ENTRIES["capture"].compile}


# Not the cudagraphs backend's: aotgrad's own, seen on every backend (the eager one included).
KNOWN = {("aliases_input", "autograd_grad_kept_across_steps"):
         "the input's gradient, summed from x.view(-1), x.t() and x * w, comes back with x.t()'s strides "
         "(1, 4) where eager's is contiguous (3, 1); values are eager's",
         ("mutated_input_returned", "input_written_before_backward"):
         "an input written in place inside the program is saved as the functional value of that write, "
         "not as the input: writing the input again before the backward goes unnoticed (eager raises its "
         "version-counter error); the gradient is the one of the values the forward saw"}


def _params():
    for c in COMPILERS:
        for k in KINDS:
            for u in USAGES:
                # make test runs a fixed quarter of the cudagraphs column; the rest is slow
                fast = c == "cudagraphs" and zlib.crc32(f"{k}/{u}".encode()) % 4 == 0
                marks = [pytest.mark.fast] if fast else [pytest.mark.slow]
                if (k, u) in KNOWN:
                    marks.append(pytest.mark.xfail(reason=KNOWN[k, u], strict=True))
                yield pytest.param(c, k, u, marks=marks, id=f"{k}-{u}-{c}")


@pytest.mark.parametrize("compiler,kind,pattern", list(_params()))
def test_usage_matches_eager(compiler, kind, pattern):
    check_usage(KINDS[kind], USAGES[pattern], compile=COMPILERS[compiler])
