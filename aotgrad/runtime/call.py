"""The per-call path of a compiled function: flatten the user's arguments,
check them against what the graph assumed (the prologue), run the graph, then
the epilogue: replay input mutations on the real inputs and build the user's
outputs, regenerating outputs that alias inputs or intermediates as real views
(``epilogue`` generates this as code per analysis).

``match`` never raises: it returns the flat inputs, or a sentence saying why
these arguments do not fit, so the ``jit`` frontend can try another entry or
recompile, and ``Compiled.__call__`` can raise a typed error.
"""
from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass
from typing import Callable

import sympy
import torch

from .._torch import pytree, set_version_counter, traceable_subclass, version_counter
from .codegen import compile_source
from ..ir.records import Analysis, ViewMeta, reached_bytes
from ..ir.descriptors import leaf_paths, tree_difference


@dataclass(frozen=True, slots=True)
class CallPath:
    """How one compiled entry is called: ``match`` (the generated prologue) checks the user's
    arguments and flattens them; ``run`` runs the compiled graph on them, replays the writes
    to inputs and rebuilds the user's outputs (``epilogue``). All of it is data printed by
    ``Compiled.program()``."""
    match: Callable     # (args, kwargs) -> (flat, None) | (None, reason); generated, its source is the prologue's
    graph: Callable     # flat -> the graph's values (the compiled autograd function's apply, or the forward)
    epilogue: Callable | None     # generated (flat, values, symbols) -> outputs; None when outputs are plain
    unflatten: Callable           # flat outputs -> the user's output structure
    symbols: Callable | None      # flat -> the symbolic sizes' values, where the epilogue needs them
    quiet: tuple        # inputs the graph writes without a version bump (batch norm statistics)
    written: tuple      # inputs it writes otherwise
    after: Callable | None = None     # (flat, values) once the call has written its inputs back
    held: tuple = ()    # where ``match`` gathers what a caller may pass as ``gathered`` (``held_slots``)

    def run(self, flat):
        quiet = self.quiet
        for i in quiet:
            _QUIET[id(flat[i])] = flat[i]
        kept = [(flat[i], version_counter(flat[i])) for i in (*quiet, *_quiet_unseen(flat, self.written))]
        values = self.graph(flat)
        finish = self.epilogue
        outs = list(values) if finish is None else finish(flat, values, self.symbols(flat) if self.symbols else None)
        # Written as eager's kernel writes them (batch norm's running statistics): no version bump,
        # so the version eager's backward checks holds whoever wrote them (the graph, the write-back).
        for t, v in kept:
            if v is not None:
                set_version_counter(t, v)
        if self.after is not None:
            self.after(flat, values)
        return self.unflatten(outs)


# Constants compared by value (and exact type) on every call; any other object must be the same object.
VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
               torch.layout)


def same_value(a, b) -> bool:
    """Type-exact, and bit-exact for floats and complex numbers: ``-0.0`` is not ``0.0`` (``x / eps``
    differs), a NaN is the same as a NaN. ``a`` and ``b`` are of the ``VALUE_TYPES``."""
    if type(a) is not type(b):
        return False
    return bits(a) == bits(b)


def bits(v):
    """A float or complex number as its exact bits (``-0.0`` apart from ``0.0``); others as they are."""
    if isinstance(v, float):        # float subclasses too (numpy.float64)
        return float_bits(v)
    return (float_bits(v.real), float_bits(v.imag)) if isinstance(v, complex) else v


def float_bits(v: float) -> str:
    """A float's exact bits as text: ``-0.0`` apart from ``0.0``, and a NaN's sign and payload kept
    (``float.hex`` writes every NaN as ``nan``; ``math.copysign(1, -nan)`` is -1)."""
    return float.hex(v) if v == v else "nan:" + struct.pack(">d", v).hex()


def float_from_bits(text: str) -> float:
    if text.startswith("nan:"):
        return struct.unpack(">d", bytes.fromhex(text[4:]))[0]
    return float.fromhex(text)


def make_call(captured, run_graph, after=None) -> CallPath:
    """``after(flat, values)``, where given, runs once the call has written its inputs back."""
    setup, analysis, guards = captured.setup, captured.analysis, captured.guards
    simple = all(o.kind == "plain" for o in analysis.outputs) and not any(
        i.mutates_data or i.mutates_metadata or i.storage_resize for i in analysis.inputs) and \
        _grads_as_traced(captured)
    quiet = analysis.quiet_writes
    flagged = tuple(i for i, info in enumerate(analysis.inputs) if info.sets_requires_grad)
    if flagged:
        run_graph = _flagging(run_graph, flagged)
    return CallPath(match=_generated_match(captured), graph=run_graph,
                    epilogue=None if simple else epilogue(analysis, setup.session.grad_enabled),
                    unflatten=_unflattener(captured.out_spec, setup.fn),
                    symbols=guards.bind if not simple and _needs_symbols(analysis) else None,
                    quiet=tuple(quiet),
                    written=tuple(i for i, info in enumerate(analysis.inputs) if info.mutates_data and i not in quiet),
                    after=after, held=held_slots(captured))


