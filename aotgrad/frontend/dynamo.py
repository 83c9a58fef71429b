"""aotgrad as a ``torch.compile`` backend: Dynamo is the frontend.

Dynamo hands over an FX graph of torch-level ops and fake example inputs made
in *its* fake mode and shape environment. We trace the joint graph in that
same fake mode, so every shape assumption our tracing adds (a backward
formula branching on a size, say) lands in Dynamo's shape environment and is
installed with Dynamo's guards: a later input that violates it makes Dynamo
recompile. Dynamo guards every call, so the compiled callable skips our own
input checks. Compilation happens here, at lowering time.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

import torch

from .._torch import FakeTensor, detect_fake_mode, dynamo_errors, dynamo_fallback_errors, pytree
from .. import errors
from ..capture.capture import capture_setup
from ..ir.descriptors import BufferDesc, Desc, InputDesc, ParamDesc
from ..capture.session import Session
from ..inputs.flatten import Signature, outputs, refuse_tensor
from ..inputs.subclasses import Meta, Unwrap, as_inner
from ..observe import timed
from ..options import CompileOptions, as_options
from ..runtime.call import alias_check
from ..passes.checkpoint_regions import untag_checkpoints
from ..passes.cleanup import copy_module
from ..stages import Setup
from ..export.entry import LOADABLE_BACKENDS, compile_record, dump_compiled
from ..guards import cache
from ..store import disk
from ..ir.graphs import Unserializable
from ..runtime.modes import GLOBAL_NAMES, SETTERS, global_state, put_back, set_global_state, traced
from ..scoped import GC_PAUSED

log = logging.getLogger("aotgrad.dynamo")


def _desc(node: torch.fx.Node, index: int) -> Desc:
    """Name a Dynamo placeholder after its source: ``L['self']._modules['fc']._parameters['weight']`` -> param 'fc.weight'."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    text = source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", "") or node.name)
    for cls, kind, attr in ((ParamDesc, "param", "_parameters"), (BufferDesc, "buffer", "_buffers")):
        if attr in text or f"_{kind}s_" in node.name or (kind == "param" and "parameters" in node.name):
            parts = re.findall(r"\['([^']+)'\]", text)[1:] or [node.name]
            parts = [p for p in parts if p not in ("self",)]
            return cls(".".join(parts) if parts else node.name)
    return InputDesc(f"{index} ({text or node.name})")


def _lift_state(gm: torch.fx.GraphModule) -> tuple:
    """``(graph, names)``: Dynamo hands an optimizer's parameters and state (``exp_avg``, ``step``...)
    to the backend as the graph's own parameters and buffers, read with ``get_attr`` and written in
    place by the graph. Each becomes a leading input of a copy of the graph, so a write is the
    write-back of an input mutation onto that very tensor, as eager's ``opt.step()`` writes it."""
    owned = {name for name, _ in gm.named_parameters(remove_duplicate=False)} | \
        {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    names = list(dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in owned))
    if not names:
        return gm, ()
    gm = copy_module(gm)
    first = next(iter(gm.graph.nodes))
    inputs = {}
    for name in names:
        with gm.graph.inserting_before(first):
            inputs[name] = gm.graph.placeholder(re.sub(r"\W", "_", f"state_{name}"))
    for n in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in inputs]:
        inputs[n.target].meta.update(n.meta)
        n.replace_all_uses_with(inputs[n.target])
        gm.graph.erase_node(n)
    gm.recompile()
    return gm, tuple(names)


def _lifted_desc(gm, name: str) -> Desc:
    return (ParamDesc if isinstance(getattr(gm, name), torch.nn.Parameter) else BufferDesc)(name)


