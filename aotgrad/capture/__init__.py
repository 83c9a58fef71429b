"""Tracing: one session owns fake mode, the shape environment and
functionalization; the joint forward+backward function is traced in it."""
