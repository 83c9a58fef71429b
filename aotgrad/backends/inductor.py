"""``"inductor"``: hand one of our forward/backward graphs to Inductor's graph
compiler (``compile_fx_inner``), the layer below its own aot_autograd path.

Inductor is imported only when this backend compiles something: importing it
costs seconds. If Inductor rejects a graph, that graph runs eagerly and a
warning says why; the other graph of the pair is unaffected.
"""
from __future__ import annotations

import warnings

import torch.fx as fx

from ..partition.graphs import distinct_examples
from ..scoped import FX_TRACING
from .graph_info import info_of


def _is_backward(gm: fx.GraphModule) -> bool:
    return info_of(gm).kind == "backward"


def _decompose(gm: fx.GraphModule, example_inputs: list, fake_mode) -> fx.GraphModule:
    """Retrace with Inductor's decomposition table: its lowerings assume it ran."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from .._torch import inductor_api
    select_decomp_table = inductor_api()[2]

    with FX_TRACING, fake_mode:
        return make_fx(gm, decomposition_table=select_decomp_table(),
                       _allow_non_fake_inputs=True)(*example_inputs)


def _compile(gm: fx.GraphModule, example_inputs: list):
    from .._torch import TracingContext, detect_fake_mode, inductor_api, tracing
    config, compile_fx_inner, _ = inductor_api()

    fake_mode = detect_fake_mode(example_inputs)
    # A graph handed to this backend directly may give two placeholders one example object.
    example_inputs = distinct_examples(example_inputs)
    decomposed = _decompose(gm, example_inputs, fake_mode)
    # fallback_random: random ops draw from the eager RNG, so dropout masks
    # match eager's for the same seed (Inductor's own RNG would not).
    # layout_optimization off: it would give saved tensors (channels-last)
    # strides other than those the backward graph was traced with.
    with tracing(TracingContext(fake_mode)), config.patch(fallback_random=True,
                                                          layout_optimization=False):
        compiled = compile_fx_inner(decomposed, list(example_inputs), is_backward=_is_backward(gm))

    # Inductor's convention is one boxed list it clears as it frees inputs; a backward
    # is handed its list directly (``_boxed_call``) so saved activations die early.
    if _is_backward(gm):
        def run_boxed(args):
            return tuple(compiled(args))
        run_boxed._boxed_call = True
        return run_boxed

    def run(*args):
        return tuple(compiled(list(args)))
    return run


def inductor(gm: fx.GraphModule, example_inputs: list):
    """Compile ``gm`` with Inductor; fall back to running it eagerly on failure."""
    if any(n.op == "call_function" and getattr(n.target, "namespace", None) == "aotgrad" for n in gm.graph.nodes):
        # aotgrad::rng_state/set_rng_state order RNG effects that Inductor drops or reorders.
        warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because it saves and "
                      "restores the RNG state (torch.random.fork_rng inside the function)", stacklevel=2)
        return gm.forward
    try:
        return _compile(gm, example_inputs)
    except Exception as e:  # noqa: BLE001 - any Inductor failure means "run this graph eagerly"
        warnings.warn(f"aotgrad inductor backend: running {type(gm).__name__} eagerly because "
                      f"Inductor failed on it: {type(e).__name__}: {e}", stacklevel=2)
        return gm.forward
