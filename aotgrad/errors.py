"""Typed user-facing errors.

Each error is one actionable sentence; where the problem comes from a line of
the user's program, that line is named (``file:line in function``).
Internal invariants are plain ``assert``s, never these.
"""
from __future__ import annotations

import os
import re
import traceback

_PKG_DIRS = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(__import__("torch").__file__)),
)


class AotgradError(Exception):
    """Base of every error aotgrad raises for a user's program or call."""

    def __init__(self, message: str, *, user_line: str | None = None):
        self.user_line = user_line
        super().__init__(f"{message} (at {user_line})" if user_line else message)


class UnsupportedError(AotgradError):
    """A construct or operator that cannot be captured."""


class GraphBreakError(UnsupportedError):
    """A construct one graph cannot hold where Dynamo breaks the graph and runs it eagerly: ``aotgrad.jit``
    hands the function to ``torch.compile(backend="aotgrad")`` (``frontend.dynamo.hand_off``); the staged
    ``capture`` refuses it."""


class DataDependentError(GraphBreakError):
    """Python control flow or a shape that depends on tensor values."""


class InputMismatchError(AotgradError):
    """A compiled function was called with inputs it was not captured for."""


class GraphContractError(AotgradError):
    """A user-edited graph does not keep the inputs/outputs contract."""


class MutationError(UnsupportedError):
    """An input mutation that cannot be replayed faithfully."""


class BudgetError(AotgradError):
    """A memory budget that no partition can meet."""


class ExportFormatError(AotgradError):
    """An exported artifact this aotgrad cannot load: another format or torch version, a
    corrupted or truncated file, or content the format does not allow (nothing of it is run)."""


class OptionError(AotgradError, TypeError):
    """An option an API does not take, or a value it cannot use (raised when it is given)."""


def user_frame(tb) -> str | None:
    """The innermost frame of ``tb`` that belongs to the user's code, as text."""
    return _innermost_user(traceback.extract_tb(tb) if tb is not None else [])


def in_packages(filename: str) -> bool:
    """Whether code of ``filename`` is aotgrad's or torch's own (or generated: ``<eval_with_key>``)."""
    return "<" in filename or os.path.abspath(filename).startswith(_PKG_DIRS)


def caller_line() -> str | None:
    """The innermost frame now running that belongs to the user's code (for an error
    raised from inside PyTorch's engine: the user's ``.backward()`` line)."""
    return _innermost_user(traceback.extract_stack())


_MODULES_DIR = os.path.join(_PKG_DIRS[1], "nn", "modules")
# The standard library's wrappers between the user's code and ours (a @contextmanager's __exit__).
_PLUMBING = tuple(os.path.abspath(m.__file__) for m in (__import__("contextlib"), __import__("functools")))


def _innermost_user(frames) -> str | None:
    """The user's own innermost frame; failing that, the innermost line of a ``torch.nn`` module's
    code (a library layer such as BatchNorm is where the construct is, and the user wrote the model)."""
    module_line = None
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if not in_packages(fr.filename) and path not in _PLUMBING:
            return _frame_text(fr)
        if module_line is None and path.startswith(_MODULES_DIR):
            module_line = _frame_text(fr)
    return module_line


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def traced_line(stack_trace: str | None) -> str | None:
    """The user's innermost frame (as :func:`user_line` picks it) of a graph node's recorded ``stack_trace``."""
    lines = (stack_trace or "").strip().splitlines()
    frames = []
    for i, ln in enumerate(lines):
        m = _FRAME.search(ln)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(lines[i + 1]) else ""
            frames.append(traceback.FrameSummary(m.group(1), int(m.group(2)), m.group(3), line=code))
    return _innermost_user(frames)


def _frame_text(fr) -> str:
    return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"


class OpError(AotgradError, RuntimeError):
    """An operator of a compiled graph refused its inputs as it ran (a check of dtypes, devices or
    values that fake tensors do not make while tracing); eager raises the same ``RuntimeError``."""


class TraceError(AotgradError):
    """The user's program failed while being traced."""
