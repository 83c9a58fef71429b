"""PyTorch private APIs whose names or shapes change between versions, in one place, so a torch
upgrade is audited here (torch 2.11-2.14)."""
from __future__ import annotations


def backed_symbols(shape_env) -> dict:
    """Symbols bound to input sizes, with their values (torch 2.13 renamed ``var_to_val``)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val