def _setup(gm: torch.fx.GraphModule, example_inputs) -> Setup:
    graph, lifted = _lift_state(gm)
    state = [gm.get_parameter(n) if isinstance(getattr(gm, n), torch.nn.Parameter) else gm.get_buffer(n)
             for n in lifted]
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        from .._torch import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    session = Session(dynamic=None, grad_enabled=torch.is_grad_enabled(),
                      shape_env=fake_mode.shape_env, fake_mode=fake_mode)
    ph = [node for node in gm.graph.nodes if node.op == "placeholder"]
    descs = tuple(_lifted_desc(gm, n) for n in lifted) + tuple(_desc(node, i) for i, node in enumerate(ph))
    example_inputs = (*state, *example_inputs)
    for desc, t in zip(descs, example_inputs):
        if isinstance(t, torch.Tensor):
            refuse_tensor(str(desc), t)
    unwrap = Unwrap.of(example_inputs, descs)     # subclass inputs: the graph takes their inner tensors
    if unwrap is not None:      # from Dynamo's fakes of the subclasses: its symbols for their inner sizes
        example_inputs = [fake_mode.from_tensor(t) if isinstance(m, Meta) else t for t, m in zip(example_inputs, unwrap.metas)]
        example_inputs, descs = unwrap.examples(example_inputs), tuple(unwrap.descs(descs))
    fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(
        t, FakeTensor) else t for t in example_inputs]
    n = len(fakes)
    sig = Signature(pytree.tree_structure((tuple(range(n)), {})), (None,) * n, tuple(range(n)), (), (),
                    unwrap=unwrap)
    body = untag_checkpoints(graph)

    def flat_fn(*flat):
        return outputs(as_inner(body(*flat)))
    flat_fn.__name__ = "dynamo_graph"
    if unwrap is not None:
        flat_fn = unwrap.wrap(flat_fn)
    flat_fn.lifted = tuple(state)       # passed before Dynamo's arguments on every call (_callable)
    return Setup(graph, sig, descs, flat_fn, session, tuple(fakes), tuple(fakes))


def _keywords(options: dict) -> dict:
    """``torch.compile(..., options={...})`` hands its dict to the backend as ``options=``: the same
    keyword options as given one by one."""
    inner = options.get("options")
    return {**inner, **{k: v for k, v in options.items() if k != "options"}} if isinstance(inner, dict) else options


def compile_graph(gm, example_inputs, *, options: CompileOptions | None = None, **compile_options):
    """The backend entry: capture and compile now (or load both from the disk cache); return
    ``(*args) -> outputs``. ``compile_options``: the fields of ``CompileOptions``, checked before
    anything is traced (or one ``options``, or ``torch.compile``'s ``options`` dict of them)."""
    if not isinstance(options, CompileOptions):
        given = _keywords({**compile_options, "options": options}) if options is not None else compile_options
        options = as_options(given, "aotgrad's torch.compile backend")
    history: list = []
    with timed(history, "setup (dynamo)") as info:
        setup = _setup(gm, example_inputs)
        info["inputs"] = len(example_inputs)
    key = _key(setup.fn, setup, setup.fake_inputs, options)     # the lifted state by its layout, not its values
    compiled = None if key is None else _load(key, setup, options)
    if compiled is None:
        captured = _splittable(lambda: capture_setup(setup, history, user_code=False))  # torch ops alone
        compiled = captured.compile(options=options)
        if key is not None:
            _store(key, compiled)
    return _leaving_settings(_callable(compiled, setup.flat_fn.lifted), _settings_after(gm))


def _splittable(trace):
    """``trace()``, where a refusal caused by an exception Dynamo splits its graph on (a data-dependent
    output shape: ``h[mask] = embed``'s ``nonzero`` in the backward) re-raises that exception: Dynamo
    breaks the graph there and runs that part eagerly, as it does for PyTorch's own backends, rather
    than failing the whole compile."""
    try:
        return trace()
    except errors.AotgradError as e:
        cause = _fallback_cause(e)
        if cause is None:
            raise
        log.info("letting Dynamo split its graph: %s (%s)", type(cause).__name__, e)
        raise cause from e


def _fallback_cause(e: BaseException):
    fallback, seen = dynamo_fallback_errors(), set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if fallback and isinstance(e, fallback):
            return e
        e = e.__cause__ or e.__context__
    return None


# The settings of ``modes.global_state`` each setter node of a Dynamo graph sets (``torch._C._set_grad_enabled``,
# ``torch.set_default_dtype``, ``torch._C._set_deterministic_algorithms``, ``torch.set_float32_matmul_precision``),
# by the name of its torch setter, with or without the underscore.
_SETS = {"_set_grad_enabled": (0,), **SETTERS, **{k.lstrip("_"): v for k, v in SETTERS.items()}}


