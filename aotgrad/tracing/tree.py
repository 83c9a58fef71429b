"""A module tree walked once, as ``nn.Module``'s own walks list it.

``named_modules`` recurses through one generator per level: each module it yields resumes every
generator above it, and while a capture's read recording watches the thread each resumption is a
profile event (a 32-layer GPT's setup walked its tree six times, most of the recording's events).
:func:`places` lists the same ``(path, module)`` pairs from one loop, and :func:`members` the
parameters or buffers over them; no user code runs in either, so the caller may pause the
recording around them. Where a class has a walk of its own (``named_modules``, or the root's
``named_parameters``...), or compares or hashes by value (``named_modules`` keeps a set of them),
they answer None and :func:`own_members` runs the classes' own methods, user code the recording
watches, so what the user's code decides is what the capture gets.
"""
from __future__ import annotations

import torch

_Module = torch.nn.Module
_HASH, _EQ = _Module.__hash__, _Module.__eq__
_WALKS = ("named_modules", "named_parameters", "named_buffers", "_named_members")


def places(root: torch.nn.Module) -> list | None:
    """``list(root.named_modules(remove_duplicate=False))``: every place of the tree, a shared
    module at each of its paths, in the same order; None where a class walks its own way."""
    out, todo = [], [("", root)]
    while todo:
        prefix, m = todo.pop()
        cls = type(m)
        if cls.named_modules is not _Module.named_modules or cls.__hash__ is not _HASH or cls.__eq__ is not _EQ:
            return None
        out.append((prefix, m))
        dot = prefix + "." if prefix else ""
        todo.extend(reversed([(dot + name, sub) for name, sub in m._modules.items() if sub is not None]))
    return out


def members(root: torch.nn.Module, where: list | None, store: str, remove_duplicate: bool = True) -> list | None:
    """``[(name, tensor, owner, attr)]`` of ``store`` (``"_parameters"`` or ``"_buffers"``) as
    ``root.named_parameters(remove_duplicate=...)`` / ``named_buffers`` list them, ``where`` being
    ``places(root)``: with ``remove_duplicate``, each module once and each tensor once. None where
    a class walks its own way (``where`` None, or the root's own ``named_parameters``...)."""
    cls = type(root)
    if where is None or any(getattr(cls, w) is not getattr(_Module, w) for w in _WALKS):
        return None
    out, modules, tensors = [], set(), set()
    for prefix, m in where:
        if remove_duplicate:
            if id(m) in modules:
                continue
            modules.add(id(m))
        dot = prefix + "." if prefix else ""
        for k, v in getattr(m, store).items():
            if v is None or id(v) in tensors:
                continue
            if remove_duplicate:
                tensors.add(id(v))
            out.append((dot + k, v, m, k))
    return out


def own_members(root: torch.nn.Module, store: str, remove_duplicate: bool = True) -> list:
    """:func:`members` by the classes' own walks."""
    walk = root.named_parameters if store == "_parameters" else root.named_buffers
    found = list(walk(remove_duplicate=remove_duplicate))
    owners = dict(root.named_modules(remove_duplicate=False)) if found else {}
    out = []
    for name, t in found:
        owner, _, attr = name.rpartition(".")
        out.append((name, t, owners.get(owner) or root.get_submodule(owner), attr))
    return out