def _flagging(run_graph, flagged: tuple):
    """``run_graph`` after ``requires_grad_()`` on the inputs the program sets it on (``flagged``), as its
    eager run does: the graph was traced with them differentiable, and autograd links the graph's outputs
    to them only if they require grad when it runs. A call before any write of its own, after the
    prologue's checks (a refused call changes nothing)."""
    def run(flat):
        for i in flagged:
            flat[i].requires_grad_()
        return run_graph(flat)
    return run


# Tensors a compiled program writes without a version bump (eager's batch norm statistics), by id. A
# program traced under inference mode cannot see versions (its tensors have none): the ones it writes
# that another program found quiet keep their version too, so that a train-mode batch norm called under
# inference mode between a forward and its backward does not look like a write (eager's does not).
_QUIET: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _quiet_unseen(flat, written) -> list:
    if not written or not _QUIET or not torch.is_inference_mode_enabled():
        return []
    return [i for i in written if _QUIET.get(id(flat[i])) is flat[i]]


def _generated_match(captured):
    """The argument part of a step's prologue as one generated function ``match(args, kwargs)``:
    flatten (a flat positional call takes its arguments as they are), compare each constant the
    graph baked in, gather parameters and buffers from their modules' dicts (read by name each
    call: a capture in another thread may stand a per-thread view in for one) and the tensor
    arguments, check aliasing, the input guards and the grad mode. Its source is the program's."""
    setup, analysis, guards = captured.setup, captured.analysis, captured.guards
    sig = setup.signature
    tensor_pos, n_leaves = set(sig.tensor_pos), len(sig.leaves)
    env = {"tree_flatten": pytree.tree_flatten, "tree_difference": tree_difference, "in_spec": sig.in_spec,
           "same_value": same_value, "const_why": _const_why, "check": guards.check, "explain": guards.explain,
           "is_grad_enabled": torch.is_grad_enabled}
    lines = ["def match(args, kwargs, gathered=None):"]
    if sig.in_spec == pytree.tree_structure(((0,) * n_leaves, {})):
        lines += [f"    if not kwargs and len(args) == {n_leaves}:",
                  "        leaves = args   # flat positional: a wrong nesting fails the checks below", "    else:"]
    else:
        lines.append("    if True:")
    lines += ["        leaves, spec = tree_flatten((args, kwargs))",
              "        if spec != in_spec:", "            return None, tree_difference(in_spec, spec)"]
    paths = leaf_paths(sig.in_spec)
    for i, v in enumerate(sig.leaves):
        if i in tensor_pos:
            continue
        env[f"c{i}"] = v    # type-exact and bit-exact: 2, 2.0, True and -0.0 differ; other objects: the same one
        test = f"x is not c{i} and not same_value(x, c{i})" if type(v) in VALUE_TYPES else f"x is not c{i}"
        lines += [f"    x = leaves[{i}]", f"    if {test}:", f"        return None, const_why({paths[i]!r}, c{i}, x)"]
    lines += _gather_lines(sig, env)
    for j, (name, s, i) in enumerate(sig.ties):
        env[f"t{j}"], env["held"] = s.module.__dict__, _held
        lines += [f"    if held(t{j}[{'_parameters' if s.is_param else '_buffers'!r}], {s.attr!r}) is not flat[{i}]:",
                  f"        return None, {_untied_why(name, sig.state_names[i])!r}"]
    lines += _identity_lines(sig, env)
    if sig.unwrap is not None:      # subclass inputs: checked, then as their inner tensors (inputs.subclasses)
        env["unwrap"] = sig.unwrap.graph_inputs
        lines += ["    flat, why = unwrap(flat)", "    if why:", "        return None, why"]
    else:       # a subclass argument where a plain tensor was captured (the input guards take it for a tensor)
        env.update(plain=_PLAIN, subclass_why=_subclass_why)
        for p in sig.tensor_pos:
            lines += [f"    if type(leaves[{p}]) not in plain and subclass_why(leaves[{p}]):",
                      f"        return None, subclass_why(leaves[{p}], {paths[p]!r})"]
    aliasing = alias_check(setup, analysis)
    if aliasing is not None:
        env["aliasing"] = aliasing
        lines += ["    why = aliasing(flat)", "    if why:", "        return None, why"]
    if setup.rebase is not None:
        env["rebase"] = setup.rebase.graph_inputs
        lines.append("    flat = rebase(flat)")
    grad = bool(setup.session.grad_enabled)
    lines += ["    failed = check(flat)   # the input guards", "    if failed is not None:",
              "        return None, explain(flat, failed)",
              f"    if is_grad_enabled() is not {grad}:   # which outputs require grad was traced",
              f"        return None, {_grad_why(grad)!r}", "    return flat, None"]
    exec(compile_source("\n".join(lines) + "\n", "prologue"), env)
    return env["match"]