def _settings_after(gm) -> dict:
    """``{index in global_state(): value}``: the settings Dynamo's graph leaves set, found by running its
    setter nodes alone (torch setters with constant arguments and no users: Dynamo puts them in the graph
    for ``torch.set_grad_enabled(False)``, ``torch.use_deterministic_algorithms(True)``,
    ``torch.set_default_dtype(...)``, ...), the settings put back after. The trace ran each at its place;
    the compiled graph holds no node for them, so each call sets them after it, as eager leaves them."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users
             and getattr(n.target, "__name__", None) in _SETS
             and (getattr(n.target, "__module__", None) or "torch").startswith("torch")
             and not any(isinstance(a, torch.fx.Node) for a in pytree.tree_leaves((n.args, n.kwargs)))]
    if not calls:
        return {}
    with put_back(global_state()):
        for n in calls:
            n.target(*n.args, **n.kwargs)
        after = global_state()
    return {i: after[i] for n in calls for i in _SETS[n.target.__name__]}


def _leaving_settings(call, settings: dict):
    """``call`` leaving the ``settings`` (``_settings_after``) as the graph does, so the code after the
    graph runs under eager's."""
    if not settings:
        return call
    state = tuple(settings.get(i) for i in range(len(GLOBAL_NAMES)))
    others = frozenset(range(len(GLOBAL_NAMES))) - settings.keys()

    def leaving(*args):
        out = call(*args)
        set_global_state(state, keep=others)
        return out
    leaving.compiled = call.compiled
    return leaving


def _key(gm, setup, example_inputs, options) -> str | None:
    if not disk.enabled() or options.fw_compiler not in LOADABLE_BACKENDS \
            or options.bw_compiler not in LOADABLE_BACKENDS:
        return None
    return cache.dynamo_key(gm, setup.input_descs, example_inputs,
                            traced(), options)


def _load(key, setup, options):
    """The entry stored under ``key``, compiled for ``setup``: Dynamo still traced the bytecode, but
    nothing of aotgrad's capture, partition or graph compile runs again."""
    with timed([], "cache lookup", key=key) as info, GC_PAUSED():
        record = disk.load("dynamo", key, decode=lambda doc, tensors: (doc, tensors))
        compiled = None
        if record is not None:
            try:
                compiled = compile_record(record, setup, options.fw_compiler, options.bw_compiler)
            except Exception as e:  # an entry this build cannot rebuild: compile instead, never fail the call
                log.warning("cannot rebuild a cached Dynamo graph (%s: %s); compiling", type(e).__name__, e)
        info["hit"] = compiled is not None
    return compiled


def _store(key, compiled) -> None:
    try:
        with timed([], "cache store", key=key), GC_PAUSED():
            disk.store("dynamo", key, *dump_compiled(compiled))
    except Unserializable as e:
        log.info("not caching a Dynamo graph on disk: %s", e)


def _callable(compiled, lifted: tuple):
    """``(*args) -> outputs`` for Dynamo; ``lifted``: the graph's own parameters and buffers, its
    leading inputs (``_lift_state``), the very tensors Dynamo's graph holds."""
    captured = compiled.captured
    run, rebase = compiled.path.run, captured.setup.rebase
    unwrap = captured.setup.signature.unwrap
    if unwrap is not None:      # subclass arguments as their inner tensors (Dynamo guarded their class)
        run = _unwrapping(run, unwrap)
    if rebase is None:
        def call(*args):
            return run([*lifted, *args])
    else:
        aliasing = alias_check(captured.setup, captured.analysis)

        guards = captured.guards

        def call(*args):       # inputs that share storage and are written: passed as their synthetic base
            flat = [*lifted, *args]
            why = aliasing(flat)
            if not why:         # Dynamo guards the inputs it sees, not their base: the base's guards are ours
                flat = rebase.graph_inputs(flat)
                failed = guards.check(flat)
                why = None if failed is None else guards.explain(flat, failed)
            if why:
                raise errors.InputMismatchError(why + " (torch.compile does not guard storage sharing: "
                                                "call torch._dynamo.reset() or pass separate tensors)")
            return run(flat)
    call.compiled = compiled
    return call


def _unwrapping(run, unwrap):
    def unwrapped(flat):
        flat, why = unwrap.graph_inputs(flat)
        if why:
            raise errors.InputMismatchError(why)
        return run(flat)
    return unwrapped


