"""Views a trace's autograd would regenerate wrongly: a view taken of a tensor before an in-place
layout change of that tensor (``v = out[1:]; out.unsqueeze_(0)``, ``t_()``, ``as_strided_()``).

Eager's view keeps its place in the storage: the layout change bumps the shared version counter
and autograd regenerates the view's history as an ``as_strided`` of its base at the view's own
size, strides and offset. A traced tensor (a functional tensor) supports no ``as_strided``, so
autograd regenerates the view by replaying the ops that made it (``slice``) on the base as it is
*now* (unsqueezed, transposed): a wrong shape (a ``TraceError``) or, where the shapes agree, a
silently wrong gradient. PyTorch's AOTAutograd does the same. Functionalization itself replays the
view's values correctly; only autograd's history is wrong, so only a base that requires grad counts.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._torch import pytree
from ..errors import MutationError, caller_line
from ..ir.ops import mutated_args

_LAST = threading.local()    # .stale: the latest layout change that made a view stale, on this thread
_KIND: dict = {}    # operator -> "view" (returns an alias, writes nothing), "layout" (t_, unsqueeze_...) or ""


def _kind(func) -> str:
    kind = _KIND.get(func)
    if kind is None:
        schema = getattr(func, "_schema", None)
        writes = schema is not None and bool(mutated_args(func))
        if torch.Tag.inplace_view in getattr(func, "tags", ()):
            kind = "layout"
        elif schema is not None and not writes and schema.returns and schema.returns[0].alias_info is not None:
            kind = "view"
        else:
            kind = ""
        _KIND[func] = kind
    return kind


def _layout(t) -> tuple:
    return (*t.shape, "/", *t.stride(), "/", t.storage_offset())


def _same(a: tuple, b: tuple) -> bool:
    """Equal layouts, compared without guarding a symbolic size (an unequal symbol counts as changed)."""
    return len(a) == len(b) and all(x is y or (type(x) is type(y) and type(x) in (int, str) and x == y)
                                    for x, y in zip(a, b))


class StaleViews:
    """The views one trace made (weakly held); those a layout change of their base made stale, and the
    check of every op that uses one. Returned as it is, a stale view is exact: the analysis rebuilds an
    output view from its base's storage at its own size, strides and offset."""

    def __init__(self):
        _LAST.stale = None      # a new trace on this thread
        # weak references, dropped dead at the next layout change (a WeakSet would compare colliding
        # tensors with ==, an op on a functional tensor outside its mode)
        self.views: list = []
        self.stale = WeakIdKeyDictionary()     # view -> (op, user line) of the layout change of its base

    def before(self, func, args, kwargs):
        """What ``after`` needs: None for all but a layout change of a base that requires grad with a live
        view of it taken before. Refuses an op that uses a stale view while autograd records."""
        if self.stale and torch.is_grad_enabled():
            self._check(func, args, kwargs)
        if _kind(func) != "layout" or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if not (x.requires_grad and torch.is_grad_enabled() and x._base is None):
            return None     # a view's layout change: the other views' base keeps its layout
        self.views = [r for r in self.views if r() is not None]
        live = [v for v in (r() for r in self.views) if v is not None and v is not x and v._base is x]
        return (x, _layout(x), live) if live else None

    def after(self, func, out, token) -> None:
        """Record a view ``func`` made; mark stale the views of a base whose layout ``func`` changed."""
        if token is not None:
            x, was, live = token
            if not _same(_layout(x), was):
                for v in live:
                    self.stale[v] = _LAST.stale = (_name(func), caller_line())
        elif isinstance(out, torch.Tensor) and _kind(func) == "view":
            self.views.append(weakref.ref(out))

    def _check(self, func, args, kwargs) -> None:
        for v in pytree.tree_leaves((args, kwargs)):
            found = self.stale.get(v) if isinstance(v, torch.Tensor) else None
            if found is not None:
                raise MutationError(
                    f"{_name(func)}() uses a view of a tensor whose layout {found[0]}() changed in place after the "
                    f"view was taken (at {found[1]}): eager's view keeps its place in the storage, but autograd "
                    "replays a traced view's history on its base's new layout (a wrong gradient or shape; "
                    "PyTorch's AOTAutograd fails the same way). Use the out-of-place op (x = x.t(), "
                    "x = x.unsqueeze(0)) or take the view after the change", user_line=caller_line())


def refusal(e: BaseException, line: str | None) -> MutationError | None:
    """The refusal for a trace that failed (``e``, at the user's ``line``) after this thread's trace made a
    view stale: autograd replaying a view on a layout it cannot take (``out.view(9)`` on a transposed
    base, ``out[1]`` on an unsqueezed one) raises inside autograd, before an op shows which view it was."""
    found = getattr(_LAST, "stale", None)
    _LAST.stale = None
    if found is None or not isinstance(e, (ValueError, IndexError, RuntimeError)):
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return MutationError(
        f"{found[0]}() changed the layout of a tensor in place (at {found[1]}) while a view of it taken before "
        "was alive, and that view is used after: eager's view keeps its place in the storage, but autograd "
        f"replays a traced view's history on its base's new layout, which fails ({type(e).__name__}: {first}; "
        "PyTorch's AOTAutograd fails the same way). Use the out-of-place op (x = x.t(), x = x.unsqueeze(0)) "
        "or take the view after the change", user_line=line)


def _name(func) -> str:
    return getattr(func, "_overloadpacket", func).__name__
