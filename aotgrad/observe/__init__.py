"""Observability: timed stage records (history), Chrome trace events, progress, explain/report."""
from . import logconfig  # noqa: F401  (imported for its effect: applies AOTGRAD_LOG)
from .events import TraceSink, trace
from .history import Step, timed

__all__ = ["Step", "timed", "trace", "TraceSink"]
