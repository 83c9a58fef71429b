"""Observability: stages as they happen (records, Chrome trace events, progress: events), explain/report."""
from . import logconfig  # noqa: F401  (imported for its effect: applies AOTGRAD_LOG)
from .events import Step, TraceSink, timed, trace

__all__ = ["Step", "timed", "trace", "TraceSink"]
