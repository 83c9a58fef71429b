"""Descriptors name every input and output of the joint graph, as small typed values.

A descriptor says what a graph value *is* (a parameter, the tangent of an output, the
gradient of a parameter), so code asks ``d.is_state()`` or reads ``d.of`` instead of
parsing text. ``str(d)`` is how printing, ``explain`` and error messages name it
(``param 'h.0.attn.weight'``, ``tangent of output 0``); ``d.ident()`` the graph placeholder
name it gives (``p_h_0_attn_weight``, ``tangent_output_0``).

The user's side is named the same way: :func:`input_name` names one leaf of a call's
``(args, kwargs)`` by its pytree key path, and :func:`tree_difference` says how a call's
argument structure differs from the captured one (``kwargs['scale'] was absent, now given``)
instead of two ``TreeSpec`` dumps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from .._torch import pytree


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


def input_name(path) -> str:
    """How every message names one leaf of a call's ``(args, kwargs)``, by its pytree key path:
    ``input 1``, ``input 0['mask']``, ``input['past_key_values']`` (a keyword argument)."""
    top, *rest = path
    if top.idx == 0:     # the positional args tuple
        return f"input {rest[0].idx}{pytree.keystr(tuple(rest[1:]))}"
    return f"input{pytree.keystr(tuple(rest))}"


def tree_difference(was: pytree.TreeSpec, now: pytree.TreeSpec) -> str:
    """The first difference between the captured ``(args, kwargs)`` structure and this call's."""
    why = _difference(was, now, "")
    return why or "the arguments have another structure than when captured"


def _difference(was, now, path: str) -> str | None:
    if was.is_leaf() and now.is_leaf():
        return None
    if was.is_leaf() or now.is_leaf() or was.type is not now.type:
        return f"{path or 'the arguments'} {'was' if path else 'were'} {_kind(was)} when captured, now {_kind(now)}"
    if was.type is dict and was.context != now.context:
        return _keys(was.context, now.context, path)
    if was.num_children != now.num_children:
        what = "positional arguments" if path == "args" else f"items in {path}"
        return f"{was.num_children} {what} when captured, now {now.num_children}"
    if was.context != now.context:
        return f"{path} is a {was.type.__name__} with {now.context!r}, captured with {was.context!r}"
    for key, a, b in zip(_child_keys(was, path), was.children(), now.children()):
        why = _difference(a, b, key)
        if why:
            return why
    return None


def leaf_paths(spec: pytree.TreeSpec) -> list[str]:
    """Each leaf's place in the captured ``(args, kwargs)``, as ``tree_difference`` names it: ``args[1]``,
    ``args[0]['optimizer']['Adam0']['groups'][0]['eps']``."""
    out, todo = [], [(spec, "")]
    while todo:
        node, path = todo.pop()
        if node.is_leaf():
            out.append(path)
        else:
            todo.extend(reversed(list(zip(node.children(), _child_keys(node, path)))))
    return out


def _keys(was, now, path) -> str:
    for k in was:
        if k not in now:
            return f"{path}[{k!r}] was given when captured, now absent"
    for k in now:
        if k not in was:
            return f"{path}[{k!r}] was absent when captured, now given"
    return f"{path} keys come in another order ({list(now)}) than when captured ({list(was)})"


def _kind(spec) -> str:
    if spec.is_leaf():
        return "a tensor or value"
    return f"a {spec.type.__name__} of {spec.num_children}"


def _child_keys(spec, path: str) -> list[str]:
    if not path:        # the root: (args, kwargs)
        return ["args", "kwargs"]
    if spec.type is dict:
        return [f"{path}[{k!r}]" for k in spec.context]
    node = pytree.SUPPORTED_NODES.get(spec.type)
    keyed = getattr(node, "flatten_with_keys_fn", None)
    if keyed is not None and spec.type not in (list, tuple):
        try:
            children, _ = keyed(pytree.tree_unflatten([0] * spec.num_leaves, spec))
            return [path + pytree.keystr((k,)) for k, _ in children]
        except Exception:   # a node type whose keys need real values: fall back to positions
            pass
    return [f"{path}[{i}]" for i in range(spec.num_children)]
