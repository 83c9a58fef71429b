"""The options of a compile, in one frozen object shared by every entry point.

``Captured.compile``, ``aotgrad.jit``, the ``torch.compile`` backend and the disk
cache's key all read a :class:`CompileOptions`; each field's ``metadata`` says
whether it is part of the cache key. Unknown names and unusable values fail
here, when the options are given, never in the middle of a compile.

This module sits in the lowest layer: compiler names are checked against the
registry by the layers that know it (``inputs.jit_options``, ``backends.get``).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import re
from dataclasses import dataclass, field, fields

from .errors import OptionError, caller_line

PARTITIONERS = ("auto", "default", "min_cut")

# Names users bring from torch.compile and similar APIs, and the option they mean here.
MEANT = {"backend": "fw_compiler", "compiler": "fw_compiler", "mode": "fw_compiler",
         "dynamic_shapes": "dynamic", "budget": "memory_budget"}


def _key(doc: str) -> dict:
    return {"cache_key": True, "doc": doc}


def refuse_unknown(api: str, options: dict, known: list, extra: tuple = (), meant_by=None) -> None:
    """An ``OptionError`` for the first name not in ``known``, naming the closest known one."""
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(key, known + list(extra), 1)
            meant = (meant_by or {}).get(key) or (close[0] if close else None)
            hint = f"; did you mean {meant}={value!r}?" if meant else ""
            raise OptionError(f"{api} got an unknown option {key}={value!r} (it takes "
                              f"{', '.join(list(extra) + known)}){hint}", user_line=caller_line())


def keywords_checked(api: str):
    """Decorate a public function or method so that a keyword it does not take is an ``OptionError``
    naming the closest one it does (as ``refuse_unknown``), not Python's ``TypeError``: one rule for every
    keyword entry point. A function taking ``**kwargs`` (they are the user's) is left as it is."""
    def wrap(fn):
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return fn
        known = [n for n, p in params.items() if n != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            if kwargs.keys() - params.keys():
                refuse_unknown(api, {k: v for k, v in kwargs.items() if k not in params}, known, (), MEANT)
            return fn(*args, **kwargs)
        return checked
    return wrap


def _count(v, least: int) -> bool:
    return type(v) is int and v >= least


@dataclass(frozen=True)
class CudaGraphsOptions:
    """The ``"cudagraphs"`` compiler's options: ``CompileOptions(fw_compiler="cudagraphs",
    cudagraphs={"max_recordings": 4})`` (``aotgrad.backends.cudagraphs.Config`` is this class)."""
    warmup: int = 1                      # eager calls per input shape before recording
    max_recordings: int = 8              # recordings kept per graph (LRU order)
    on_full: str = "eager"               # past the bound: "eager" runs new shapes eagerly, "evict" drops the LRU
    static_input_indices: tuple = ()     # inputs used in place, besides parameters/buffers
    runner: str = "auto"                 # "auto" (cuda when inputs are on CUDA), "cuda" or "null"

    def __post_init__(self):
        if isinstance(self.static_input_indices, list):
            object.__setattr__(self, "static_input_indices", tuple(self.static_input_indices))
        for name, allowed in (("on_full", ("eager", "evict")), ("runner", ("auto", "cuda", "null"))):
            if getattr(self, name) not in allowed:
                raise OptionError(f"cudagraphs {name}={getattr(self, name)!r}; expected one of {allowed}",
                                  user_line=caller_line())
        if not (_count(self.warmup, 0) and _count(self.max_recordings, 1)
                and type(self.static_input_indices) is tuple and all(_count(i, 0) for i in self.static_input_indices)):
            raise OptionError(f"cudagraphs needs integers warmup >= 0 (got {self.warmup!r}), max_recordings >= 1 "
                              f"(got {self.max_recordings!r}) and static_input_indices >= 0 "
                              f"(got {self.static_input_indices!r})", user_line=caller_line())

    @classmethod
    def of(cls, api: str = "the cudagraphs compiler", /, **options) -> "CudaGraphsOptions":
        refuse_unknown(api, options, [f.name for f in fields(cls)])
        return cls(**options)

    def __repr__(self) -> str:
        return _repr(self)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def budget_kind(budget) -> tuple[str, object]:
    """A memory budget read: ``("fraction", f)``, ``f`` in [0, 1] of the default partition's saved
    bytes (a float, or the int 0 or 1), or ``("peak", n)``, a predicted peak of ``n`` bytes (an int
    above 1, or text: ``"4MB"``, ``"512KiB"``, ``"1.5GB"``; kB/MB/GB are powers of 1000, KiB/MiB/GiB
    of 1024). Anything else is an ``OptionError``."""
    if isinstance(budget, str):
        m = _SIZE.fullmatch(budget)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if unit is not None and int(float(m.group(1)) * unit) > 1:
            return "peak", int(float(m.group(1)) * unit)
    elif isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        return ("peak", budget) if budget > 1 else ("fraction", float(budget))
    elif isinstance(budget, float) and 0 <= budget <= 1:
        return "fraction", budget
    raise OptionError(f"memory_budget={budget!r}: give a fraction of the default's saved bytes (a float in "
                      f"[0, 1]) or a peak in bytes (an int above 1, or text such as '4MB', '512KiB')",
                      user_line=caller_line())


def _repr(options) -> str:
    """The fields that differ from their defaults: one short line."""
    given = {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) != f.default}
    return f"{type(options).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in given.items()) + ")"


