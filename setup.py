"""The package's compiled parts, both optional (where one does not build, aotgrad runs the same check slower):

* ``aotgrad/guards/_tags.c``: the per-call check of the Python state a compiled entry read (module dicts'
  version tags, types, empty hook dicts) as one C loop, and the taking whole of a user's C profiler
  (cProfile) that a capture's watch pauses; not built without a compiler or on a Python
  without ``ma_version_tag``, where aotgrad checks the same state in Python.
* ``aotgrad/_tensors.cpp``: the per-call check of the parameters' and buffers' metadata as one C++
  loop over their TensorImpls; built against the torch installed when the package is (``pip install
  --no-build-isolation``, as the Makefile does) as a module named for that torch
  (``aotgrad._tensors_2_13_0_cpu``), which only that torch imports; elsewhere a guard manager's
  TENSOR_MATCH leaves check the same.

Everything else is configured in pyproject.toml."""
import json
import sys

from setuptools import Extension, setup

TAGS = sys.implementation.name == "cpython" and (3, 11) <= sys.version_info < (3, 14)


def _tensor_check() -> list:
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except Exception:       # no torch in the build environment (build isolation): nothing to build against
        return []
    sys.path.insert(0, "aotgrad")       # (aotgrad itself imports torch: the one module alone)
    from _native import module_name
    ext = CppExtension(f"aotgrad.{module_name(torch.__version__)}", ["aotgrad/_tensors.cpp"],
                       define_macros=[("AOTGRAD_TORCH_VERSION", json.dumps(torch.__version__)),
                                      ("AOTGRAD_MODULE", module_name(torch.__version__))],
                       extra_compile_args=["-O2", "-std=c++20",
                                           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"])
    ext.optional = True
    return [ext]


setup(ext_modules=([Extension("aotgrad.guards._tags", ["aotgrad/guards/_tags.c"], optional=True)] if TAGS else [])
      + _tensor_check())
