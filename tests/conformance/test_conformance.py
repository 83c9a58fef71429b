"""Conformance against eager PyTorch on a fixed, representative slice of
PyTorch's test databases (the full sweep is ``make conformance``).

One test per database entry, so a failure names its op or module. A sample
may pass or be skipped (eager itself fails on it); it may end in a typed
aotgrad error only for the data-dependent entries in ``selection``; a
mismatch or a crash always fails.

``AOTGRAD_CONFORMANCE_REFERENCE=1`` runs the same tests through torch's own
aot_function instead, to check the harness and this selection.
"""
from __future__ import annotations

import os

import pytest

from tests.conformance import selection
from tests.conformance.isolate import Worker

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="module")
def worker():
    """One child process for the module: a hard crash in the compiler fails
    one sample of one test instead of ending the whole test session."""
    w = Worker(reference=os.environ.get("AOTGRAD_CONFORMANCE_REFERENCE") == "1")
    yield w
    w.close()


def _run(worker, db, key, max_samples):
    return worker.run_entry(db, key, max_samples=max_samples, timeout=selection.TIMEOUT)["samples"]


def _describe(samples):
    lines = []
    for s in samples:
        detail = s.get("type") or ""
        where = s.get("aotgrad_frame") or s.get("where") or ""
        msg = (s.get("message") or "").splitlines()[0][:200] if s.get("message") else ""
        lines.append(f"  sample {s['index']}: {s['outcome']} {detail} {msg} {where}".rstrip())
        if s.get("sample"):
            lines.append(f"    {s['sample'][:200]}")
    return "\n".join(lines)


def _assert_conforms(samples, allowed):
    bad = [s for s in samples if s["outcome"] not in allowed]
    if bad:  # pytest.fail: the per-sample list is the message, without a repr of locals
        pytest.fail(f"{len(bad)} of {len(samples)} samples failed:\n{_describe(bad)}", pytrace=False)
    if all(s["outcome"] == "skip" for s in samples):
        pytest.fail("every sample was skipped: eager PyTorch could not run any", pytrace=False)


def _allowed(db, key):
    return {"pass", "skip", "typed_error"} if key in selection.DATA_DEPENDENT.get(db, ()) \
        else {"pass", "skip"}


@pytest.mark.parametrize("key", selection.OPINFO)
def test_opinfo(worker, key):
    samples = _run(worker, "opinfo", key, selection.MAX_SAMPLES)
    _assert_conforms(samples, _allowed("opinfo", key))


@pytest.mark.parametrize("key", selection.AUTOGRAD_FUNCTION)
def test_autograd_function(worker, key):
    samples = _run(worker, "autograd_function", key, None)
    refuse = key in selection.MUST_REFUSE
    _assert_conforms(samples, {"typed_error", "skip"} if refuse else _allowed("autograd_function", key))


@pytest.mark.parametrize("key", selection.MODULES)
def test_module(worker, key):
    samples = _run(worker, "modules", key, selection.MAX_MODULE_SAMPLES)
    _assert_conforms(samples, _allowed("modules", key))
