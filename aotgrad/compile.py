"""Stage 1 -> stage 2: partition the joint graph, compile both halves and
wrap them into a callable that behaves like the user's function.

``compile_parts`` returns what a ``Compiled`` holds; ``Captured.compile`` builds the
stage object, so this layer sits below ``stages`` and never imports it."""
from __future__ import annotations

from dataclasses import replace

import torch

from . import backends, partition
from .backends.graph_info import GraphInfo
from .ir.ops import is_random
from .ir.descriptors import SavedDesc
from .observe import timed
from .partition.blocks import inline_calls
from .partition.default import distinct_examples
from .passes.compact_saved import compact_saved
from .passes.input_writes import writes_in_graph
from .passes.views import fold_views
from .passes.zero_tangents import zero_tangents, zeroable
from .options import CompileOptions
from .runtime.call import eager_layout, make_call
from .runtime.modes import without_autocast
from .runtime.regions import DONE as REGIONS_DONE
from .runtime.hooks import input_hooks, retained_outputs, returned_inputs
from .runtime.function import autograd_function, fast_apply, retaining, saved_input_views, version_checks
from .scoped import GC_PAUSED


def _examples(gm, compiler) -> list:
    """The placeholders' values, for a compiler that may retrace with them: one example per
    placeholder (copies of a block template share their values, and make_fx maps examples to inputs
    by object). The eager backend reads none of them."""
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return values if compiler is backends.eager else distinct_examples(values)


def graph_info(captured, kind: str, part=None, function_id: int = 0) -> GraphInfo:
    """What the compiler of ``captured``'s ``kind`` graph is told (``part``: the partition)."""
    lay, descs = captured.layout, captured.input_descs
    if kind == "backward":
        names = tuple(str(SavedDesc(n)) for n in part.saved) + tuple(str(descs[lay.n_primals + k])
                                                               for k in range(len(lay.tangent_of)))
        # A parameter or buffer the forward saves as it is keeps its storage too.
        primal_names = [n.name for n in captured.joint.graph.nodes if n.op == "placeholder"][:lay.n_primals]
        kept = {primal_names[i] for i, d in enumerate(descs[:lay.n_primals]) if d.is_state()}
        static = tuple(k for k, n in enumerate(part.saved) if n in kept)
        return GraphInfo(kind, names, static, (), (), function_id, tuple(range(len(part.saved))))
    primals = descs[:lay.n_primals]
    static = tuple(i for i, d in enumerate(primals) if d.is_state())
    saved = tuple(range(lay.n_fw, lay.n_fw + len(part.saved))) if part is not None else ()
    return GraphInfo(kind, tuple(map(str, primals)), static, tuple(captured.analysis.mutated()),
                     saved, function_id)


def _compile(compiler, gm, info: GraphInfo, step: dict | None = None):
    """``compiler``'s function of ``gm``; ``step``: the history step's info, which gets the copies of
    repeated blocks the backend called one compiled function for (``blocks compiled once``)."""
    gm.meta["aotgrad"] = info
    gm.meta.pop(REGIONS_DONE, None)     # a graph compiled again (a stored partition) says it anew
    fn = compiler(gm, _examples(gm, compiler))
    if step is not None and gm.meta.get(REGIONS_DONE):
        step["blocks compiled once"] = gm.meta[REGIONS_DONE]
    return without_autocast(fn, backward=info.kind == "backward")


def _for(compiler, gm):
    """``gm`` as ``compiler`` takes it: the eager backend runs calls of a repeated block's halves
    (one Python function per half, for every layer); any other compiler gets their nodes copied in
    (``runtime.regions`` finds the copies for those that compile a block once)."""
    return gm if compiler is backends.eager else inline_calls(gm)


def _with_grad(run):
    def run_with_grad(flat):
        with torch.enable_grad():
            return run(flat)
    return run_with_grad


def compile_parts(captured, options: CompileOptions) -> tuple:
    """``(partition, forward graph, backward graph, call path, history)`` of ``captured`` compiled."""
    with GC_PAUSED():
        return _compile_parts(captured, options)


