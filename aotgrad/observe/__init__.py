"""Observability: timed stage records (history)."""
from .history import Step, timed

__all__ = ["Step", "timed"]
