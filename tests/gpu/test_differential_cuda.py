"""make test's differential slice (``selection.is_fast``) on CUDA: every entry point, programs built
under ``torch.device("cuda")``. Skipped without CUDA; make test-differential runs every CUDA case."""
import pytest
import torch

from tests.differential.harness import cases
from tests.differential.selection import is_fast
from tests.differential.test_differential import param, run_checked

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("program,entry,device",
                         [param(p, e, d, True) for p, e, d in cases() if d == "cuda" and is_fast(p, e, d)])
def test_cuda_slice_matches_eager_or_refuses_cleanly(request, program, entry, device):
    run_checked(request, program, entry, device)
