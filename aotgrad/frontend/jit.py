"""``aotgrad.jit``: compile on first call, guard every later call, recompile
when a guard fails, and say why.

Each entry is a ``Compiled`` whose generated guards check everything the
graph assumed (pytree structure, baked-in non-tensor values with their exact
types, dtype, device, rank, sizes or their symbolic ranges, requires_grad,
aliasing of written inputs), the modes it was captured under (grad mode,
autocast and its dtypes, the default dtype), and every piece of Python state
the trace read (:mod:`aotgrad.guards.state`: globals, closure cells, module
attributes and structure, hooks, attributes of objects passed in).

A compile first looks in the on-disk cache (:mod:`aotgrad.guards.cache`): the
entries stored for this function and inputs each carry the reads they assumed,
resolved again in this process; a hit is rebuilt without tracing and guards
every call like a fresh compile.
"""
from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass, field

import torch

from .. import errors
from .dynamo import hand_off
from ..capture.capture import call_leaves, capture_call, leaf_names, recorded, root_name
from ..observe import timed
from ..export.entry import LOADABLE_BACKENDS, dump_compiled, load_compiled
from ..ir.graphs import Unserializable
from ..guards import cache, places
from ..store import disk
from ..guards import state as state_guards
from ..inputs.flatten import signature
from ..inputs.step import Root, step_root
from ..inputs.distributed import split_for_jit
from ..inputs.jit_options import bound_method, check_options, tracing
from ..options import CompileOptions
from ..runtime.modes import TRACED_NAMES, describe, traced

log = logging.getLogger("aotgrad.jit")


def _describe_modes(was, now) -> str:
    return describe(TRACED_NAMES, was, now)


@dataclass(repr=False)
class Entry:
    compiled: object
    modes: tuple
    state: object               # guards.state.StateGuards: the Python state the trace read
    reason: str | None          # why it was compiled: None for the first entry
    loaded: bool = False        # rebuilt from the on-disk cache instead of compiled
    disk: str | None = None     # why the disk cache did not serve it (None: loaded, or no key)
    gathered: tuple = ()        # (C state check, parameters and buffers its passes prove unchanged)

    def match(self, args, kwargs):
        """The prologue, given the parameters and buffers a previous call gathered where the state check
        just passed in C proves their dicts unchanged since (``StateGuards.vouched``)."""
        path = self.compiled.path
        proof = self.state.vouched(path.held) if path.held else None
        if proof is not None and self.gathered and self.gathered[0] is proof:
            return path.match(args, kwargs, self.gathered[1])
        flat, why = path.match(args, kwargs)
        if proof is not None and why is None:
            self.gathered = (proof, tuple(flat[:len(path.held)]))
        return flat, why

    def __repr__(self) -> str:
        why = "first call" if self.reason is None else f"recompiled because {self.reason}"
        return f"<jit entry {self.compiled!r}: {why}{', loaded from the disk cache' if self.loaded else ''}>"