def _gather_lines(sig, env) -> list:
    """``flat``: the parameters and buffers, then the tensor arguments. Each module's parameter (or buffer)
    dict read once per call from its ``__dict__``, then each entry by a dict subscript (a capture in
    another thread may stand a per-thread view in for the dict: its ``__getitem__`` gives each thread its
    own values, tracing.views.View); or ``gathered``, the ones a previous call gathered, where the
    caller's state check proves them unchanged (``held_slots``). A parameter or buffer gone from its dict (another
    added in its place: the count its state guard checks is the same) is a mismatch, as any other."""
    gather, stores, lines = [], {}, []
    for s in sig.slots:
        key = (id(s.module), "_parameters" if s.is_param else "_buffers")
        if key not in stores:
            stores[key] = n = len(stores)
            env[f"m{n}"] = s.module.__dict__
            lines.append(f"            s{n} = m{n}[{key[1]!r}]")
        gather.append(f"s{stores[key]}[{s.attr!r}]")
    args = [f"leaves[{p}]" for p in sig.tensor_pos]
    env["gone_why"] = _gone_why
    if not gather:
        return [f"    flat = [{', '.join(args)}]"]
    return (["    if gathered is None:", "        try:", *lines, f"            flat = [{', '.join(gather + args)}]",
             "        except KeyError as e:", "            return None, gone_why(e)",
             "    else:", f"        flat = [{', '.join(['*gathered'] + args)}]"])


def _identity_lines(sig, env) -> list:
    """The trace gave one object passed twice one stand-in (:func:`same_objects`), and other
    arguments their own: a call must pass the same objects in the same places, and its tensor arguments
    must be distinct objects elsewhere (``x is y``, a dict keyed by one, would answer otherwise). An
    argument that is a parameter or buffer only now is not checked (its type, if a ``Parameter``, is)."""
    n_state, lines = len(sig.slots), []
    if sig.same is None:
        return lines
    for j, i in sig.same:
        lines += [f"    if flat[{j}] is not flat[{i}]:",
                  f"        return None, {_identity_why(sig, j, i, True)!r}"]
    n_args = len(sig.tensor_pos)
    if n_args > 1:
        distinct = n_args - sum(i >= n_state for _, i in sig.same)
        env["ident_why"] = lambda flat: _distinct_why(sig, flat)
        args = range(n_state, n_state + n_args)
        # (two or three arguments, each its own: pairwise `is`, a tenth of a set's cost per call)
        test = " or ".join(f"flat[{a}] is flat[{b}]" for a in args for b in args if a < b) \
            if distinct == n_args <= 3 else f"len({{id(t) for t in flat[{n_state}:]}}) != {distinct}"
        lines += [f"    if {test}:", "        return None, ident_why(flat)"]
    return lines


def _identity_why(sig, j, i, was_same: bool) -> str:
    paths = leaf_paths(sig.in_spec)
    n_state = len(sig.slots)
    name = lambda k: paths[sig.tensor_pos[k - n_state]] if k >= n_state else sig.state_names[k]
    return (f"{name(j)} {'was' if was_same else 'was not'} the same tensor object as {name(i)} when captured, "
            f"{'now it is not' if was_same else 'now it is'}")


def same_objects(tensors, n_state: int) -> tuple:
    """``(j, i)`` for each tensor argument ``j`` that is the very object at an earlier flat index ``i``
    (``f(x, x)``, ``m(m.weight)``). Eager's callee sees one object there (``x is y``, a dict keyed by
    it); the trace gives it one stand-in too (``inputs.flatten.flat_function``), as PyTorch's AOTAutograd
    dedupes such arguments, and every call must pass them so (:func:`_identity_lines`)."""
    first: dict = {}
    out = []
    for j, t in enumerate(tensors):
        i = first.setdefault(id(t), j)
        if i != j and j >= n_state:
            out.append((j, i))
    return tuple(out)