@dataclass(frozen=True)
class CompileOptions:
    """How a captured step is partitioned and compiled.

    ``partitioner="auto"`` (the default) is ``"min_cut"`` when a ``memory_budget`` is given or
    Inductor compiles a half (it fuses what the backward recomputes; the min cut never saves more
    than ``"default"``, and is torch.compile's own choice for Inductor), and ``"default"``
    otherwise; ``"default"`` with a budget is refused (it has no budget).
    """
    fw_compiler: object = field(default="eager", metadata=_key("forward graph compiler: a registered name or callable"))
    bw_compiler: object = field(default=None, metadata=_key("backward graph compiler; None: the forward's"))
    partitioner: object = field(default="auto", metadata=_key("'auto', 'default', 'min_cut' or a callable"))
    memory_budget: object = field(default=None, metadata=_key("fraction [0..1] of the default partition's "
                                                              "saved bytes, or a peak in bytes (int > 1, '4MB')"))
    cudagraphs: object = field(default=None, metadata=_key("the 'cudagraphs' compiler's options: a dict of "
                                                           "CudaGraphsOptions fields (or one)"))

    def __post_init__(self):
        p, budget = self.partitioner, self.memory_budget
        if not callable(p) and p not in PARTITIONERS:
            raise OptionError(f"partitioner={p!r} is not a partitioner; choose one of {PARTITIONERS} "
                              "or pass a function", user_line=caller_line())
        if budget is not None:
            budget_kind(budget)
            if p != "auto" and p != "min_cut":
                raise OptionError(f"memory_budget={budget!r} needs partitioner='min_cut' (or 'auto'); "
                                  f"partitioner={p!r} has no budget", user_line=caller_line())
        self._check_cudagraphs()

    def _check_cudagraphs(self):
        cg = self.cudagraphs
        if cg is None:
            return
        if isinstance(cg, dict):
            cg = CudaGraphsOptions.of("the cudagraphs compiler", **cg)
            object.__setattr__(self, "cudagraphs", cg)     # frozen: normalised once, here
        if not isinstance(cg, CudaGraphsOptions):
            raise OptionError(f"cudagraphs={cg!r}: give a dict of the cudagraphs compiler's options, e.g. "
                              "{'max_recordings': 4}", user_line=caller_line())
        if not self.compiles_with("cudagraphs"):
            raise OptionError(f"cudagraphs={cg!r} is given but neither fw_compiler={self.fw_compiler!r} nor "
                              f"bw_compiler={self.bw_compiler!r} is 'cudagraphs'; name it there",
                              user_line=caller_line())

    @classmethod
    def of(cls, api: str = "compile", extra: tuple = (), **options) -> "CompileOptions":
        """Build from keyword options, refusing unknown names with the closest known one.
        ``extra``: names the calling API takes besides these (named in the message)."""
        refuse_unknown(api, options, names(), extra, MEANT)
        return cls(**options)

    def compiles_with(self, name: str) -> bool:
        """Whether the registered compiler ``name`` compiles the forward or the backward."""
        return any(isinstance(c, str) and c == name for c in (self.fw_compiler, self.bw_compiler))

    def resolved_partitioner(self):
        """The partitioner ``partition.get`` is asked for: ``"auto"`` made concrete."""
        if self.partitioner == "auto":
            return "min_cut" if self.memory_budget is not None or self.compiles_with("inductor") else "default"
        return self.partitioner

    def cache_key(self) -> dict:
        """The fields that are part of the cache key, by name (``"auto"`` made concrete: the same compile)."""
        key = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("cache_key")}
        if "partitioner" in key:
            key["partitioner"] = self.resolved_partitioner()
        if key.get("cudagraphs") is not None:
            key["cudagraphs"] = repr(key["cudagraphs"])     # a plain value; the repr names every given field
        return key

    def given(self) -> dict:
        """The fields that differ from their defaults (how ``repr`` and messages show them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def __repr__(self) -> str:
        return _repr(self)


def names() -> list:
    return [f.name for f in fields(CompileOptions)]


def _checked_init(cls, meant_by=None):
    """Give ``cls`` (a dataclass) an ``__init__`` that refuses a misspelt keyword with an ``OptionError``
    naming the closest field, as every keyword entry point does, instead of Python's ``TypeError``."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        known = [f.name for f in fields(cls)]
        refuse_unknown(cls.__name__, kwargs, known, (), meant_by)
        if len(args) > len(known):
            raise OptionError(f"{cls.__name__} takes at most {len(known)} positional options "
                              f"({', '.join(known)}); got {len(args)}", user_line=caller_line())
        init(self, *args, **kwargs)
    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    cls.__init__ = __init__
    return cls


_checked_init(CudaGraphsOptions)
_checked_init(CompileOptions, MEANT)


def as_options(options, api: str = "compile") -> CompileOptions:
    """A ``CompileOptions`` from one, or from a dict of keyword options."""
    return options if isinstance(options, CompileOptions) else CompileOptions.of(api, **dict(options or {}))