def backend(fw_compiler="eager", bw_compiler=None, partitioner="auto", **compile_options):
    """A ``torch.compile`` backend built from any pair of graph compilers and a partitioner.

    ``torch.compile(model, backend=aotgrad.backend(fw_compiler="inductor"))``; the options are
    checked here (``CompileOptions``), so a misspelt one fails before ``torch.compile`` runs.
    """
    given = {"fw_compiler": fw_compiler, "bw_compiler": bw_compiler, "partitioner": partitioner, **compile_options}
    fixed = as_options(given, "aotgrad.backend")

    def aotgrad_backend(gm, example_inputs, **options):
        opts = fixed if not options else as_options({**given, **_keywords(options)}, "aotgrad.backend")
        return compile_graph(gm, example_inputs, options=opts)
    return aotgrad_backend


def aotgrad_backend(gm, example_inputs, **options):
    """``torch.compile(model, backend="aotgrad")``: registered through the ``torch_dynamo_backends`` entry point."""
    return compile_graph(gm, example_inputs, **options)


@dataclass(repr=False)
class HandOff:
    """``aotgrad.jit``'s way past a Python read of a tensor's value (``if torch.rand([]) < p``,
    ``float(self.num_batches_tracked)``, ``.item()`` driving a branch), which no one graph holds: the
    function under ``torch.compile`` with this backend. Dynamo splits its graph at each such read and
    runs the read in Python, so every call takes eager's branch and draws eager's numbers; each piece
    is captured and compiled by aotgrad (``graphs``: those compiled during this hand-off's calls; code
    Dynamo compiled for another of the same function is reused, as ``torch.compile`` reuses it), and
    Dynamo guards and recompiles them. ``why``: the refusal jit's own trace raised, with the user's line."""
    why: errors.GraphBreakError
    call: object
    graphs: list = field(default_factory=list)     # each piece's Compiled, in the order Dynamo made them

    def __call__(self, *args, **kwargs):
        failed, dynamo_error = dynamo_errors()
        was, _RECORDING.graphs = getattr(_RECORDING, "graphs", None), self.graphs
        try:
            return self.call(*args, **kwargs)
        except failed as e:     # a piece aotgrad refused: its own typed error
            if isinstance(e.inner_exception, errors.AotgradError):
                raise e.inner_exception from e
            raise
        except dynamo_error as e:   # Dynamo itself cannot run it either: the read, refused
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise errors.UnsupportedError(
                f"{self.why} (aotgrad.jit handed the function to torch.compile, which failed too: "
                f"{type(e).__name__}: {first[:300]})", user_line=None) from e
        finally:
            _RECORDING.graphs = was

    def summary(self) -> str:
        return (f"calls no entry fits run under torch.compile(backend=\"aotgrad\") ({len(self.graphs)} graph(s) "
                f"compiled in its calls; Dynamo splits the graph at the read): its trace read a tensor's value in "
                f"Python at {self.why.user_line or 'a line of torch or a library'}")


_RECORDING = threading.local()      # .graphs: the list of the hand-off whose call runs on this thread
_HANDOFF_BACKENDS: dict = {}        # CompileOptions -> one backend callable (Dynamo's cache keys on it)


def _handoff_backend(options: CompileOptions):
    """One backend callable per options: Dynamo guards a cache entry on its backend's identity, so a new
    callable per hand-off would compile every jitted copy of a function again, until Dynamo's
    recompile limit made it run the rest eagerly."""
    try:
        backend = _HANDOFF_BACKENDS.get(options)
    except TypeError:       # an option Python cannot hash (a compiler object): a backend of its own
        backend, options_key = None, None
    else:
        options_key = options
    if backend is None:
        def backend(gm, example_inputs):
            call = compile_graph(gm, example_inputs, options=options)
            graphs = getattr(_RECORDING, "graphs", None)
            if graphs is not None:
                graphs.append(call.compiled)
            return call
        if options_key is not None:
            backend = _HANDOFF_BACKENDS.setdefault(options_key, backend)
    return backend


def hand_off(fn, why: errors.GraphBreakError, options: CompileOptions, dynamic) -> HandOff:
    """``fn`` compiled by Dynamo with this backend (``options``), for ``aotgrad.jit`` to call where its
    own trace read a tensor's value (``why``)."""
    with timed([], "jit hand-off to torch.compile", reason=str(why)):
        log.info("%s: handing it to torch.compile(backend='aotgrad'), which splits its graph there", why)
        return HandOff(why, torch.compile(fn, backend=_handoff_backend(options), dynamic=dynamic))