def _distinct_why(sig, flat) -> str:
    """Why ``flat`` failed the distinctness test: the first two arguments that are one object now only."""
    n_state, captured = len(sig.slots), set(sig.same)
    new = [(j, i) for j, i in same_objects(flat, n_state) if i >= n_state and (j, i) not in captured]
    return _identity_why(sig, *new[0], False) if new else "the tensor arguments are not the objects they were when captured"


def held_slots(captured) -> tuple:
    """``(module __dict__, dict name, name)`` per parameter and buffer ``match`` gathers, in its order, where
    a caller may pass them as ``gathered``; () where ``flat`` is rebuilt after the gather (subclass inputs,
    synthetic bases)."""
    sig = captured.setup.signature
    if sig.unwrap is not None or captured.setup.rebase is not None:
        return ()
    return tuple((s.module.__dict__, "_parameters" if s.is_param else "_buffers", s.attr) for s in sig.slots)


_PLAIN = (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", torch.nn.Parameter))


def _subclass_why(t, name=None) -> str | None:
    if not traceable_subclass(t):
        return None
    return f"{name} was a plain tensor when captured, now a {type(t).__name__}"


def _held(d, attr):
    try:
        return d[attr]
    except KeyError:
        return None


def _gone_why(e: KeyError) -> str:
    return f"the module's parameter or buffer {e.args[0]!r} the graph takes as an input is gone"


def _untied_why(name, first) -> str:
    return (f"'{name}' was tied to '{first}' when captured (one tensor, a graph input once), now it holds "
            "another tensor")


def _const_why(path, v, x) -> str:
    kinds = type(x) is not type(v)
    return (f"non-tensor argument {path} was {v!r}{f' ({type(v).__name__})' if kinds else ''} "
            f"when captured, now {x!r}{f' ({type(x).__name__})' if kinds else ''}")


def _grad_why(grad_was: bool) -> str:
    return (f"grad mode was {'enabled' if grad_was else 'disabled'} when captured, now it is "
            f"{'disabled (torch.no_grad())' if grad_was else 'enabled'}")


def _unflattener(spec, root=None) -> Callable:
    """``pytree.tree_unflatten`` for ``spec``, except that a ``torch.Size`` output comes back
    a ``torch.Size`` (pytree rebuilds it as a plain tuple; eager returns the Size), and that the
    values of a :class:`Rebound` are bound to their modules' attributes again (``root``'s)."""
    if spec.type is Rebound:
        user, n, names = _unflattener(spec.children()[0]), spec.children()[0].num_leaves, spec.context
        return lambda leaves: _rebind(root, names, leaves[n:]) or user(leaves[:n])
    if not _has_size(spec):
        return lambda leaves: pytree.tree_unflatten(leaves, spec)
    return lambda leaves: _restore_sizes(pytree.tree_unflatten(leaves, spec), spec)


def _has_size(spec) -> bool:
    return spec.type is torch.Size or any(_has_size(c) for c in spec.children())


def _restore_sizes(value, spec):
    if spec.type is torch.Size:
        return torch.Size(value)
    if not _has_size(spec):
        return value
    if spec.type in (tuple, list):
        return spec.type(_restore_sizes(v, c) for v, c in zip(value, spec.children()))
    if spec.type is dict:
        return {k: _restore_sizes(value[k], c) for k, c in zip(spec.context, spec.children())}
    return value   # other containers holding a Size keep pytree's tuple


# --- module attributes the traced code rebinds

class Rebound:
    """A traced function's output ``out`` with the tensors its modules' plain attributes were rebound
    to (a forward pre-hook's ``module.weight = g * v / v.norm()``: ``weight_norm``, ``spectral_norm``):
    graph outputs like any other, whose epilogue binds each again (``names``: module path, attribute),
    so the module holds the call's tensor after every call, as after eager's."""

    def __init__(self, out, values, names):
        self.out, self.values, self.names = out, values, names


pytree.register_pytree_node(
    Rebound, lambda r: ([r.out, *r.values], r.names), lambda vs, names: Rebound(vs[0], vs[1:], names),
    serialized_type_name="aotgrad.Rebound", to_dumpable_context=lambda names: [list(n) for n in names],
    from_dumpable_context=lambda names: tuple(tuple(n) for n in names))


def tensor_attributes(root) -> list:
    """``(path, module, attribute, tensor)`` for each plain tensor attribute (in the instance's
    ``__dict__``, not a parameter or buffer) of ``root`` and its submodules."""
    return [(path, m, k, v) for path, m in root.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor)]


