"""How a call's argument structure differs from the captured one, said by key path
(``kwargs['scale'] was absent, now given``) instead of two ``TreeSpec`` dumps."""
from __future__ import annotations

from .._torch import pytree


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
