"""Generated Python source (guards, the eager backend's straight-line graphs) compiled under a
file name registered with :mod:`linecache`, so tracebacks, ``inspect.getsource`` and debuggers
show the generated lines instead of nothing."""
from __future__ import annotations

import itertools
import linecache

_numbers = itertools.count()


def compile_source(src: str, what: str):
    """``compile(src, ..., "exec")`` under a fresh ``<aotgrad what #n>`` file name whose lines
    ``linecache`` knows (an entry with no modification time survives ``checkcache``)."""
    filename = f"<aotgrad {what} #{next(_numbers)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    return compile(src, filename, "exec")


def source_of(fn) -> str | None:
    """The generated source ``fn`` was compiled from (by :func:`compile_source`), or None."""
    code = getattr(fn, "__code__", None)
    if code is None or not code.co_filename.startswith("<aotgrad "):
        return None
    return "".join(linecache.getlines(code.co_filename)) or None
