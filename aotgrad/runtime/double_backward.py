"""The backward of a compiled function when the engine asks for a graph
(``create_graph=True``: gradient penalties, Hessian-vector products).

The compiled forward runs without autograd, so its saved activations carry no
history and the compiled backward cannot be differentiated. Instead, when the
engine records a graph, the user's program is re-run eagerly on the same
inputs (the way a checkpointed region is) and differentiated with
``create_graph=True``: the gradients then have eager's full history, second-order
terms included. The usual first-order path pays only for keeping the inputs
and their versions (see :func:`keep_inputs`; about 0.3 us per input).
"""
from __future__ import annotations

import torch

from .. import errors
from ..analysis.ops import is_random
from ..capture.joint import forward_values


def keep_inputs(primals) -> tuple:
    """What ``ctx`` keeps of the inputs: the inputs themselves (they live as long as the
    function's autograd node, as ``ctx.x = x`` in a custom Function does) and their
    versions, to notice an in-place write between the call and the second-order backward."""
    try:
        return primals, [p._version for p in primals]
    except AttributeError:      # sizes among the inputs (Dynamo passes SymInts/ints)
        return primals, [p._version if isinstance(p, torch.Tensor) else None for p in primals]


def _restored(kept) -> tuple:
    primals, versions = kept
    for i, (p, version) in enumerate(zip(primals, versions)):
        if version is not None and p._version != version:
            raise errors.UnsupportedError(
                f"create_graph=True through a compiled function whose input {i} was modified in place "
                "after the call; the second-order graph would use its new value", user_line=errors.caller_line())
    return primals


def rng_states() -> tuple:
    """The global RNG states (CPU and initialised CUDA devices) a forward started from."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(states) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def differentiable_backward(captured):
    """``(kept, rng, grad_outputs) -> grads`` (one per ``grad_of``) with history, and whether the
    forward must record its RNG state for it (the program draws random numbers)."""
    setup, analysis, lay = captured.setup, captured.analysis, captured.layout
    writes = [str(captured.input_descs[i]) for i, info in enumerate(analysis.inputs)
              if info.mutates_data or info.mutates_metadata]
    random = any(is_random(n) for n in captured.joint.graph.nodes)

    def run(kept, rng, grad_outputs):
        if writes:
            raise errors.UnsupportedError(
                f"create_graph=True through a compiled function that writes to {writes[0]}: re-running it "
                "for the second-order graph would write again; compile it without the write, or run "
                "the gradient penalty eagerly", user_line=errors.caller_line())
        primals = _restored(kept)
        n_specs = len(setup.out_specs)
        devices = list(range(len(rng[1]))) if rng is not None and rng[1] is not None else []
        with torch.random.fork_rng(devices=devices, enabled=rng is not None):
            if rng is not None:
                _set_rng(rng)
            with torch.enable_grad():
                outs = setup.flat_fn(*primals)
        del setup.out_specs[n_specs:]       # flat_fn records each call's output structure
        fw = forward_values(primals, outs, analysis)
        pairs = [(fw[k], grad_outputs[k]) for k in lay.tangent_of
                 if isinstance(fw[k], torch.Tensor) and fw[k].requires_grad and grad_outputs[k] is not None]
        wrt = [primals[i] for i in lay.grad_of]
        if not pairs:
            return [None] * len(wrt)
        return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                   create_graph=True, allow_unused=True)
    return run, random
