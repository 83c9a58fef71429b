"""``aotgrad.jit``: compile on first call, guard every later call, recompile
when a guard fails, and say why.

Each entry is a ``Compiled`` whose generated guards check everything the
graph assumed (pytree structure, baked-in non-tensor values, dtype, device,
rank, sizes or their symbolic ranges, requires_grad, aliasing of written
inputs) plus the grad and autocast modes it was captured under.

A compile first looks in the on-disk cache (:mod:`aotgrad.guards.cache`),
keyed before capture on the function, its inputs and the options; a hit is
rebuilt without tracing and still guards every call like a fresh compile.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch

from ..capture.capture import capture_call
from ..observe import timed
from ..export.entry import LOADABLE_BACKENDS, dump_compiled, load_compiled
from ..export.graphs import Unserializable
from ..guards import cache
from .flatten import signature

log = logging.getLogger("aotgrad.jit")


def _modes() -> tuple:
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))


def _describe_modes(was, now) -> str:
    names = ("grad mode", "CPU autocast", "CUDA autocast")
    return "; ".join(f"{n} was {'on' if a else 'off'}, now {'on' if b else 'off'}"
                     for n, a, b in zip(names, was, now) if a != b)


@dataclass
class Entry:
    compiled: object
    modes: tuple
    reason: str | None          # why it was compiled: None for the first entry
    loaded: bool = False        # rebuilt from the on-disk cache instead of compiled


@dataclass
class Jit:
    fn: object
    dynamic: bool | None = None
    compile_options: dict = field(default_factory=dict)
    recompile_limit: int = 8
    entries: list = field(default_factory=list)
    dynamic_dims: dict = field(default_factory=dict)
    fallbacks: int = 0

    def __call__(self, *args, **kwargs):
        modes = _modes()
        for e in self.entries:
            if e.modes == modes:
                flat, why = e.compiled.path.match(args, kwargs)
                if why is None:
                    return e.compiled.path.run(flat)
        return self._miss(modes, args, kwargs)

    def _miss(self, modes, args, kwargs):
        reason = self._why(modes, args, kwargs)
        if len(self.entries) >= self.recompile_limit:
            if not self.fallbacks:
                warnings.warn(f"aotgrad.jit({_name(self.fn)}) reached its recompile limit of {self.recompile_limit} "
                              f"(last reason: {reason}); running eagerly for inputs that fit no compiled entry",
                              stacklevel=3)
            self.fallbacks += 1
            return self.fn(*args, **kwargs)
        if reason is not None:
            log.info("recompiling %s: %s", _name(self.fn), reason)
        with timed([], "jit compile" if reason is None else "jit recompile", fn=_name(self.fn),
                   entry=len(self.entries), reason=reason) as info:
            compiled, loaded = self._compile(modes, args, kwargs)
            info["from disk cache"] = loaded
        self.entries.append(Entry(compiled, modes, reason, loaded))
        flat, why = compiled.path.match(args, kwargs)
        assert why is None, f"a fresh compile rejected its own inputs: {why}"
        return compiled.path.run(flat)

    def _compile(self, modes, args, kwargs):
        """``(compiled, loaded)``: from the disk cache when it has this call, else captured
        and compiled here (and stored for the next process)."""
        key = self._key(modes, args, kwargs)
        if key is not None:
            with timed([], "cache lookup", key=key) as info:
                compiled = self._load(key, args, kwargs)
                info["hit"] = compiled is not None
            if compiled is not None:
                return compiled, True
        captured = capture_call(self.fn, args, kwargs, dynamic=self.dynamic, dynamic_dims=self.dynamic_dims)
        compiled = captured.compile(**self.compile_options)
        if key is not None:
            try:
                with timed([], "cache store", key=key):
                    cache.store("jit", key, dump_compiled(compiled))
            except Unserializable as e:
                log.info("not caching %s on disk: %s", _name(self.fn), e)
        return compiled, False

    def _key(self, modes, args, kwargs) -> str | None:
        opts = self.compile_options
        if not cache.enabled() or opts.get("fw_compiler", "eager") not in LOADABLE_BACKENDS \
                or opts.get("bw_compiler") not in LOADABLE_BACKENDS:
            return None
        return cache.jit_key(self.fn, args, kwargs, modes=modes, dynamic=self.dynamic,
                             dynamic_dims=self.dynamic_dims, options=opts)

    def _load(self, key, args, kwargs):
        record = cache.load("jit", key)
        if record is None:
            return None
        opts = self.compile_options
        try:
            compiled = load_compiled(record, self.fn, args, kwargs,
                                     opts.get("fw_compiler", "eager"), opts.get("bw_compiler"))
        except Exception as e:  # an entry this build cannot rebuild: compile instead, never fail the call
            log.warning("cannot rebuild the cached entry of %s (%s: %s); compiling", _name(self.fn), type(e).__name__, e)
            return None
        if compiled is None or compiled.path.match(args, kwargs)[1] is not None:
            return None
        log.info("loaded %s from the disk cache", _name(self.fn))
        return compiled

    def _why(self, modes, args, kwargs) -> str | None:
        """Why the newest entry does not fit; widens ``dynamic_dims`` when only sizes changed."""
        if not self.entries:
            return None
        last = self.entries[-1]
        if last.modes != modes:
            return _describe_modes(last.modes, modes)
        _, why = last.compiled.path.match(args, kwargs)
        if self.dynamic is None:
            self._widen(last.compiled, args, kwargs)
        return why

    def _widen(self, compiled, args, kwargs) -> None:
        """Automatic dynamic: dimensions whose size changed become symbolic in the next compile."""
        specs = compiled.captured.guards.specs
        if compiled.captured.setup.rebase is not None:
            return
        _, tensors, _ = signature(self.fn, args, kwargs)
        if len(tensors) != len(specs):
            return
        for i, (t, spec) in enumerate(zip(tensors, specs)):
            if isinstance(t, torch.Tensor) and t.dim() == len(spec.size):
                changed = {d for d, (a, b) in enumerate(zip(spec.size, t.shape)) if isinstance(a, int) and a != b}
                if changed:
                    self.dynamic_dims[i] = self.dynamic_dims.get(i, set()) | changed

    def explain(self) -> str:
        lines = [f"aotgrad.jit({_name(self.fn)}): {len(self.entries)} compiled entr{'y' if len(self.entries) == 1 else 'ies'}"
                 + (f", {self.fallbacks} eager fallback call(s) past the recompile limit" if self.fallbacks else "")]
        for k, e in enumerate(self.entries):
            g = e.compiled.captured.guards
            sizes = ", ".join(f"{d}: {tuple(str(s) for s in spec.size)}" for d, spec in zip(g.descs, g.specs))
            lines.append(f"  entry {k}: " + ("first call" if e.reason is None else f"recompiled because {e.reason}")
                         + (" (loaded from the disk cache)" if e.loaded else ""))
            lines.append(f"    sizes {sizes}")
            for c in g.conditions:
                lines.append(f"    assumes {c}")
        return "\n".join(lines)


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def jit(fn=None, *, dynamic: bool | None = None, recompile_limit: int = 8, **compile_options):
    """Compile ``fn`` (a function or module) on its first call; guard and recompile after.

    ``dynamic=None`` starts static and makes a dimension symbolic once its size
    changes; ``True`` traces every size symbolically; ``False`` never does.
    ``compile_options`` go to ``Captured.compile`` (``fw_compiler``, ``partitioner`` ...).
    Usable as ``@aotgrad.jit`` or ``aotgrad.jit(model, dynamic=True)``.
    """
    if fn is None:
        return lambda f: jit(f, dynamic=dynamic, recompile_limit=recompile_limit, **compile_options)
    return Jit(fn, dynamic, compile_options, recompile_limit)