def _compile_parts(captured, options: CompileOptions) -> tuple:
    history = list(captured.history)
    lay = captured.layout
    fw_c, bw_c = backends.compilers(options)
    if lay.is_inference:
        input_hooks(captured)       # refuses hooks an inference graph cannot replay
        part, fw_gm, bw_gm = None, _for(fw_c, captured.joint), None
        if options.fw_compiler in ("inductor", "eager") and captured.setup.rebase is None:
            # Inductor fuses the writes into the kernels that compute them; the eager backend runs each
            # as soon as it can, freeing the new value (a whole step: eager's peak memory).
            fw_gm = writes_in_graph(fw_gm, captured.analysis, early=options.fw_compiler == "eager")
        with timed(history, "compile forward", nodes=len(fw_gm.graph.nodes)) as step:
            fw = eager_layout(_compile(fw_c, fw_gm, graph_info(captured, "inference", function_id=id(captured)), step),
                              captured.analysis, fw_gm)

        def run(flat):
            with torch.no_grad():
                return fw(*flat)
        after = None
    else:
        partitioner = partition.get(options.resolved_partitioner(), options.memory_budget)
        with timed(history, "stored partition" if isinstance(partitioner, partition.Partition) else "partition") as info:
            joint = fold_views(captured.joint, lay.n_fw)   # t(t(w)) -> w, across the cut too
            if options.compiles_with("inductor"):
                joint = compact_saved(joint, lay.n_primals,     # what Inductor's own partition saves
                                      decompose=options.resolved_partitioner() != "default")
            part = partitioner(joint, lay)
            info["saved"] = len(part.saved)
        fw_gm, bw_gm = _for(fw_c, part.forward), _for(bw_c, part.backward)
        with timed(history, "compile forward", nodes=len(fw_gm.graph.nodes)) as step:
            fw = eager_layout(_compile(fw_c, fw_gm, graph_info(captured, "forward", part, id(part)), step),
                              captured.analysis, fw_gm)
        bw_info = graph_info(captured, "backward", part, id(part))
        with timed(history, "compile backward", nodes=len(bw_gm.graph.nodes)) as step:
            bw = _compile(bw_c, bw_gm, bw_info, step)
        retained = retained_outputs(captured)
        relaid = {i for i, info in enumerate(captured.analysis.inputs) if info.mutates_metadata or info.new_storage}
        saved_views = saved_input_views(fw_gm, lay.n_fw, part.n_saved_tensors, relaid)
        fn_class = autograd_function(fw, bw, lay.n_primals, lay.n_fw, part.n_saved_tensors,
                                     lay.tangent_of, lay.grad_of,
                                     name=f"Compiled_{captured.setup.flat_fn.__name__}",
                                     # (not inlined where it needs its ctx)
                                     bw_graph=None if retained or captured.analysis.rewritten else bw_gm,
                                     double_backward=second_order(captured),
                                     input_hooks=input_hooks(captured), retained=retained,
                                     returned=returned_inputs(captured),
                                     saved_views=saved_views, reruns=captured.analysis.eager_reruns,
                                     rewritten=captured.analysis.rewritten,
                                     zeroed=None if retained else _zeroed(bw_c, bw_gm, bw_info, len(lay.tangent_of)))
        run = _without_edges(fast_apply(fn_class), ungraded_inputs(captured, lay))
        own = {i for _, i in saved_views}       # saved as the caller's tensor: autograd checks its version
        after = version_checks(fn_class, tuple(i for i in captured.analysis.eager_saved if i not in own))
        if retained:
            run = retaining(run, [k for _, k in retained])
        if not captured.setup.session.grad_enabled:
            run = _with_grad(run)    # an enable_grad region inside a function called under no_grad
    return part, fw_gm, bw_gm, make_call(captured, run, after), tuple(history)


def _zeroed(compiler, bw_gm, info: GraphInfo, n_tangents: int):
    """``missing -> backward`` without the tangents at positions ``missing`` (``passes.zero_tangents``),
    compiled on first need; None where a tangent cannot be made in the graph (autograd makes it)."""
    phs = bw_gm.graph.find_nodes(op="placeholder")
    if not n_tangents or not all(map(zeroable, phs[len(phs) - n_tangents:])):
        return None
    done = {}

    def backward(missing: tuple):
        if missing not in done:
            skip = {len(phs) - n_tangents + i for i in missing}
            done[missing] = _compile(compiler, zero_tangents(bw_gm, n_tangents, missing), replace(
                info, input_names=tuple(n for i, n in enumerate(info.input_names) if i not in skip)))
        return done[missing]
    return backward


def ungraded_inputs(captured, lay) -> tuple:
    """Inputs that require grad but whose gradient the joint graph never computes (read only through
    ``.detach()``, ``.data`` or under ``no_grad``): eager's backward never reaches their history, so the
    compiled node takes no edge to them (PyTorch's AOTAutograd marks such gradients None). An input the
    program hooks keeps its edge (its hooks are registered on the tensor the node receives). Where no
    edge would be left while an output requires grad (through a leaf made inside: a subclass wrapper built
    from tensors that require grad), every edge stays, so the outputs require grad as eager's do."""
    if input_hooks(captured):
        return ()
    grads = captured.joint.graph.output_node().args[0][lay.n_fw:]
    ungraded = tuple(i for i, g in zip(lay.grad_of, grads) if g is None)
    return () if len(ungraded) == len(lay.grad_of) and lay.tangent_of else ungraded


def _without_edges(run, ungraded: tuple):
    """``run`` called with the ``ungraded`` inputs detached (the epilogue writes the caller's tensors)."""
    if not ungraded:
        return run

    def call(flat):
        flat = list(flat)
        for i in ungraded:
            flat[i] = flat[i].detach()
        return run(flat)
    return call


def second_order(captured) -> tuple:
    """``(run, needs_rng)`` for a backward with ``create_graph=True`` (runtime/double_backward.py):
    ``run`` is built on the first such backward, so a step that never takes one does not load it;
    ``needs_rng``: the forward records the RNG state it starts from (the program draws)."""
    built: list = []

    def run(kept, rng, grad_outputs):
        if not built:
            from .runtime.double_backward import differentiable_backward
            built.append(differentiable_backward(captured))
        return built[0](kept, rng, grad_outputs)
    return run, any(is_random(n) for n in captured.joint.graph.nodes)