def rebound(before: list, out):
    """``out`` as a :class:`Rebound` where the trace rebound attributes listed in ``before`` (from
    :func:`tensor_attributes`) to tensors it computed; each is put back to its old tensor (every call of
    the graph binds it again, and a graph that read the old one is refused: ``Outputs.replaced``)."""
    names, values, replaced = [], [], []
    for path, m, k, old in before:
        new = vars(m).get(k, old)
        if new is not old and isinstance(new, torch.Tensor) and type(new) not in (torch.Tensor, torch.nn.Parameter):
            vars(m)[k] = old
            names.append((path, k))
            values.append(new)
            replaced.append(old)
    return (Rebound(out, values, tuple(names)), replaced) if names else (out, ())


def _rebind(root, names, values) -> None:
    for (path, attr), v in zip(names, values):
        setattr(root.get_submodule(path), attr, v)


def alias_check(setup, analysis):
    """A check that a graph which writes to an input gets no other input sharing
    that storage, unless they were captured that way (then they must still be, each
    where it was: the graph regenerates them from their base at the captured places)
    or the inputs sharing it touch none of the same bytes (:func:`disjoint`)."""
    rb = setup.rebase
    changed = [i for i, info in enumerate(analysis.inputs) if info.mutates_data]
    relaid = [i for i, info in enumerate(analysis.inputs) if info.mutates_metadata or info.sets_requires_grad]
    if not changed:
        return _same_object_check(relaid) if relaid else None
    groups = [g.members for g in rb.groups] if rb else []
    kept = rb.kept if rb else range(len(analysis.inputs))
    written = [kept[i] for i in changed if i < len(kept)]
    grouped = {i for g in groups for i in g}
    # Parameters and buffers are not compared with each other (a module's own state does not
    # alias itself); each written input is compared with every other input.
    n_state = len(setup.signature.slots)
    placed = [(i, v) for g in (rb.groups if rb else ()) for i, v in zip(g.members, g.views) if v.is_static]

    def check(flat):
        key = {i: flat[i].untyped_storage()._cdata for i in range(n_state, len(flat))
               if isinstance(flat[i], torch.Tensor)}
        for i in (*written, *grouped):
            if i not in key and isinstance(flat[i], torch.Tensor):
                key[i] = flat[i].untyped_storage()._cdata
        for g in groups:
            if len({key.get(i) for i in g}) != 1:
                return f"inputs {list(g)} shared storage when captured, now they do not"
        for i, was in placed:
            now = ViewMeta.of(flat[i])
            if now != was:
                return (f"flat input {i} shares storage with other inputs as captured, but lies elsewhere in it "
                        f"(now {now}, captured {was})")
        count: dict = {}        # storages of the inputs outside captured groups (one pass: a whole training
        for j, k in key.items():    # step writes hundreds of inputs)
            if j not in grouped:
                count[k] = count.get(k, 0) + 1
        bases = {key.get(g[0]) for g in groups}     # a base is written back whole
        for i in written:
            k = key.get(i)
            if k is None:
                continue
            # A group's member: no input outside the group in its storage. Any other written input:
            # no synthetic base there, and no byte shared with another input.
            if count.get(k, 0) if i in grouped else k in bases or count.get(k, 0) > 1 and not disjoint(
                    [flat[j] for j, s in key.items() if s == k]):
                return (f"flat input {i} is written to and now shares storage with another input (bytes of "
                        "both, or a captured group's base), which it did not when captured")
        return same(flat) if same else None
    same = _same_object_check([kept[i] for i in relaid if i < len(kept)]) if relaid else None
    return check


def disjoint(tensors) -> bool:
    """Whether ``tensors`` (sharing a storage) read and write none of the same bytes: each strided,
    of static sizes, strides and offset, strides not negative. An empty tensor touches nothing."""
    spans = []
    for t in tensors:
        if t.layout is not torch.strided or not all(type(v) is int for v in (*t.shape, *t.stride(),
                                                                               t.storage_offset())):
            return False
        if min(t.stride(), default=0) < 0:
            return False
        if t.numel():
            spans.append((t.storage_offset() * t.element_size(), reached_bytes(t)))
    spans.sort()
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _same_object_check(relaid):
    """A check that no input whose layout, storage or ``requires_grad`` the graph changes in place
    (``t_()``, ``set_()``, ``requires_grad_()``) is passed again as another input: eager's second one
    would see the change, the graph's does not."""
    def check(flat):
        for i in relaid:
            if any(t is flat[i] for j, t in enumerate(flat) if j != i):
                return (f"flat input {i} is changed in place (layout, storage or requires_grad) and is passed "
                        "again as another input")
        return None
    return check


