"""Run one sample in isolation and classify what happened.

Outcomes:
  pass        -- check() found eager and compiled identical.
  mismatch    -- check() itself found a difference (an AssertionError raised by
                 its comparisons, not by an ``assert`` inside the compiler).
  typed_error -- the compiler refused with an ``aotgrad.errors.AotgradError``.
  crash       -- any other exception, a sample past its time limit, a dispatch
                 mode left active, or (see isolate.py) a dead worker process:
                 a bug in the compiler.
  skip        -- eager PyTorch itself fails on the sample, or it cannot be built.
"""
from __future__ import annotations

import os
import signal
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

import aotgrad.errors
from tests.eager_check import _backward, _weights, check

OUTCOMES = ("pass", "mismatch", "typed_error", "crash", "skip")
SEED = 0
_CHECK_FILE = os.path.join("tests", "eager_check.py")
_TORCH_TESTING = os.path.join("torch", "testing")


@dataclass
class Sample:
    """One runnable sample: ``make()`` returns fresh ``(fn, args, kwargs)``."""
    index: int
    make: object
    backward: bool
    desc: str = ""


@dataclass
class Outcome:
    outcome: str
    type: str | None = None
    message: str | None = None
    where: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self, index):
        d = {"index": index, "outcome": self.outcome}
        d.update({k: v for k, v in (("type", self.type), ("message", self.message),
                                    ("where", self.where)) if v is not None})
        d.update(self.extra)
        return d


class SampleTimeout(Exception):
    """A sample ran past its time limit (raised from SIGALRM)."""


@contextmanager
def time_limit(seconds):
    # SIGALRM interrupts Python code only; a long ATen kernel finishes first.
    if not seconds:
        yield
        return

    def on_alarm(signum, frame):
        raise SampleTimeout(f"sample exceeded {seconds}s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _frame_text(fr):
    return f"{_short(fr.filename)}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"


def _short(path):
    for marker in ("site-packages" + os.sep, os.sep + "work" + os.sep + "main" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _innermost(exc):
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1] if frames else None


def _innermost_aotgrad(exc):
    """The deepest frame inside the aotgrad package: where the core should look."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.sep + "aotgrad" + os.sep in f.filename]
    return _frame_text(frames[-1]) if frames else None


def is_comparison_failure(exc):
    """True when an AssertionError came from check()'s comparisons.

    The compiler's own invariants are plain asserts too; those are crashes.
    A comparison failure's traceback ends in eager_check.py, or in
    torch.testing's assert_close called from it.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    last = max((i for i, f in enumerate(frames) if f.filename.endswith(_CHECK_FILE)), default=None)
    if last is None:
        return False
    return all(_TORCH_TESTING in f.filename for f in frames[last + 1:])


def _message(exc, limit=400):
    text = str(exc).strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def classify(exc) -> Outcome:
    if isinstance(exc, aotgrad.errors.AotgradError):
        return Outcome("typed_error", type(exc).__name__, _message(exc))
    if isinstance(exc, AssertionError) and is_comparison_failure(exc):
        return Outcome("mismatch", message=_message(exc))
    fr = _innermost(exc)
    out = Outcome("crash", type(exc).__name__, _message(exc), _frame_text(fr) if fr else None)
    in_core = _innermost_aotgrad(exc)
    if in_core:
        out.extra["aotgrad_frame"] = in_core
    return out


def eager_preflight(sample: Sample, timeout):
    """Run the sample eagerly, forward and backward; None if eager is fine.

    A sample eager PyTorch cannot run says nothing about the compiler.
    """
    try:
        with time_limit(timeout):
            torch.manual_seed(SEED)
            fn, args, kwargs = sample.make()
            out = fn(*args, **kwargs)
            if sample.backward:
                # Exactly check()'s eager backward, so a sample it cannot
                # differentiate (say, a complex output) is a skip, not a crash.
                _backward(out, _weights(out, SEED))
    except Exception as exc:
        fr = _innermost(exc)
        return Outcome("skip", type(exc).__name__, "eager raised: " + _message(exc, 200),
                       _frame_text(fr) if fr else None)
    return None


def _leaked_modes():
    """Pop dispatch modes a failed compile left active, so the next sample is clean."""
    leaked = []
    while _get_current_dispatch_mode_stack():
        leaked.append(type(_pop_mode()).__name__)
    return leaked


def _reset_global_state():
    torch.set_grad_enabled(True)
    torch.manual_seed(SEED)


def run_sample(sample: Sample, compile_fn, *, timeout=60.0, **opts) -> Outcome:
    """Run one sample through check() with every exception caught."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            skipped = eager_preflight(sample, timeout)
            if skipped:
                return skipped
            try:
                with time_limit(timeout):
                    check(None, make=sample.make, compile=compile_fn,
                          backward=sample.backward, seed=SEED, **opts)
                result = Outcome("pass")
            except Exception as exc:
                result = classify(exc)
            leaked = _leaked_modes()
            if leaked:
                result = Outcome("crash", "LeakedDispatchMode",
                                 f"compiler left modes active: {leaked}; was {result.outcome}")
            return result
        finally:
            _reset_global_state()


def build_samples(build):
    """``(samples, None)``, or ``([], skip record)`` if generating them failed.

    Generating samples is eager work too: if it fails, the whole entry is one skip.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(SEED)
            return build(), None
    except Exception as exc:
        bad = Outcome("skip", type(exc).__name__, "sample generation failed: " + _message(exc, 200))
        return [], bad.as_dict(0)
    finally:
        _reset_global_state()


def run_samples(build, compile_fn, *, exclude=(), timeout=60.0, report=None, **opts):
    """Run the samples ``build()`` returns, except indices in ``exclude``.

    ``report(kind, value)``, if given, hears ``("start", index)`` before and
    ``("result", record)`` after each sample, so a supervising process knows
    which sample it was in if this process dies.
    """
    samples, failed = build_samples(build)
    if failed:
        return [failed]
    results = []
    for s in samples:
        if s.index in exclude:
            continue
        if report:
            report("start", s.index)
        results.append(_record(s, run_sample(s, compile_fn, timeout=timeout, **opts)))
        if report:
            report("result", results[-1])
    return results


def _record(sample, outcome):
    d = outcome.as_dict(sample.index)
    if outcome.outcome in ("mismatch", "typed_error", "crash") and sample.desc:
        d["sample"] = sample.desc  # only for failures: keeps the JSON small
    return d
