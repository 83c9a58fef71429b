"""The options of a compile, in one frozen object shared by every entry point.

``Captured.compile``, ``aotgrad.jit``, the ``torch.compile`` backend and the disk
cache's key all read a :class:`CompileOptions`; each field's ``metadata`` says
whether it is part of the cache key. Unknown names and unusable values fail
here, when the options are given, never in the middle of a compile.

This module sits in the lowest layer: compiler names are checked against the
registry by the layers that know it (``frontend.jit_options``, ``backends.get``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields

from .errors import OptionError, caller_line

PARTITIONERS = ("auto", "default", "min_cut")

# Names users bring from torch.compile and similar APIs, and the option they mean here.
MEANT = {"backend": "fw_compiler", "compiler": "fw_compiler", "mode": "fw_compiler",
         "dynamic_shapes": "dynamic", "budget": "memory_budget"}


def _key(doc: str) -> dict:
    return {"cache_key": True, "doc": doc}


@dataclass(frozen=True)
class CompileOptions:
    """How a captured step is partitioned and compiled.

    ``partitioner="auto"`` (the default) is ``"min_cut"`` when a ``memory_budget`` is given
    and ``"default"`` otherwise; ``"default"`` with a budget is refused (it has no budget).
    """
    fw_compiler: object = field(default="eager", metadata=_key("forward graph compiler: a registered name or callable"))
    bw_compiler: object = field(default=None, metadata=_key("backward graph compiler; None: the forward's"))
    partitioner: object = field(default="auto", metadata=_key("'auto', 'default', 'min_cut' or a callable"))
    memory_budget: object = field(default=None, metadata=_key("fraction (0..1] of the default partition's "
                                                              "saved bytes, or a byte count"))

    def __post_init__(self):
        p, budget = self.partitioner, self.memory_budget
        if not callable(p) and p not in PARTITIONERS:
            raise OptionError(f"partitioner={p!r} is not a partitioner; choose one of {PARTITIONERS} "
                              "or pass a function", user_line=caller_line())
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0 \
                    or (isinstance(budget, float) and budget > 1):
                raise OptionError(f"memory_budget={budget!r}: give a fraction in (0, 1] or a byte count > 0",
                                  user_line=caller_line())
            if p != "auto" and p != "min_cut":
                raise OptionError(f"memory_budget={budget!r} needs partitioner='min_cut' (or 'auto'); "
                                  f"partitioner={p!r} has no budget", user_line=caller_line())

    @classmethod
    def of(cls, api: str = "compile", extra: tuple = (), **options) -> "CompileOptions":
        """Build from keyword options, refusing unknown names with the closest known one.
        ``extra``: names the calling API takes besides these (named in the message)."""
        known = names()
        for key, value in options.items():
            if key not in known:
                meant = MEANT.get(key) or next(iter(difflib.get_close_matches(key, known + list(extra), 1)), None)
                hint = f"; did you mean {meant}={value!r}?" if meant else ""
                raise OptionError(f"{api} got an unknown option {key}={value!r} (it takes "
                                  f"{', '.join(list(extra) + known)}){hint}", user_line=caller_line())
        return cls(**options)

    def resolved_partitioner(self):
        """The partitioner ``partition.get`` is asked for: ``"auto"`` made concrete."""
        if self.partitioner == "auto":
            return "min_cut" if self.memory_budget is not None else "default"
        return self.partitioner

    def cache_key(self) -> dict:
        """The fields that are part of the cache key, by name (``"auto"`` made concrete: the same compile)."""
        key = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("cache_key")}
        if "partitioner" in key:
            key["partitioner"] = self.resolved_partitioner()
        return key

    def given(self) -> dict:
        """The fields that differ from their defaults (how ``repr`` and messages show them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def __repr__(self) -> str:
        return "CompileOptions(" + ", ".join(f"{k}={v!r}" for k, v in self.given().items()) + ")"


def names() -> list:
    return [f.name for f in fields(CompileOptions)]


def as_options(options, api: str = "compile") -> CompileOptions:
    """A ``CompileOptions`` from one, or from a dict of keyword options."""
    return options if isinstance(options, CompileOptions) else CompileOptions.of(api, **dict(options or {}))
