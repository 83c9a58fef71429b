"""Conformance sweeps: every sample of PyTorch's own test databases (OpInfo
``op_db``, ``autograd_function_db``, ``module_db``) run eagerly and through
aotgrad via the one comparison helper, ``tests.eager_check.check``."""
