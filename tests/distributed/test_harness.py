"""The rank runner itself: a rank that dies tearing down after both ranks wrote their results keeps the
results (a warning), and one that dies before writing them fails the run."""
from __future__ import annotations

import atexit
import os

import pytest
import torch.distributed as dist

from . import harness

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")


def abort_at_exit(name, rank, world):
    """Each case's result is its rank; rank 1 aborts at interpreter exit (after the results are written)."""
    if rank == 1:
        atexit.register(os.abort)
    return rank


def abort_now(name, rank, world):
    if rank == 1:
        os.abort()
    return rank


def test_teardown_crash_keeps_results(tmp_path):
    with pytest.warns(RuntimeWarning, match="died after writing its results"):
        results = harness.run(["a", "b"], tmp_path, timeout=120, runner=abort_at_exit)
    assert results == [{"a": 0, "b": 0}, {"a": 1, "b": 1}]


def test_crash_before_results_fails(tmp_path):
    with pytest.raises(Exception, match="signal|exit code"):
        harness.run(["a"], tmp_path, timeout=120, runner=abort_now)
