"""What ``aotgrad.jit`` checks about how it is used, before anything is traced:
its options, its use as a method decorator, calls from inside another trace."""
from __future__ import annotations

import threading
import weakref

import torch

from .._torch import len_torch_dispatch_stack
from .. import backends, errors
from ..options import CompileOptions

def check_options(options: dict) -> CompileOptions:
    """The ``CompileOptions`` of ``aotgrad.jit``'s keyword options (or of its one ``options=``),
    refusing unknown names and compiler names not registered."""
    given = options.get("options")
    if isinstance(given, CompileOptions) and len(options) == 1:
        opts = given
    else:
        opts = CompileOptions.of("aotgrad.jit", extra=("dynamic", "recompile_limit"), **options)
    for key in ("fw_compiler", "bw_compiler"):
        name = getattr(opts, key)
        if isinstance(name, str) and name not in backends.list():
            raise errors.OptionError(f"aotgrad.jit got {key}={name!r}, which is not a registered compiler "
                                     f"(registered: {', '.join(backends.list())})", user_line=errors.caller_line())
    return opts


def tracing() -> bool:
    """Whether a dispatch mode is active: another capture (fake, functional, proxy tracing) is
    tracing this call, or a user mode watches every op; either way the function runs as written."""
    return len_torch_dispatch_stack() > 0


class _Method(torch.nn.Module):
    """A method bound to a module instance, as a module whose tree is the instance's: the
    instance's parameters are lifted like a jitted module's, and its hooks are not re-run."""

    def __init__(self, fn, obj):
        super().__init__()
        self.self = obj
        self._method = fn

    def forward(self, *args, **kwargs):
        return self._method(self.self, *args, **kwargs)


_bound: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BINDING = threading.Lock()


def bound_method(jit, obj):
    """The jitted method for ``obj``: one ``Jit`` per (instance, method), kept while the instance lives."""
    from functools import partial
    with _BINDING:      # two threads' first calls get one Jit, so one compile
        per_obj = _bound.setdefault(obj, {})
        found = per_obj.get(id(jit))
        if found is None:
            target = _Method(jit.fn, obj) if isinstance(obj, torch.nn.Module) else partial(jit.fn, obj)
            name = f"{type(obj).__name__}.{getattr(jit.fn, '__name__', 'method')}"
            found = per_obj[id(jit)] = type(jit)(target, jit.dynamic, jit.compile_options, jit.recompile_limit,
                                                 name=name)
    return found
