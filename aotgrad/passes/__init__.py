"""Graph-to-graph passes: pure functions ``GraphModule -> GraphModule``."""
from .cleanup import eliminate_dead_code, remove_detach, simplify

__all__ = ["eliminate_dead_code", "remove_detach", "simplify"]
