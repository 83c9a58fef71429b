"""aotgrad's C++ tensor check (``_tensors.cpp``): the module built for the torch this process runs.

It reads TensorImpl's fields as one torch lays them out, so each torch gets a module of its own name
(``setup.py`` builds it when the package is installed beside torch). This file imports nothing at
module level, so ``setup.py`` names the module with it before aotgrad (which imports torch) can be
imported. ``TensorCheck`` is the check's type, or None: the input guards and compiled autograd's
layout guard read it at each build (tests set it to None to take the fallbacks)."""
import importlib
import re


def module_name(torch_version: str) -> str:
    """``_tensors_2_13_0_cpu`` for torch ``2.13.0+cpu``."""
    return "_tensors_" + re.sub(r"[^0-9A-Za-z]", "_", torch_version)


def tensor_check():
    """``TensorCheck`` of the module built for this torch, else None (not built: no compiler, or no
    torch in the environment that installed the package)."""
    import torch
    try:
        module = importlib.import_module(f"aotgrad.{module_name(torch.__version__)}")
    except ImportError:
        return None
    return module.TensorCheck if module.TORCH_VERSION == torch.__version__ else None


TensorCheck = tensor_check() if __name__ == "aotgrad._native" else None     # (setup.py imports this file alone)