def _grads_as_traced(captured) -> bool:
    """Whether the graph's outputs come back with the traced ``requires_grad`` by themselves:
    every output that requires grad has a tangent, and (in a training graph, where a
    non-differentiable output may share storage with a differentiable one) none is without."""
    lay, analysis = captured.layout, captured.analysis
    if lay.is_inference:
        return not any(o.requires_grad for o in analysis.outputs)
    return all(o.requires_grad and k in lay.tangent_of and not o.is_leaf for k, o in analysis.plain())


def _needs_symbols(analysis) -> bool:
    metas = [o.view for o in analysis.outputs if o.view is not None]
    metas += [i.new_meta for i in analysis.inputs if i.new_meta is not None]
    return any(not m.is_static for m in metas) or any(o.kind == "symbolic" for o in analysis.outputs) or any(
        i.storage_resize is not None and not isinstance(i.storage_resize[1], int) for i in analysis.inputs)


def unbound_size(analysis, bound: set, replayed: bool = False):
    """A size the epilogue computes per call over a symbol outside ``bound`` (what the input guards bind),
    or None: a storage resize, a layout set on an input, a view it regenerates with ``as_strided``
    (``replayed``: also one it replays in process, as a stored entry has no replays)."""
    metas = [o.view for o in analysis.outputs if o.view is not None and (replayed or o.replay is None)]
    metas += [m for i in analysis.inputs for m in (i.new_meta, i.new_storage and i.new_storage.view) if m]
    sizes = [v for m in metas for v in (*m.size, *m.stride, m.offset)]
    sizes += [i.storage_resize[1] for i in analysis.inputs if i.storage_resize]
    return next((v for v in sizes if not isinstance(v, (int, float)) and
                 not {str(s) for s in v.free_symbols} <= bound), None)


def _symbol_map(symbols) -> dict:
    return {sympy.Symbol(k, integer=True, positive=True): v for k, v in symbols.items()} | \
        {sympy.Symbol(k, integer=True): v for k, v in symbols.items()}


def _concrete(x, symbols):
    if isinstance(x, (int, float)):
        return x
    return int(x.xreplace(_symbol_map(symbols)))


def view_args(meta: ViewMeta, symbols, base: torch.Tensor):
    """``as_strided`` arguments of ``meta`` (a ``ViewMeta.relative``) on ``base``."""
    if symbols is None:
        return meta.size, meta.stride, base.storage_offset() + meta.offset
    return (tuple(_concrete(s, symbols) for s in meta.size),
            tuple(_concrete(s, symbols) for s in meta.stride),
            base.storage_offset() + _concrete(meta.offset, symbols))


def as_view(base: torch.Tensor, info, symbols):
    """Output ``info`` regenerated as a real view of ``base``: its view ops replayed, or ``as_strided``."""
    if base.requires_grad and not info.requires_grad:
        base = base.detach()        # e.g. ``x.detach()``: shares storage, no autograd link
    if info.replay is not None:
        return info.replay.apply(base)
    return base.as_strided(*view_args(info.view, symbols, base))


def epilogue(analysis: Analysis, traced_with_grad: bool = True):
    """``(flat, values, symbols) -> outputs``: after the graph ran, write its new values into
    the real inputs as eager's in-place ops would, then build the user's flat outputs from the
    graph's forward values. Generated as straight-line code for this analysis (one line per
    mutated input and per output, no per-call dispatch on kinds), shown in tracebacks.
    ``traced_with_grad``: grad mode was enabled when the function was traced."""
    lines, scope = ["def epilogue(flat, values, symbols):"], {"_with_grad": traced_with_grad,
        "_meta": _write_metadata, "_data": _write_data, "_detached": _detached, "as_view": as_view,
        "_as_traced": _as_traced, "Tensor": torch.Tensor, "_symbol_map": _symbol_map, "_swap": _swap_storage,
        "_laid_out": _laid_out, "_resize": _resize_storage, "_concrete": _concrete, "_over": _over}
    for j, info in enumerate(analysis.outputs):    # over an input's storage as the caller gave it (it keeps it)
        if info.kind == "input_set":
            lines.append(f"    o{j} = _over(flat[{info.index}], i{j}, symbols)")
    lines += _swap_lines(analysis, scope)
    k = 0
    for i, info in enumerate(analysis.inputs):
        if info.new_storage is not None:    # (swapped above)
            k += info.mutates_data
            continue
        if info.mutates_metadata:
            scope[f"m{i}"] = info.new_meta
            lines.append(f"    _meta(flat[{i}], m{i}, symbols, {bool(info.meta_seen)})")
        if info.storage_resize is not None:     # (resized first: the data lands in the new storage)
            value = f"values[{k}]" if info.mutates_data else "None"
            scope[f"r{i}"] = info.storage_resize[1]
            lines.append(f"    _resize(flat[{i}], _concrete(r{i}, symbols), {value}, "
                         f"{bool(info.mutation_needs_autograd)})")
            k += info.mutates_data
        elif info.mutates_data:
            lines.append(f"    _data(flat[{i}], values[{k}], {bool(info.mutation_needs_autograd)})")
            k += 1
    lines += _output_lines(analysis, scope)
    exec(compile_source("\n".join(lines), "epilogue"), scope)
    return scope["epilogue"]


