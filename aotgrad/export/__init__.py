"""Serialising what a capture and compile produced, so another process can load it."""
from .graphs import Unserializable, dump_graph, load_graph

__all__ = ["Unserializable", "dump_graph", "load_graph"]