@dataclass(repr=False)
class Jit:
    fn: object
    dynamic: bool | None = None
    compile_options: dict = field(default_factory=dict)
    recompile_limit: int = 8
    entries: list = field(default_factory=list)
    dynamic_dims: dict = field(default_factory=dict)
    fallbacks: int = 0
    handoff: object = None      # dynamo.HandOff: where a trace read a tensor's value, calls no entry fits
    static_because: str | None = None   # the refusal of automatic dynamic's symbolic recompile: static from then on
    name: str | None = None     # what messages call a jitted module: the caller's variable name
    around: object = None       # ``around(call, args, kwargs)``: a DDP's or FSDP's eager bookkeeping around ``fn``
    options: CompileOptions = field(init=False, repr=False)    # ``compile_options`` checked, as one object
    # Held while compiling: a call from another thread that fits no entry waits, then uses the new one.
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _last: object = field(default=None, init=False, repr=False)    # the entry that served the last call

    def __post_init__(self):
        self.options = check_options(self.compile_options)
        split_for_jit(self)     # DDP and FSDP wrappers (inputs/distributed.py)
        if self.name is None:
            self.name = root_name(self.fn)

    def __getstate__(self):     # copied (copy, deepcopy) without its lock; the copy gets its own
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        from ..observe.printing import repr_jit
        return repr_jit(self)

    def __get__(self, obj, objtype=None):
        """``@aotgrad.jit`` on a method: one jitted function per instance, with ``self`` bound."""
        return self if obj is None else bound_method(self, obj)

    def __call__(self, *args, **kwargs):
        if self.around is None:
            return self._call(*args, **kwargs)
        if self.handoff is not None and isinstance(self.fn, Root):  # Dynamo runs the step on its own state
            return self.handoff(*args, **kwargs)
        try:
            return self.around(self._call, args, kwargs)
        except _HandedOff:
            return self.handoff(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if tracing():       # called inside another capture: trace through, the outer graph holds it
            return self.fn(*args, **kwargs)
        modes = traced()
        found = self._find(modes, args, kwargs)
        if found is not None:
            return found[0].path.run(found[1])
        with self._lock:        # one compile at a time; the entries another thread added meanwhile first
            found = self._find(modes, args, kwargs)
            if found is not None:
                run = lambda: found[0].path.run(found[1])   # noqa: E731
            elif self.handoff is not None:
                run = lambda: self.handoff(*args, **kwargs)     # noqa: E731
            else:
                run = self._miss(modes, args, kwargs)
        return run()

    def _find(self, modes, args, kwargs):
        """``(compiled, flat inputs)`` of an entry that fits the call, or None: the entry that served the
        last call first (a training step's first entry, traced before its optimizer state existed, fits
        no later call), then each in order. Any entry whose checks all pass runs the call exactly."""
        last = self._last
        if last is not None and last.modes == modes and last.state.check() is None:
            flat, why = last.match(args, kwargs)
            if why is None:
                return last.compiled, flat
        for e in self.entries:
            if e is not last and e.modes == modes and e.state.check() is None:
                flat, why = e.match(args, kwargs)
                if why is None:
                    self._last = e
                    return e.compiled, flat
        return None

    def _miss(self, modes, args, kwargs):
        """Compile an entry for the call (the lock held); returns what runs the call (without it)."""
        reason = self._why(modes, args, kwargs)
        if len(self.entries) >= self.recompile_limit:
            if not self.fallbacks:
                warnings.warn(f"aotgrad.jit({_name(self.fn)}) reached its recompile limit of {self.recompile_limit} "
                              f"(last reason: {reason}); running eagerly for inputs that fit no compiled entry",
                              stacklevel=3)
            self.fallbacks += 1
            return lambda: self.fn(*args, **kwargs)
        if reason is not None:
            log.info("recompiling %s: %s", _name(self.fn), reason)
        try:
            with timed([], "jit compile" if reason is None else "jit recompile", fn=_name(self.fn),
                       entry=len(self.entries), reason=reason) as info:
                compiled, state, loaded, disk = self._compile_or_static(modes, args, kwargs, info)
                info["from disk cache"] = loaded
        except errors.GraphBreakError as e:     # a read of a tensor's value, a fused optimizer: Dynamo splits there
            whole = isinstance(self.fn, Root)       # a whole step: the user's step function, not its Root
            self.handoff = hand_off(self.fn.step_fn if whole else self.fn, e, self.options, self.dynamic)
            if whole:
                raise _HandedOff from e     # out of the binding's around, which installs nothing
            return lambda: self.handoff(*args, **kwargs)
        self.entries.append(Entry(compiled, modes, state, reason, loaded, disk))
        failed = state.check()
        assert failed is None, f"a fresh compile rejected its own state: {state.explain(failed)}"
        flat, why = compiled.path.match(args, kwargs)
        assert why is None, f"a fresh compile rejected its own inputs: {why}"
        return lambda: compiled.path.run(flat)

    def _compile_or_static(self, modes, args, kwargs, info):
        """``_compile``; where automatic dynamic's symbolic sizes are refused (a typed error other than a
        read of a value, which goes to Dynamo), static sizes for this call and every later one, as Dynamo
        marks such a frame static. A refusal of the static capture too is the call's."""
        try:
            return self._compile(modes, args, kwargs)
        except errors.GraphBreakError:
            raise
        except errors.AotgradError as e:
            if self.dynamic is not None or not self.dynamic_dims:
                raise
            self.static_because = info["static because"] = f"{type(e).__name__}: {e}"
            log.info("%s is refused with symbolic sizes (%s); capturing static sizes from now on", self.name, e)
            self.dynamic_dims = {}
            return self._compile(modes, args, kwargs)

    def _compile(self, modes, args, kwargs):
        """``(compiled, state guards, loaded, why not loaded)``: from the disk cache when it has this
        call, else captured and compiled here (and stored for the next process)."""
        signature(self.fn, args, kwargs)    # refuses arguments no graph can take, before keying them
        key = self._key(modes, args, kwargs)
        leaves = call_leaves(args, kwargs)
        why: list = []
        if key is not None:
            with timed([], "cache lookup", key=key.digest) as info:
                hit = self._load(key, args, kwargs, leaves, why)
                info["hit"] = hit is not None
            if hit is not None:
                return (*hit, True, None)
            log.info("disk cache miss for %s: %s", _name(self.fn), "; ".join(why))
        captured, assumed, since = self._capture(args, kwargs, leaves)
        compiled = captured.compile(options=self.options)
        if key is not None:
            try:
                with timed([], "cache store", key=key.digest):
                    disk.store_jit(key, assumed, dump_compiled(compiled))
            except Unserializable as e:
                log.info("not caching %s on disk: %s", _name(self.fn), e)
        return compiled, state_guards.build(assumed, since), False, "; ".join(why) or None

    def _capture(self, args, kwargs, leaves):
        """Capture while recording the Python state the trace reads (``capture.recorded``)."""
        return recorded(self.fn, lambda: self._trace(args, kwargs), leaves, self.name, leaf_names(args, kwargs))

    def _trace(self, args, kwargs):
        """Capture with the dimensions automatic dynamic made symbolic."""
        return capture_call(self.fn, args, kwargs, dynamic=self.dynamic, dynamic_dims=self.dynamic_dims)

    def _key(self, modes, args, kwargs) -> cache.JitKey | None:
        opts = self.options
        if isinstance(self.fn, Root):   # the key would name Root's code, not the step function's
            return None
        if not disk.enabled() or opts.fw_compiler not in LOADABLE_BACKENDS \
                or opts.bw_compiler not in LOADABLE_BACKENDS:
            return None
        return cache.jit_key(self.fn, args, kwargs, modes=modes, dynamic=self.dynamic,
                             dynamic_dims=self.dynamic_dims, options=opts)

    def _load(self, key, args, kwargs, leaves, why: list):
        """``(compiled, state guards)`` of a stored entry whose reads all hold here, or None (and why)."""
        found = disk.load_jit(key, lambda paths: places.reresolve(self.fn, leaves, self.name, paths), why)
        if found is None:
            return None
        record, assumed = found
        opts = self.options
        try:
            compiled = load_compiled(record, self.fn, args, kwargs, opts.fw_compiler, opts.bw_compiler)
        except Exception as e:  # an entry this build cannot rebuild: compile instead, never fail the call
            log.warning("cannot rebuild the cached entry of %s (%s: %s); compiling", _name(self.fn), type(e).__name__, e)
            why.append(f"the stored entry cannot be rebuilt ({type(e).__name__}: {e})")
            return None
        if compiled is None:
            why.append("the call's inputs flatten to other inputs than the stored entry's")
            return None
        state = state_guards.build(assumed)
        failed = state.check()
        mismatch = compiled.path.match(args, kwargs)[1] if failed is None else None
        if failed is not None or mismatch is not None:
            why.append(state.explain(failed) if failed is not None else mismatch)
            return None
        log.info("loaded %s from the disk cache", _name(self.fn))
        return compiled, state

    def _why(self, modes, args, kwargs) -> str | None:
        """Why the newest entry does not fit; widens ``dynamic_dims`` when only sizes changed."""
        if not self.entries:
            return None
        last = self.entries[-1]
        if last.modes != modes:
            return _describe_modes(last.modes, modes)
        failed = last.state.check()
        if failed is not None:
            return last.state.explain(failed)
        _, why = last.compiled.path.match(args, kwargs)
        if self.dynamic is None and self.static_because is None:
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

    def program(self) -> str:
        """Each compiled entry as the Python a call runs (``Compiled.program``), with the modes and
        Python state this frontend checks to pick it."""
        from ..observe.printing import format_program
        parts = [f"# ===== entry {k}\n" + format_program(e.compiled, (TRACED_NAMES, e.modes), e.state)
                 for k, e in enumerate(self.entries)]
        if self.handoff is not None:    # Dynamo's pieces: Dynamo checks its own guards before each
            parts += [f"# ===== torch.compile graph {k} (Dynamo guards it; {self.handoff.summary()})\n"
                      + format_program(c) for k, c in enumerate(self.handoff.graphs)]
        return "\n\n".join(parts)

    def explain(self) -> str:
        """Every entry: why it was compiled, its stages, graphs, saved activations, guards and the Python
        state it reads (``aotgrad.explain``)."""
        from ..observe.explain import explain_jit
        return explain_jit(self)

    def compiled_entries(self) -> list:
        return [(e.compiled, e.reason) for e in self.entries]

    def summary(self) -> str:
        """One line per entry: why it was compiled, its sizes, assumptions and how much state it reads."""
        lines = [f"aotgrad.jit({_name(self.fn)}): {len(self.entries)} compiled entr{'y' if len(self.entries) == 1 else 'ies'}"
                 + (f", {self.fallbacks} eager fallback call(s) past the recompile limit" if self.fallbacks else "")]
        if self.static_because is not None:
            lines.append(f"  static sizes: automatic dynamic's symbolic recompile was refused ({self.static_because})")
        for k, e in enumerate(self.entries):
            g = e.compiled.captured.guards
            sizes = ", ".join(f"{d}: {tuple(str(s) for s in spec.size)}" for d, spec in zip(g.descs, g.specs))
            lines.append(f"  entry {k}: " + ("first call" if e.reason is None else f"recompiled because {e.reason}")
                         + (" (loaded from the disk cache)" if e.loaded else ""))
            if e.disk:
                lines.append(f"    not loaded from the disk cache: {e.disk}")
            lines.append(f"    sizes {sizes}")
            for c in g.conditions:
                lines.append(f"    assumes {c}")
            lines.append(f"    reads {len(e.state.reads)} pieces of Python state")
        if self.handoff is not None:
            lines.append(f"  {self.handoff.summary()}")
        return "\n".join(lines)


class _HandedOff(Exception):
    """A whole step's call handed to Dynamo (``Jit.handoff``), raised through its binding's ``around``."""


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def jit(fn=None, *, dynamic: bool | None = None, recompile_limit: int = 8, **compile_options):
    """Compile ``fn`` (a function or module) on its first call; guard and recompile after.

    ``dynamic=None`` starts static and makes a dimension symbolic once its size
    changes; ``True`` traces every size symbolically; ``False`` never does.
    ``compile_options``: the fields of ``aotgrad.options.CompileOptions`` (``fw_compiler``,
    ``partitioner`` ...), or one ``options=CompileOptions(...)``.
    Usable as ``@aotgrad.jit`` or ``aotgrad.jit(model, dynamic=True)``.
    """
    check_options(compile_options)
    if fn is None:
        return lambda f: jit(f, dynamic=dynamic, recompile_limit=recompile_limit, **compile_options)
    name = root_name(fn, depth=1)
    try:
        root = step_root(fn)
        if root is not None:        # a whole training step (inputs/step.py)
            return Jit(root, dynamic, compile_options, recompile_limit, name=name, around=root.around)
    except errors.GraphBreakError as e:     # a whole step with a fused optimizer, FSDP's hooks: Dynamo splits there
        handed = Jit(fn, dynamic, compile_options, recompile_limit, name=name)
        handed.handoff = hand_off(fn, e, handed.options, dynamic)
        return handed
    return Jit(fn, dynamic, compile_options, recompile_limit, name=name)
