"""Input writes inside an inference graph, for a backend that fuses them (Inductor).

A graph returns the new value of each input it writes in place, and the epilogue copies it into
the input (``runtime/call.epilogue``): one more pass over the memory of every written tensor. For a
whole training step that is every parameter and every optimizer state tensor. Given
``copy_(input, new value)`` at the end of the graph instead, Inductor writes the update straight
into the input's memory from the kernel that computes it, as eager's in-place update does; the
graph returns the input itself there, and the epilogue does not copy a value onto itself.

Only plain data writes move: an input whose metadata the function also changes (``t_()``,
``resize_``) keeps its epilogue, which changes the metadata before it copies the data. None moves
for Inductor where the graph returns a copy (``clone`` and the like) of a value it computed:
Inductor drops such a copy as a no-op, returning a view of the value, and writes a written input's
chain of values in that input's memory, so the returned "copy" would be the input's memory and
change with its later writes (an optimizer's first ``momentum_buffer = clone(grad)`` of a
``.grad`` that views a flat buffer, which ``zero_grad`` then zeroes: PyTorch 2.13's Inductor).

``early=True`` (the eager backend, which frees each value after its last use) also brings each
write forward, right after its value and the last node that reads the input or any view of it (by
the operators' schemas): a whole training step's optimizer then holds each new parameter and state
value only until its write, as eager's in-place update does, instead of every one of them until the
epilogue. The computations themselves keep their traced order (run inside the backward, an update
would add its temporaries to the backward's peak). A functional ``_foreach_*`` op whose first list
holds written inputs runs as its in-place twin where nothing needs their values any more
(``_foreach_in_place``): the ``foreach`` optimizers' update needs no second copy of their state.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch import OpOverload
from .cleanup import copy_module

_COPY = torch.ops.aten.copy_.default


def writes_in_graph(gm: fx.GraphModule, analysis, early: bool = False) -> fx.GraphModule:
    """A copy of the inference graph ``gm`` that writes its data mutations into its inputs and returns
    those inputs in place of the new values (``gm`` itself when it writes none); ``early``: each
    write as soon as it can run (module docstring)."""
    written = [(k, i) for k, i in enumerate(i for i, info in enumerate(analysis.inputs) if info.mutates_data)
               if not analysis.inputs[i].mutates_metadata and analysis.inputs[i].storage_resize is None]
    if not written or not early and _returns_copies(gm):
        return gm
    new = copy_module(gm)
    inputs = new.graph.find_nodes(op="placeholder")
    out = new.graph.find_nodes(op="output")[0]
    values = list(out.args[0])
    for k, i in written:
        x, value = inputs[i], values[k]
        want, got = x.meta.get("val"), getattr(value, "meta", {}).get("val")
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) \
                or (want.shape, want.dtype, want.device) != (got.shape, got.dtype, got.device):
            continue
        with new.graph.inserting_before(out):
            write = new.graph.call_function(_COPY, (x, value))
        write.meta["val"] = want
        values[k] = write
    out.args = (type(out.args[0])(values),)
    if early:
        _foreach_in_place(new.graph)
        _bring_forward(new.graph)
    new.recompile()
    return new


# What Inductor may drop as a no-op copy (its ``noop_registry``).
_COPIES = frozenset({*(getattr(torch.ops.aten, name).default for name in ("clone", "alias", "copy", "_to_copy")),
                     torch.ops.prims.convert_element_type.default})


def _returns_copies(gm: fx.GraphModule) -> bool:
    """Whether the graph returns a copy of a value it computed (not of an input)."""
    out = gm.graph.find_nodes(op="output")[0]
    return any(isinstance(v, fx.Node) and v.target in _COPIES and isinstance(v.args[0], fx.Node)
               and v.args[0].op != "placeholder" for v in out.args[0])


def _foreach_in_place(graph: fx.Graph) -> None:
    """Run a functional ``_foreach_*`` op in place (its ``_foreach_*_`` twin) on the written inputs its
    first list holds, where nothing reads their current values after it and each input's final write
    is of that chain's last value: the optimizer's ``foreach`` update then needs no second list of
    every state tensor, as eager's in-place ``_foreach_mul_`` does not. The writes of such values
    become no-ops and go; the graph returns the input itself."""
    writes = {n.args[0]: n for n in graph.nodes if n.op == "call_function" and n.target is _COPY
              and n.args[0].op == "placeholder"}
    position = {n: k for k, n in enumerate(graph.nodes)}
    home = {p: p for p in writes}       # value node -> the written input whose memory holds it
    done = []
    for n in list(graph.nodes):
        twin = _in_place_twin(n)
        if twin is None or not isinstance(n.args[0], (list, tuple)):
            continue
        elements = list(n.args[0])
        targets = [home.get(e) for e in elements]
        items = [u for u in n.users]
        if None in targets or len(set(targets)) != len(targets) or \
                any(u.target is not operator.getitem or not isinstance(u.args[1], int) for u in items):
            continue
        if any(position[r] > position[n] and r is not n and a is not writes[t] and not (r is writes[t] and a is t)
               for e, t in zip(elements, targets) for a in _aliases(e) for r in a.users):
            continue            # a current value is read after the op (the final write's value is too)
        if _reads_across(n, targets, home):
            continue            # element i would read what element j already overwrote
        for u in items:
            home[u] = targets[u.args[1]]
        done.append((n, twin, targets))
    for n, twin, targets in done:
        n.target = twin
        n.args = (list(targets), *n.args[1:])
        n.meta.pop("val", None)
        for u in list(n.users):
            u.replace_all_uses_with(targets[u.args[1]])
            graph.erase_node(u)
    for w in writes.values():
        if w.args[1] is w.args[0]:      # the chain ran in the input itself
            w.replace_all_uses_with(w.args[0])
            graph.erase_node(w)


def _reads_across(n: fx.Node, targets: list, home: dict) -> bool:
    """Whether an argument of ``n`` other than its first list reads the memory of one of ``targets``
    anywhere but at its own index (directly or through a view)."""
    def held(a):
        while a not in home and a.op == "call_function" and _may_alias(a.target) and a.args \
                and isinstance(a.args[0], fx.Node):
            a = a.args[0]
        return home.get(a)
    for arg in (*n.args[1:], *n.kwargs.values()):
        if isinstance(arg, fx.Node) and held(arg) in targets:
            return True
        if isinstance(arg, (list, tuple)):
            for j, a in enumerate(arg):
                if isinstance(a, fx.Node) and held(a) in targets and targets.index(held(a)) != j:
                    return True
    return False


def _in_place_twin(n: fx.Node):
    """``aten._foreach_X_.overload`` for a functional ``aten._foreach_X.overload`` node, else None."""
    t = n.target
    if n.op != "call_function" or not isinstance(t, OpOverload):
        return None
    name = t._schema.name
    if not name.startswith("aten::_foreach_") or name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name.split("::")[1] + "_", None)
    return getattr(packet, t._overloadname, None) if packet is not None else None


def _bring_forward(graph: fx.Graph) -> None:
    """Move each input write right after the later of its value and the last other node that reads
    its input's memory (the input or a view of it). Nothing else moves: writes read only their input
    and value, so the other nodes keep the order they were traced in."""
    writes = [n for n in graph.nodes if n.op == "call_function" and n.target is _COPY and n.args[0].op == "placeholder"]
    position = {n: k for k, n in enumerate(graph.nodes)}
    for w in writes:
        x, value = w.args
        readers = [u for a in _aliases(x) for u in a.users if u is not w and u.op != "output"]
        anchor = max([value, *readers], key=position.__getitem__)
        if anchor.next is not w:
            anchor.append(w)


def _aliases(x: fx.Node) -> set:
    """``x`` and every node whose value may share its memory: views of it and of those, by the
    operators' schemas (a loaded graph's fake values do not tell which share a storage); a target
    without a schema counts as a view."""
    found, todo = {x}, [x]
    while todo:
        for u in todo.pop().users:
            if u not in found and u.op == "call_function" and _may_alias(u.target):
                found.add(u)
                todo.append(u)
    return found


def _may_alias(target) -> bool:
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def keep_written_originals(joint: fx.GraphModule, lay) -> int:
    """A copy, made in the forward, of each input the epilogue writes whose value before the write the
    backward reads (``x.mul_(w)`` on an input that does not require grad: ``w``'s gradient needs the old
    ``x``), in place; returns how many. Saved as the input itself, or a view of it, the backward would
    read the caller's tensor after the write: the new values, and a bumped version. Eager's autograd
    saves a copy of the original there too. (An input that requires grad is written through a copy
    already: ``capture.joint``.)"""
    from ..ir.ops import RUNS_IN_FORWARD
    from ..partition.default import forward_nodes, placeholders, views_of
    if lay.is_inference or not lay.mutated:
        return 0
    fw, primals, done = forward_nodes(joint, lay), placeholders(joint.graph), 0
    for i in lay.mutated:
        p = primals[i]
        # the input and every view of it, read in the backward (or made there)
        if all(n in fw and all(u in fw or u.op == "output" for u in n.users) for n in views_of([p])):
            continue
        with joint.graph.inserting_after(primals[-1]):
            copy = joint.graph.call_function(torch.ops.aten.clone.default, (p,))
        copy.meta.update(val=p.meta["val"].clone(), **{RUNS_IN_FORWARD: True})
        p.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy and u.op != "output")
        done += 1
    if done:
        joint.recompile()
    return done
