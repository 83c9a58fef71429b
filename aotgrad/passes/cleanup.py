"""Clean-up passes run on every joint graph.

Each public pass is pure: it copies the graph (sharing node metadata) and
edits the copy. ``simplify`` runs them all on one copy, which is what capture
uses, because copying and regenerating code dominate on large graphs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import copy_graph, lazy_graph_module
from ..ir.ops import has_side_effect


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module to edit; node metadata (fake values) is shared, not deep-copied. Its
    Python code is written when first read or run (``lazy_graph_module``): a pass edits the copy and
    calls ``recompile()``, and most copies (the joint a partitioner reads) are never run at all, so
    writing the code on copying and again per edit was a deep model's largest compile cost."""
    g = fx.Graph()
    out = copy_graph(g, gm.graph, {})
    g.output(out)
    new = lazy_graph_module(gm, g, type(gm).__name__)
    new.meta.update(getattr(gm, "meta", {}))
    return new


def _drop_detach(g: fx.Graph) -> None:
    """Detach, and alias read only inside the graph (torch 2.14.1's make_fx writes detach as alias
    when traced without a decomposition table): in a functional graph both only rename a value.
    An alias the graph returns stays, so an output is not merged with another output or an input."""
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
        elif n.target is torch.ops.aten.alias.default:
            n.replace_all_uses_with(n.args[0], delete_user_cb=lambda u: u.op != "output")
            if not n.users:
                g.erase_node(n)


def drop_dead(g: fx.Graph) -> None:
    g.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or has_side_effect(n))


def _pure(*edits):
    def run(gm: fx.GraphModule) -> fx.GraphModule:
        gm = copy_module(gm)
        for edit in edits:
            edit(gm.graph)
        gm.recompile()
        return gm
    return run


eliminate_dead_code = _pure(drop_dead)
eliminate_dead_code.__name__ = "eliminate_dead_code"
eliminate_dead_code.__doc__ = """Drop nodes nothing uses, keeping random ops so the RNG advances as in eager.

    ``a = relu(x); b = sin(x); return a``  ->  ``a = relu(x); return a``
    """

remove_detach = _pure(_drop_detach)
remove_detach.__name__ = "remove_detach"
remove_detach.__doc__ = """Replace ``detach(x)`` (and an ``alias(x)`` not returned) by ``x``: graphs run without
    autograd, so detach only renames.

    ``d = detach(r); y = threshold_backward(g, d)``  ->  ``y = threshold_backward(g, r)``
    """

simplify = _pure(_drop_detach, drop_dead)
simplify.__name__ = "simplify"
simplify.__doc__ = "``remove_detach`` then ``eliminate_dead_code``, on one copy."


def simplify_owned(gm: fx.GraphModule) -> fx.GraphModule:
    """``simplify`` in place, for a graph module its caller just made and shares with
    no one (capture's fresh joint): copying and regenerating code twice cost more
    than the edits on a large graph."""
    _drop_detach(gm.graph)
    drop_dead(gm.graph)
    gm.recompile()
    return gm
