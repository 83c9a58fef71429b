"""Descriptors name every input and output of the joint graph, as small typed values.

A descriptor says what a graph value *is* (a parameter, the tangent of an output, the
gradient of a parameter), so code asks ``d.is_state()`` or reads ``d.of`` instead of
parsing text. ``str(d)`` is how printing, ``explain`` and error messages name it
(``param 'h.0.attn.weight'``, ``tangent of output 0``); ``d.ident()`` the graph placeholder
name it gives (``p_h_0_attn_weight``, ``tangent_output_0``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Desc:
    """The common base: kind tests and the two names. Subclasses set ``TEXT`` (``str.format``
    of :meth:`subject`) and ``PREFIX`` (of :meth:`ident`)."""
    TEXT: ClassVar[str] = "{}"
    PREFIX: ClassVar[str] = ""

    def subject(self) -> str:
        """What the descriptor is about, as text (a name, an index, another descriptor's text)."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.TEXT.format(self.subject())

    def ident(self) -> str:
        """A Python identifier for graph node names: ``param 'h.0.w'`` -> ``p_h_0_w``."""
        return self.PREFIX + (re.sub(r"\W+", "_", self.subject()).strip("_") or "x")

    def is_param(self) -> bool:
        return isinstance(self, ParamDesc)

    def is_buffer(self) -> bool:
        return isinstance(self, BufferDesc)

    def is_state(self) -> bool:
        """A parameter or buffer: the same storage on every call."""
        return self.is_param() or self.is_buffer()

    def is_input(self) -> bool:
        """A user argument (not lifted module state)."""
        return isinstance(self, InputDesc)

    def is_output(self) -> bool:
        return isinstance(self, OutputDesc)

    def is_tangent(self) -> bool:
        return isinstance(self, TangentDesc)

    def is_grad(self) -> bool:
        return isinstance(self, GradDesc)


@dataclass(frozen=True)
class _Named(Desc):
    name: str

    def subject(self) -> str:
        return self.name


@dataclass(frozen=True)
class _Indexed(Desc):
    index: int

    def subject(self) -> str:
        return str(self.index)


@dataclass(frozen=True)
class _Of(Desc):
    of: Desc

    def subject(self) -> str:
        return str(self.of)


@dataclass(frozen=True)
class ParamDesc(_Named):
    TEXT: ClassVar[str] = "param '{}'"
    PREFIX: ClassVar[str] = "p_"


@dataclass(frozen=True)
class BufferDesc(_Named):
    TEXT: ClassVar[str] = "buffer '{}'"
    PREFIX: ClassVar[str] = "b_"


@dataclass(frozen=True)
class InputDesc(_Named):
    """A tensor argument, by its path in ``(args, kwargs)`` (``x``, ``batch['ids']``)."""


@dataclass(frozen=True)
class SavedDesc(_Named):
    """A forward value the backward reads (named after its graph node)."""
    TEXT: ClassVar[str] = "saved {}"
    PREFIX: ClassVar[str] = "saved_"


@dataclass(frozen=True)
class OutputDesc(_Indexed):
    """The user-visible output ``index`` among the forward's plain outputs."""
    TEXT: ClassVar[str] = "output {}"
    PREFIX: ClassVar[str] = "out_"


@dataclass(frozen=True)
class ViewBaseDesc(_Indexed):
    """The ``index``-th base the forward returns for outputs that are views of intermediates."""
    TEXT: ClassVar[str] = "base of views {}"
    PREFIX: ClassVar[str] = "base_views_"


@dataclass(frozen=True)
class GradDesc(_Of):
    """The gradient the backward returns for an input (``GradDesc(of=ParamDesc('fc.weight'))``)."""
    TEXT: ClassVar[str] = "grad of {}"
    PREFIX: ClassVar[str] = "grad_"


@dataclass(frozen=True)
class MutationDesc(_Of):
    """The new value of an input the function writes in place, returned for write-back."""
    TEXT: ClassVar[str] = "new value of {}"
    PREFIX: ClassVar[str] = "new_"


@dataclass(frozen=True)
class TangentDesc(Desc):
    """The incoming gradient of a forward output (``TangentDesc(output=OutputDesc(0))``)."""
    output: Desc
    TEXT: ClassVar[str] = "tangent of {}"
    PREFIX: ClassVar[str] = "tangent_"

    def subject(self) -> str:
        return str(self.output)


@dataclass(frozen=True)
class BaseDesc(Desc):
    """The synthetic base standing for aliased inputs that are written (its ``members``)."""
    members: tuple
    TEXT: ClassVar[str] = "base of {}"
    PREFIX: ClassVar[str] = "base_"

    def subject(self) -> str:
        return ", ".join(map(str, self.members))


KINDS = (ParamDesc, BufferDesc, InputDesc, SavedDesc, OutputDesc, ViewBaseDesc, GradDesc, MutationDesc,
         TangentDesc, BaseDesc)     # the classes a descriptor may have (the export format's table)
