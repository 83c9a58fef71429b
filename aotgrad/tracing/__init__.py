"""The one home of tracing: the running thread's trace context (``context``) and every
process-wide patch a capture applies (``patches``)."""
from .context import REFUSE, Trace, current, scope

__all__ = ["REFUSE", "Trace", "current", "scope"]
