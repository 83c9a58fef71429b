"""Graph-to-graph passes: pure functions ``GraphModule -> GraphModule``."""
from .cleanup import eliminate_dead_code, remove_detach, simplify
from .rng import share_recomputed_randomness

__all__ = ["eliminate_dead_code", "remove_detach", "simplify", "share_recomputed_randomness"]
