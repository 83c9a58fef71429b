"""Serialising what a capture and compile produced, so another process can load it:
the export artifact (``artifact``, ``rebuild``, ``inspect``) and the disk cache's entries (``entry``)."""
