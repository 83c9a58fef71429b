"""Stored stages as data: one codec (values, stage records and FX graphs as JSON, tensors as raw
bytes) for the export artifact and the disk cache, the operator allowlist both loaders apply, and
the disk cache's files. Nothing here evaluates, imports or
runs what it reads."""