def _swap_lines(analysis: Analysis, scope: dict) -> list:
    """``set_()`` on inputs, first (another input it now shares storage with is taken as the caller
    gave it, before any swap or layout change the epilogue replays): the caller's tensor set to the
    storage eager's holds, a view of the other input's or the value the graph computed."""
    views, swaps, k = [], [], 0
    for i, info in enumerate(analysis.inputs):
        swap = info.new_storage
        if swap is not None:
            scope[f"s{i}"] = swap
            if swap.kind == "plain":
                swaps.append(f"    _swap(flat[{i}], _laid_out(values[{k}], s{i}.view, symbols))")
            else:
                views.append(f"    n{i} = as_view(flat[{swap.index}], s{i}, symbols)")
                swaps.append(f"    _swap(flat[{i}], n{i})")
        k += info.mutates_data
    return views + swaps


def _laid_out(value: torch.Tensor, meta: ViewMeta, symbols) -> torch.Tensor:
    """``value`` at the strides and storage offset the trace gave it (eager's: a view of a value made
    inside, ``(y * 3)[1:]``), where the backend returned it laid out otherwise (Inductor's compact copy)."""
    if symbols is None and not meta.is_static:
        return value
    size, stride, offset = view_args(meta, symbols, value.new_empty(0))
    if (tuple(value.shape), value.stride(), value.storage_offset()) == (tuple(size), tuple(stride), offset):
        return value
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(size, stride)) if value.numel() else offset
    out = value.new_empty(max(extent, 0)).as_strided(size, stride, offset)
    with torch.no_grad():
        out.copy_(value)
    return out


def _swap_storage(x: torch.Tensor, value: torch.Tensor) -> None:
    """``x.set_(value)`` as eager's ran it (under ``no_grad``, or on tensors that do not require grad:
    others were refused): ``x`` shares ``value``'s storage at its place."""
    with torch.no_grad():
        x.set_(value)


def _over(x: torch.Tensor, info, symbols) -> torch.Tensor:
    """A tensor of its own over ``x``'s storage where ``info.view`` lies, as eager's ``y.set_(x)`` of a tensor the
    function made leaves ``y``: not ``x``, no view of it, its own version counter; a view of one where eager's
    output is a view of such a tensor."""
    size, stride, offset = view_args(info.view, symbols, x)
    out = x.new_empty(0)
    with torch.no_grad():
        out.set_(x.untyped_storage(), offset, size, stride)
    return out.as_strided(out.shape, out.stride(), out.storage_offset()) if info.is_view else out


def _output_lines(analysis: Analysis, scope: dict) -> list:
    infos = analysis.outputs
    n_mut = len(analysis.mutated())
    plain = [j for j, info in enumerate(infos) if info.kind == "plain"]
    lines = [f"    o{j} = values[{n_mut + p}]" for p, j in enumerate(plain)]
    base = n_mut + len(plain)
    for j, info in enumerate(infos):
        scope[f"i{j}"], kind = info, info.kind
        value = {"input": lambda: f"flat[{info.index}]",
                 "input_detached": lambda: f"_detached(flat[{info.index}], i{j}.view, symbols)",
                 "input_view": lambda: f"as_view(flat[{info.index}], i{j}, symbols)",
                 "output_view": lambda: f"as_view(o{info.index}, i{j}, symbols)",
                 "intermediate_view": lambda: f"as_view(values[{base + info.index}], i{j}, symbols)",
                 "constant": lambda: f"i{j}.value",
                 "symbolic": lambda: f"i{j}.value[0](i{j}.value[1].xreplace(_symbol_map(symbols)))",
                 "output": lambda: "None"}.get(kind)
        if value is not None:
            lines.append(f"    o{j} = {value()}")
    for j, info in enumerate(infos):
        if info.kind == "output":
            lines.append(f"    o{j} = o{info.index}")
        else:
            rg, leaf = bool(info.requires_grad), bool(info.is_leaf)
            lines.append(f"    if isinstance(o{j}, Tensor) and (o{j}.requires_grad != {rg}"
                         f"{f' or o{j}.grad_fn is not None' if rg and leaf else ''}):")
            lines.append(f"        o{j} = _as_traced(o{j}, i{j}, _with_grad)")
    return lines + [f"    return [{''.join(f'o{j}, ' for j in range(len(infos)))}]"]


