"""The backward of a compiled function when the engine asks for a graph
(``create_graph=True``: gradient penalties, Hessian-vector products).

The compiled forward runs without autograd, so its saved activations carry no
history and the compiled backward cannot be differentiated. Instead, when the
engine records a graph, the user's program is re-run eagerly on the same
inputs (the way a checkpointed region is) and differentiated with
``create_graph=True``: the gradients then have eager's full history, second-order
terms included. The usual first-order path pays only for keeping the inputs
and their versions (``runtime.function.keep_inputs``; about 0.3 us per input),
and this module is loaded and its re-run built on the first such backward
(``compile.second_order``).
"""
from __future__ import annotations

import operator

import torch

from .. import errors
from ..ir.records import forward_values
from .modes import set_rng_states


def _restored(kept, scratch=()) -> list:
    """The call's inputs for the re-run; ``scratch`` inputs (written, their value unread) as copies,
    so the re-run's writes land nowhere (their version changed by the call's own write)."""
    primals, versions = kept
    primals = list(primals)
    for i, (p, version) in enumerate(zip(primals, versions)):
        if i in scratch:
            primals[i] = p.detach().clone()
        elif version is not None and p._version != version:
            raise errors.UnsupportedError(
                f"create_graph=True through a compiled function whose input {i} was modified in place "
                "after the call; the second-order graph would use its new value", user_line=errors.caller_line())
    return primals


_aten = torch.ops.aten
# Batch norm in training reads its running statistics only to update them: the normalized
# output and saved statistics (outputs 0-2) and the backward do not read arguments 3 and 4.
_TRAINING_BN = {_aten._native_batch_norm_legit_functional.default: 5, _aten.native_batch_norm_backward.default: 7}


def _inputs_read(n: torch.fx.Node) -> list:
    """The nodes ``n``'s value depends on."""
    base = n.args[0] if n.target is operator.getitem else n
    train = _TRAINING_BN.get(getattr(base, "target", None))
    if train is None or base.args[train] is not True or (base is not n and n.args[1] > 2):
        return n.all_input_nodes
    args = [a for k, a in enumerate(base.args) if k not in (3, 4)]
    return [a for a in args if isinstance(a, torch.fx.Node)]


def _written(captured) -> tuple[tuple, list]:
    """Inputs the program writes: ``(scratch, refused)``. A written input whose value the
    gradients do not read (BatchNorm's running statistics in training) is re-run on a copy;
    one they read, or whose metadata changes, cannot be re-run from its value after the call."""
    analysis, lay, joint = captured.analysis, captured.layout, captured.joint
    written = [i for i, info in enumerate(analysis.inputs) if info.mutates_data or info.mutates_metadata]
    if not written:
        return (), []
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    results = list(next(n for n in joint.graph.nodes if n.op == "output").args[0])
    todo = [results[k] for k in lay.tangent_of] + results[lay.n_fw:]
    read = set()
    while todo:
        n = todo.pop()
        if isinstance(n, torch.fx.Node) and n not in read:
            read.add(n)
            todo.extend(_inputs_read(n))
    refused = [str(captured.input_descs[i]) for i in written
               if placeholders[i] in read or analysis.inputs[i].mutates_metadata]
    return tuple(i for i in written if placeholders[i] not in read), refused


def differentiable_backward(captured):
    """``(kept, rng, grad_outputs) -> grads`` (one per ``grad_of``) with history."""
    setup, analysis, lay = captured.setup, captured.analysis, captured.layout
    scratch, refused = _written(captured)

    def run(kept, rng, grad_outputs):
        if refused:
            raise errors.UnsupportedError(
                f"create_graph=True through a compiled function that writes to {refused[0]}, whose value the "
                "gradients read: re-running it for the second-order graph would read the written value; "
                "compile it without the write, or run the gradient penalty eagerly", user_line=errors.caller_line())
        primals = _restored(kept, scratch)
        devices = list(range(len(rng[1]))) if rng is not None and rng[1] is not None else []
        with torch.random.fork_rng(devices=devices, enabled=rng is not None):
            if rng is not None:
                set_rng_states(rng)
            with torch.enable_grad():
                outs = setup.flat_fn(*primals)
        fw = forward_values(primals, outs, analysis)
        pairs = [(fw[k], grad_outputs[k]) for k in lay.tangent_of
                 if isinstance(fw[k], torch.Tensor) and fw[k].requires_grad and grad_outputs[k] is not None]
        wrt = [primals[i] for i in lay.grad_of]
        if not pairs:
            return [None] * len(wrt)
        return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                   create_graph=True, allow_unused=True)
    return run
