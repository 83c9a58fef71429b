"""The package's one compiled part, optional: ``aotgrad/guards/_tags.c``, the per-call check of the
Python state a compiled entry read (module dicts' version tags, types, empty hook dicts) as one C loop.
Where it does not build (no compiler, a Python without ``ma_version_tag``) aotgrad checks the same
state in Python, slower. Everything else is configured in pyproject.toml."""
import sys

from setuptools import Extension, setup

TAGS = sys.implementation.name == "cpython" and (3, 11) <= sys.version_info < (3, 14)
setup(ext_modules=[Extension("aotgrad.guards._tags", ["aotgrad/guards/_tags.c"], optional=True)] if TAGS else [])