def _write_metadata(x: torch.Tensor, meta: ViewMeta, symbols, seen: bool) -> None:
    """``x`` laid out as the trace left it. ``seen``: autograd recorded the change (``t_()`` of an
    input that requires grad): ``as_strided_`` under grad puts it on ``x``'s history, as eager's
    ``TBackward`` is; otherwise the storage is re-set without autograd."""
    size, stride, offset = view_args(meta, symbols, x)
    version = x._version
    if seen and torch.is_grad_enabled():
        x.as_strided_(size, stride, offset)
    else:
        with torch.no_grad():
            x.set_(x.untyped_storage(), offset, size, stride)   # as_strided_ would make x a view
    # Eager's t_() ran before the forward saved x for the backward; this replay runs
    # after, so it must not look like a write to what the backward reads.
    _set_version(x, version)


def _write_data(x: torch.Tensor, value: torch.Tensor, needs_autograd: bool) -> None:
    if value is x:      # the graph wrote it (passes/input_writes.py)
        return
    if needs_autograd and torch.is_grad_enabled() and value.requires_grad:
        x.copy_(value)
    else:
        with torch.no_grad():
            x.copy_(value)


def _resize_storage(x: torch.Tensor, nbytes: int, value, needs_autograd: bool) -> None:
    """The caller's storage resized as the function left it (eager's ``untyped_storage().resize_()``,
    FSDP's free and re-allocate), then the function's writes into it (``value``), unless it ended
    without room for them (freed: eager's writes bumped the version before the free)."""
    storage = x.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
    if value is None:
        return
    extent = x.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) if x.numel() else 0
    if nbytes >= extent * x.element_size():
        _write_data(x, value, needs_autograd)
    else:
        _set_version(x, x._version + 1)


def _set_version(t: torch.Tensor, version: int) -> None:
    set_version_counter(t, version)


def _detached(x: torch.Tensor, meta: ViewMeta, symbols) -> torch.Tensor:
    out = x.detach()
    size, stride, offset = view_args(meta, symbols, x)
    if (tuple(out.shape), out.stride(), out.storage_offset()) != (tuple(size), tuple(stride), offset):
        out.set_(out.untyped_storage(), offset, size, stride)     # detached after a metadata change
    return out


def eager_layout(fw, analysis, fw_gm):
    """``fw`` whose plain outputs are not views where eager's are not: functionalization turns an
    in-place metadata change of an intermediate (``y.t_()``) into a view op, and an autograd view
    of a graph temporary would come back where eager returns a tensor of its own. Detached, it
    keeps its storage, strides and version counter.
    (Not covered: an output eager writes in place with its input's strides, ``x.index_add_`` on a
    transposed ``x``, is laid out by the functional op; functionalization reports those strides too.)"""
    made = fw_gm.graph.find_nodes(op="output")[0].args[0]
    unview = tuple(k for k, o in analysis.plain() if not o.is_view and _is_view_op(made[k]))
    if not unview:
        return fw

    def call(*args):
        outs = list(fw(*args))
        for k in unview:
            if outs[k]._is_view():
                outs[k] = outs[k].detach()
        return outs
    call._boxed_call = getattr(fw, "_boxed_call", False)
    return call


def _is_view_op(node) -> bool:
    schema = getattr(getattr(node, "target", None), "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _as_traced(t: torch.Tensor, info, traced_with_grad: bool) -> torch.Tensor:
    """``requires_grad`` as the trace saw it, where the graph's autograd cannot give it:
    a non-differentiable output that shares storage with a differentiable one (``y.detach()``
    next to ``y``) is detached; an output that requires grad but reaches no input that does
    (``requires_grad_()`` inside, ``torch.ones(3, requires_grad=True)``) becomes a leaf that
    requires grad, or a non-leaf computed from one, as in eager. (A leaf made inside and returned
    gets no ``.grad`` from the other outputs' backward: the graph differentiates its inputs only.)
    A function traced with grad and called under ``no_grad`` keeps the graph's non-leaf outputs
    as they are, without history, as eager's are."""
    if not info.requires_grad:
        return t.detach()
    if info.is_leaf:
        return t.detach().requires_grad_() if t._base is None else t.requires_grad_()
    if traced_with_grad and not torch.is_grad_enabled():
        return t
    with torch.enable_grad():       # called under no_grad with an enable_grad region inside
        return t.detach().requires_grad_().clone()
