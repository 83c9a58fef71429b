"""Repeated blocks traced once.

Real models are stacks of identical blocks; tracing each one's Python and dispatch
again is wasted work. Before a capture traces, :func:`.block_groups.find_groups` sorts the
module's submodules by structure: same class, same non-tensor attributes (by value,
or by identity for objects; plain scalars such as ``layer_idx`` by type), same
parameters and buffers (shape, stride, dtype, device, requires_grad, tying), no
hooks, recursively. While the capture traces, :func:`reusing` intercepts calls of
such blocks: the first call with a
given argument layout traces the block's joint on its own (a :class:`Template`,
see :mod:`.block_graph`); every call, the first included, becomes one node holding
that call's own parameters and arguments, inlined into a copy of the template's
nodes afterwards; an output that is a view of the block's own intermediate is
viewed again per call, random ops draw at each call's own place in the stream.
Anything the template cannot stand for (a mutation, a list or dict argument
written, an object argument other than a KV cache updated by index, an output that
aliases an input, a random op in the backward, a traced tensor held as a constant,
hooks registered inside, symbolic sizes, autocast, saved-tensor hooks) makes the
block run flat, as without reuse; blocks inside it may then be reused on their own.

Twins may differ in scalar attributes: which of those a template's trace read is
watched (:func:`..guards.reads.attribute_reads`), and the template stands only for
blocks with the same values there (:class:`_Entry`). A varying int only passed to a KV
cache's ``update`` (``layer_idx``) is not a read: see :mod:`.per_call`.

The guards stay those of a flat trace: the Python reads the template's trace
recorded on the first block's objects are recorded again on each block's own
(same paths), so changing ``blocks[5].attn.n_head`` after capture recompiles.
A template whose trace reached a block other than through the block itself
(``self is REGISTRY[0]``) is not used at all (:func:`_reaches_blocks`).
"""
from __future__ import annotations

import contextlib
import itertools
import types
import weakref
from dataclasses import dataclass, field

import torch

from .._torch import (
    FunctionalTensor, disable_current_modes, functorch_interpreter_active,
    is_any_autocast_enabled, layouts, pytree, top_saved_tensors_default_hooks,
)
from ..ir.ops import is_random
from ..tracing.views import holding
from ..guards import bytecode, reads
from ..guards import resolve
from ..guards.places import locate, read_at
from ..guards.state import freeze
from ..errors import AotgradError
from .. import tracing
from ..tracing.patches import MODULE_CALLS, flat_call
from ..passes.cleanup import simplify_owned
from ..partition.default import ancestors
from . import block_graph, caches, per_call
from .block_groups import Member, hooked
from ..ir.records import layout
from ..runtime.call import bits
from ..runtime import regions
from ..runtime.call import as_view
from .joint import trace_joint
from .session import Session

_keys = itertools.count()


class _Flat(Exception):
    """Why a block call runs flat (``history``'s ``blocks run flat``)."""


# ---------------------------------------------------------------- interception

_MISSING = object()


@dataclass
class Traced:
    """A template and the reads its trace recorded, by path inside the block."""
    template: block_graph.Template
    owner: torch.nn.Module
    frames: tuple       # (Frame, self path or None, {arg name: path})
    effects: tuple = ()     # caches.Update/Ask/SetItem of its cache arguments, in order; updates' tensors end the outputs
    watched: frozenset = frozenset()    # sources of the varying scalars the watch saw read (``_Entry.read``'s)
    proof: tuple = ()       # every frame its trace ran, as ``frames`` (a twin's reads are found again from them)
    reads: tuple = ()       # each read its trace made, on the owner (``_reads_in``)


@dataclass(frozen=True)
class _Entry:
    """A template (None: the call runs flat) for the calls whose blocks have these values at the
    varying scalar attributes the template's trace read (``(index into Member.varying, value)``)."""
    read: tuple
    traced: Traced | None
    why: str = ""       # why the calls run flat, when they do

    def stands_for(self, m: Member) -> bool:
        return all(m.values[i] == v for i, v in self.read)

    @staticmethod
    def of(m: Member, read, traced=None, why="") -> "_Entry":
        """The entry for ``m``'s values at the varying attributes ``read`` (indices)."""
        return _Entry(tuple((i, m.values[i]) for i in sorted(read)), traced, why)


@dataclass
class Reuse:
    session: Session
    members: dict
    recording: object
    may_trace: bool = True      # templates are made in the metadata pass; the joint pass only uses them
    off: bool = False
    traced: dict = field(default_factory=dict)      # call key -> [_Entry]
    read: dict = field(default_factory=dict)        # group -> indices into its varying scalars a template read
    calls: int = 0
    whole: int = 0      # of those, calls of blocks not inside another repeated block
    ran_flat: set = field(default_factory=set)      # id of each member a call of which ran flat
    why: dict = field(default_factory=dict)         # block class name -> why a call of it ran flat
    objects: frozenset | None = None                # ids of every member's modules (_block_objects)
    refused: dict = field(default_factory=dict)     # call -> why it runs flat (block_graph.FlatCall)
    seen: dict = field(default_factory=dict)        # member id -> its calls so far in this trace
    # (call, template key) -> the call's reads where the template's are proven its own, else None
    # (``_proven``); and the calls whose reads were replayed: each trace runs the same Python, so the
    # first trace's answers stand for the later ones (a deep model's joint trace would redo both per layer)
    proofs: dict = field(default_factory=dict)
    replayed: set = field(default_factory=set)

    def call(self, module, args, kwargs):
        m = self.members.get(id(module))
        if m is None or self.off:
            return flat_call(module, *args, **kwargs)
        with reads.paused():        # our own look at its hook dicts: no user code runs in it
            hook = hooked(m)
        if hook:
            return self._flat(module, "a hook was registered on it while the program ran", args, kwargs)
        origin = (id(module), self.seen.get(id(module), 0))    # the same call in every trace of the program
        self.seen[id(module)] = origin[1] + 1
        state = [md[kind][attr] for md, kind, attr in m.firsts]
        call = _Call.of(args, kwargs)       # watched: a registered pytree node's flatten is user code
        with reads.paused():        # our own bookkeeping: no user code runs in it
            try:
                ins = (*state, *call.tensors)
                if len({id(t) for t in ins}) < len(ins):
                    # Its trace would sum the gradients of the two uses inside, a template's outside: other bits.
                    raise _Flat("it is given one tensor twice")
                key = _call_key(m, state, call)
            except _Flat as flat:
                key, why = None, str(flat)
        # _entry may trace the template (user code, watched); its _Flat cases are caught in _trace.
        e = self._entry(key, module, m, state, call, origin) if key is not None else _Entry((), None, why)
        hit = e.traced
        if hit is not None and origin in self.refused:
            e, hit = _Entry((), None, self.refused[origin]), None
        if hit is None:
            return self._flat(module, e.why, args, kwargs)
        n = hit.template.out_spec.num_leaves
        with reads.paused():        # the cache's methods run on copies: not the program's reads
            steps = caches.bind(hit.effects, call.leaves, m.values) if hit.effects else ()
        if steps is None:
            return self._flat(module, "its cache is not as its template's was (a layer, or an answer it got)",
                              args, kwargs)
        self.calls += 1
        self.whole += not m.inner
        with reads.paused():        # our Function and kernel: no user code runs in them
            if module is not hit.owner and self.recording is not None and (origin, hit.template.key) not in self.replayed:
                self.replayed.add((origin, hit.template.key))
                _replay_reads(self.recording, hit.frames, m.paths, module, self.proofs[origin, hit.template.key])
            ins = [*state, *call.tensors]
            outs = _with_views(block_graph.apply(hit.template, ins, origin), hit.template.views, ins)
            caches.replay(steps, call.leaves, outs[n:])
        return pytree.tree_unflatten(outs[:n], hit.template.out_spec)

    def _flat(self, module, why: str, args, kwargs):
        """Run this call flat, noting why (``history``'s ``blocks run flat``, first reason per class)."""
        self.ran_flat.add(id(module))
        self.why.setdefault(type(module).__name__, why)
        return flat_call(module, *args, **kwargs)

    def _entry(self, key, module, m: Member, state, call, origin) -> _Entry:
        """The entry standing for this call, traced first if none does. A block whose values at
        the scalars an earlier template of its group read are its own alone (``layer_idx`` scaling
        the output) runs flat: a template of its own would stand for one call only."""
        entries = self.traced.setdefault(key, [])
        for e in entries:
            if e.stands_for(m) and self._proven_once(e, module, m, origin):
                return e
        read = self.read.get(m.group)
        if not self.may_trace or read is not None and not any(
                o is not m and o.group == m.group and all(o.values[i] == m.values[i] for i in read)
                for o in self.members.values()):
            why = "its " + ", ".join(".".join(filter(None, m.varying[i])) for i in sorted(read)) + \
                " differs from every twin's, and the template read it" if self.may_trace else "no template"
            e = _Entry.of(m, read or (), why=why)
        else:
            e = self._trace(module, m, state, call)
            self.read[m.group] = (read or frozenset()) | {i for i, _ in e.read}
        entries.append(e)
        return e

    def _trace(self, module, m: Member, state, call) -> _Entry:
        """The template of this call: traced with the block's varying ints standing for every
        twin's (``per_call``), and again with its own values when one of them was used."""
        rec = self.recording
        before = set(rec.frames)
        log: list = []
        asked: list = []
        stands = per_call.stands(m, log, asked)
        e = self._trace_with(module, m, state, call, stands, log, asked) if stands else None
        if e is None:
            e = self._trace_with(module, m, state, call, {}, [])
        if e is None:
            return _Entry.of(m, range(len(m.varying)), why="it uses its cache argument other than by update(..., layer_idx) or a question of it")
        if e.traced is None:
            return e
        where = {id(sub): path for path, sub in m.paths.items()}
        new = [f for k, f in rec.frames.items() if k not in before]
        if _reaches_blocks(new, where, self._block_objects()):
            # The trace may depend on which block it is: each runs its own code.
            return _Entry((), None, "its code reaches a block other than through itself (self is REGISTRY[0])")
        block_graph.TEMPLATES[e.traced.template.key] = e.traced.template
        frames = tuple((f, where.get(id(f.self_obj)), {n: where[id(v)] for n, v in f.args.items() if id(v) in where})
                       for f in new)
        e.traced.frames = tuple(x for x in frames if x[1] is not None or x[2])
        e.traced.proof = tuple(x for x in frames if x[0].kind != reads.MODULE_CALL)    # (structure: the twins' key)
        e.traced.reads = _reads_in(module, e.traced.proof, m.paths)
        if e.traced.reads is None:
            return _Entry((), None, "its trace read Python state that cannot be compared between its twins")
        return e

    def _proven_once(self, e: _Entry, module, m: Member, origin) -> bool:
        """``_proven``, asked once per call and template in a capture (every trace makes the same calls)."""
        if e.traced is None or module is e.traced.owner:
            return True
        k = (origin, e.traced.template.key)
        if k not in self.proofs:
            self.proofs[k] = self._proven(e, module, m)
        return self.proofs[k] is not None

    def _proven(self, e: _Entry, module, m: Member) -> tuple | None:
        """Whether every read the template's trace made has the same value for this block now as it
        had for the template's (a global the parent sets per layer, a ``ContextVar``, a class
        attribute, a value read with ``object.__getattribute__``): else the block gets a template of its
        own, or runs flat. The varying scalars the watch saw are ``_Entry.stands_for``'s. Proven, the
        block's reads (its own values, rooted at the block): the capture's guards take them as they are
        (``Resolver._twin``), where resolving the block's frames again would find the same."""
        t = e.traced
        with reads.paused():    # the resolver's walk and comparisons of plain values: no user code runs
            now = _reads_in(module, t.proof, m.paths)
            if now is None or len(now) != len(t.reads):
                return None
            same, at = self._same_reads(t, module, now, 0, plain=True)
        # From the first read of children or hooks on: compared by identity, else by ``==`` (a module
        # class's own ``__eq__`` is user code: watched, as everywhere).
        if same is None:
            same = self._same_reads(t, module, now, at, plain=False)[0]
        return now if same else None

    def _same_reads(self, t: Traced, module, now, start: int, plain: bool):
        """``(verdict, index)``: whether the reads from ``start`` on are the template's; None (and the
        index) at a read of children or hooks where ``plain``."""
        for i in range(start, len(now)):
            (source, kind, was), (source2, kind2, value) = _facets(t.reads[i]), _facets(now[i])
            if source != source2:
                return False, i
            if source in t.watched:
                continue
            if plain and kind == "dict":
                return None, i
            if kind != kind2 or not _same_read(kind, was, value):   # (an empty dict is "dict", a filled one not)
                self.why.setdefault(type(module).__name__, f"`{source}`, which its template's trace read, differs")
                return False, i
        return True, len(now)

    def _trace_with(self, module, m: Member, state, call, stands: dict, log: list, asked=()) -> _Entry | None:
        """The call's entry, its template traced with ``stands`` read for the block's varying
        ints; None when one of them (or a cache argument) was used other than passed along, or
        where a stand may have been told from an int (``asked``: their ``__class__`` was read)."""
        self.off = True
        raw: list = []
        rec, ran = self.recording, set() if stands else None
        rec.ran, outer = ran, rec.ran
        try:
            with _hooks_unchanged() as same, disable_current_modes(), _watching(m, stands, raw) as read:
                template, effects = _trace_template(self.session, module, m, state, call, stands, log)
                if not same():
                    raise _Flat("it registers a hook")
        except per_call.Escaped:
            return None
        except _Flat as flat:
            return None if log else _Entry.of(m, read, why=str(flat))
        except Exception as e:       # the flat run raises it again, with the user's line
            return None if log else _Entry.of(m, range(len(m.varying)), why=f"its trace raised {type(e).__name__}")
        finally:
            self.off, rec.ran = False, outer
        if log:
            return None
        traced = Traced(template, module, (), effects, frozenset(_varying_source(m, i) for i in read))
        if read & stands.keys() and self._told_apart(module, m, state, call, traced, ran, asked):
            return None
        if not any(raw):        # the stands were all it read of those: it stands for any values there
            read = read - stands.keys()
        return _Entry.of(m, read, traced)

    def _told_apart(self, module, m: Member, state, call, traced: Traced, ran: set, asked: list) -> bool:
        """Whether the trace may have told a stand from an int. A stand is an int to ``isinstance``
        alone: ``type(v) is int``, ``v is w`` and ``id(v)`` see an object that no real value is,
        and no escape tells of it, so user code the trace ran (``ran``) that asks such questions
        anywhere gets no stands. Where library code read a stand's class (``asked``: ``json.dumps``
        fails on it where an int would not, and the block may catch that), the block traced with
        its own values must make the same template."""
        if any(self.recording.kinds.get(c) == reads.USER and bytecode.asks_type_or_identity(c) for c in ran):
            return True
        if not asked:
            return False
        with reads.paused():    # the stands' trace recorded this trace's reads
            own = self._trace_with(module, m, state, call, {}, [])
        return own is None or own.traced is None or not _same_template(traced, own.traced)

    def count(self) -> int:
        """Block calls that a template stood for in the last trace."""
        return self.calls

    def _block_objects(self) -> frozenset:
        if self.objects is None:
            self.objects = frozenset(id(sub) for m in self.members.values() for sub in m.paths.values())
        return self.objects


def _reaches_blocks(frames, own: dict, objects: frozenset) -> bool:
    """Whether the template's trace reached a block's module other than through the block itself:
    a global, a closure cell, a class attribute or an object argument leading to one (``self is
    REGISTRY[0]``, ``type(self).first``). Such a trace may depend on which block ran it, so no
    other block may reuse it; reads through the block itself are replayed per block."""
    for f in frames:
        if any(id(v) in objects and id(v) not in own for v in f.args.values()):
            return True
        roots = []
        if f.globals is not None:
            roots += [(f.globals.get(c.name, _MISSING), c.steps) for c in bytecode.chains(f.code)[0] if c.root == "global"]
        roots += [(v, ()) for v in (*f.args.values(), *f.containers) if id(v) not in own]
        if id(f.self_obj) in objects:
            roots += [(vars(c), ()) for c in type(f.self_obj).__mro__ if not reads.is_library(c)]
        if any(_leads_to(v, steps, objects) for v, steps in roots if v is not _MISSING):
            return True
    return False


def _leads_to(obj, steps, objects: frozenset) -> bool:
    """Whether ``obj``, a value its access chain ``steps`` passes, or a container at its end (two
    levels deep) is one of ``objects``."""
    for kind, key in steps:
        if id(obj) in objects:
            return True
        loc = locate(obj, kind, key)
        if loc is None:     # not a place guards watch (a list's item): what the container holds
            break
        try:
            obj = read_at(*loc)
        except (KeyError, AttributeError, ValueError):
            return False
    return _holds(obj, objects, 2)


def _holds(v, objects: frozenset, depth: int) -> bool:
    """Whether ``v`` is, or holds (as an item, a key or a weakly held entry), one of ``objects``."""
    if id(v) in objects:
        return True
    if isinstance(v, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)):
        v = dict(v.items()) if not isinstance(v, weakref.WeakSet) else set(v)
    if depth and isinstance(v, (list, tuple, set, frozenset, dict, types.MappingProxyType)) and len(v) <= 4096:
        items = [*v.keys(), *v.values()] if isinstance(v, (dict, types.MappingProxyType)) else v
        return any(_holds(x, objects, depth - 1) for x in items)
    return False


_CONSTANT = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class _Call:
    """A call's arguments: its tensors, and the rest (plain constants, baked into the template)."""
    spec: object
    leaves: tuple       # every leaf, tensors included
    is_tensor: tuple

    @staticmethod
    def of(args, kwargs) -> "_Call":
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        return _Call(spec, tuple(leaves), tuple(isinstance(x, torch.Tensor) for x in leaves))

    @property
    def tensors(self) -> tuple:
        return tuple(x for x, t in zip(self.leaves, self.is_tensor) if t)

    def rebuild(self, tensors, swap=None):
        """``(args, kwargs)`` with ``tensors`` in the tensors' places (and ``swap``'s values at
        those leaf positions)."""
        it, swap = iter(tensors), swap or {}
        return pytree.tree_unflatten([next(it) if t else swap.get(i, x)
                                      for i, (x, t) in enumerate(zip(self.leaves, self.is_tensor))], self.spec)

    def caches(self) -> tuple:
        """Positions of the leaves that are caches a template can take (``caches.cache_key``)."""
        return tuple(i for i, (x, t) in enumerate(zip(self.leaves, self.is_tensor))
                     if not t and type(x) not in _CONSTANT and caches.cache_key(x) is not None)

    def constants(self):
        """The other leaves by type and value (a cache by its class and plain state), or None when
        one is neither a plain constant nor such a cache."""
        rest = [x for x, t in zip(self.leaves, self.is_tensor) if not t]
        keys = tuple((type(x), bits(x)) if type(x) in _CONSTANT else caches.cache_key(x) for x in rest)
        return None if None in keys else keys


def _call_key(m: Member, state, call: _Call):
    """What the template depends on besides the block's structure; raises :class:`_Flat` when no
    template can stand for the call."""
    ins = (*state, *call.tensors)
    constants = call.constants()
    direct = tracing.current().direct
    unseen = direct.unseen if direct is not None else {}
    if constants is None:
        odd = next(x for x, t in zip(call.leaves, call.is_tensor)
                   if not t and type(x) not in _CONSTANT and caches.cache_key(x) is None)
        hint = " (HF models: config.use_cache=False to train)" if type(odd).__name__.endswith("Cache") else ""
        raise _Flat(f"an argument is a {type(odd).__name__}, neither a tensor nor a plain constant{hint}")
    if not all(isinstance(t, FunctionalTensor) or id(t) in unseen for t in ins):
        raise _Flat("a tensor it reads is not an input of the trace")
    if _unusual_modes():
        raise _Flat("called under autocast, a checkpoint, inference mode or a functorch transform")
    metas = layouts(ins)
    if any(isinstance(s, torch.SymInt) for meta in metas for s in (*meta[0], *meta[1], meta[2])):
        raise _Flat("symbolic sizes")
    return m.group, torch.is_grad_enabled(), metas, repr(call.spec), constants


def _unusual_modes() -> bool:
    """Autocast, saved-tensor hooks (checkpoint), functorch transforms, inference mode."""
    return (is_any_autocast_enabled() or torch.is_inference_mode_enabled()
            or top_saved_tensors_default_hooks(False) is not None or functorch_interpreter_active())


@contextlib.contextmanager
def _hooks_unchanged():
    """Yields a check that the template's trace registered no hook with the capture's recorder."""
    rec = tracing.current().hooks
    sizes = (len(rec.input_hooks), len(rec.retained)) if rec is not None else None
    yield lambda: rec is None or (len(rec.input_hooks), len(rec.retained)) == sizes
    if rec is not None and (len(rec.input_hooks), len(rec.retained)) != sizes:
        del rec.input_hooks[sizes[0]:], rec.retained[sizes[1]:]


@contextlib.contextmanager
def _watching(m: Member, stands: dict, raw: list):
    """Yields the set of indices into ``m.varying`` whose attribute the block's trace read, filled
    when the block ends: a template stands for a twin whose other values differ only there. This
    thread reads ``stands`` (by index) in place of those attributes' values; ``raw`` gets True when
    a read went around them (``vars(block)``)."""
    by_path: dict = {}
    for i, (path, attr) in enumerate(m.varying):
        by_path.setdefault(path, {}).setdefault(attr, []).append(i)
    subs = [{attr: stands[ix[0]] for attr, ix in names.items() if ix[0] in stands} for names in by_path.values()]
    read: set = set()
    with reads.attribute_reads([(m.paths[p], names) for p, names in by_path.items()], subs, raw) as seen:
        try:
            yield read
        finally:
            for names, got in zip(by_path.values(), seen):
                read.update(i for attr in got for i in names[attr])


def _trace_template(session: Session, module, m: Member, state, call: _Call, stands: dict, log: list):
    """``(template, cache effects)`` of the call; raises :class:`_Flat`, or
    :class:`per_call.Escaped` when a stand or a cache argument was used (also noted in ``log``)."""
    from .analyze import analyze
    sess = Session(dynamic=False, grad_enabled=torch.is_grad_enabled(),
                   shape_env=session.shape_env, fake_mode=session.fake_mode)
    with sess.fake_mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                 .requires_grad_(t.requires_grad) for t in (*state, *call.tensors)]
    n, out_specs, changed, effects = len(state), [], [], []

    def block_fn(*flat):
        effects.clear()
        outs: list = []     # the tensors the cache updates set, in order: extra outputs
        swap = caches.stand_ins(call.leaves, call.caches(), log, effects, outs)
        args, kwargs = call.rebuild(flat[n:], swap)
        before = pytree.tree_leaves((args, kwargs))
        with holding(m.homes, flat[:n]):
            out = module(*args, **kwargs)
        # A list or dict argument the block wrote (``cache.append(h)``, ``cache[i] = h``): the
        # template's calls would get a copy of it, and the caller's would never change.
        after, spec = pytree.tree_flatten((args, kwargs))
        changed.append(spec != call.spec or len(after) != len(before) or any(a is not b for a, b in zip(after, before)))
        leaves, spec = pytree.tree_flatten(out)
        out_specs.append(spec)
        return leaves + outs
    block_fn.module_state = lambda flat: holding(m.homes, flat[:n])
    analysis = analyze(sess, block_fn, fakes)
    if any(o.kind == "constant" and type(o.value) is per_call.Stand for o in analysis.outputs):
        log.append("returned")      # each call would return the stand, not its own value
        raise per_call.Escaped("a block returns a per-call value")
    if any(changed):
        raise _Flat("it writes a list or dict argument")
    # An output may be a view of the block's own intermediate (``nn.Linear`` on a 3-d input ends in
    # a view of its matmul): the template returns the base, and each call makes the view again.
    if analysis.mutated() or any(i.mutates_metadata for i in analysis.inputs) or any(
            o.kind not in ("plain", "intermediate_view", "input", "constant") or o.kind == "plain" and o.is_view
            or (o.is_leaf and o.requires_grad and o.kind != "input") for o in analysis.outputs):
        raise _Flat("it writes an input or returns a view of one")
    lay = layout(analysis)
    # The metadata pass ran the block's Python under the read recording already; watching the
    # joint trace (make_fx's Python too) would about double its cost for nothing.
    with reads.paused():
        joint = trace_joint(sess, block_fn, fakes, analysis, lay, engine_sums=True)
    if per_call.in_graph(joint):
        raise per_call.Escaped("an op was given a per-call value")
    if any(x.op == "get_attr" and not _plain_constant(getattr(joint, x.target, None))
           or str(x.target).startswith("aotgrad.") for x in joint.graph.nodes):
        raise _Flat("its graph holds a traced tensor as a constant or an aotgrad run-time op")
    # The clean-up capture runs on the whole joint, run once here: each copy is stamped without
    # the detaches and dead nodes it would drop from every copy again. Random ops stay: each copy
    # draws at the place in the stream its call has (block_graph.Template.random).
    joint = simplify_owned(joint)
    views = tuple(None if o.kind == "plain" else o for o in analysis.outputs)
    template = block_graph.split(next(_keys), joint, len(fakes), out_specs[-1], lay.tangent_of, lay.grad_of,
                                 views if any(views) else (), first_argument=n)
    # A random op in the backward (a custom Function's backward drawing) draws when backward() runs,
    # from the stream as it then stands: not a place a forward call can take for it.
    if any(is_random(n) for n in template.bw_nodes):
        raise _Flat("its backward draws random numbers")
    # A draw only the backward depends on is a recomputation's (a checkpoint inside the block:
    # eager restores the stream and draws the same numbers again); a call's place in the stream
    # cannot stand for it, the flat trace pairs it with the draw it repeats.
    if template.random and set(template.random) & (ancestors(template.bw_outs) - ancestors(template.fw_outs)):
        raise _Flat("it recomputes random ops in its backward (activation checkpointing inside it)")
    return template, tuple(effects)


def _same_template(a: Traced, b: Traced) -> bool:
    """Whether two traces of one block made one template: the same nodes (ops, arguments, layouts,
    wiring, outputs; floats by their bits), the same constants, the same outputs' structure and
    gradients, as many cache updates (their layer index is a stand in one and a number in the
    other; what they set is among the nodes). The names its constants were given aside."""
    ta, tb = a.template, b.template
    facets = ("n_in", "out_spec", "n_out", "differentiable", "grad_at", "summed", "copies")
    if len(a.effects) != len(b.effects) or any(getattr(ta, f) != getattr(tb, f) for f in facets) \
            or list(map(_view_facets, ta.views)) != list(map(_view_facets, tb.views)):
        return False
    na = [n for n in ta.graph.graph.nodes if n.op != "get_attr"]
    nb = [n for n in tb.graph.graph.nodes if n.op != "get_attr"]
    sa, sb = regions.signature(na, layouts=True), regions.signature(nb, layouts=True)
    if sa is None or sb is None or sa[2] != sb[2]:
        return False
    ka = [getattr(ta.graph, n.target) if n.op == "get_attr" else None for n in sa[0]]
    kb = [getattr(tb.graph, n.target) if n.op == "get_attr" else None for n in sb[0]]
    with disable_current_modes():   # the constants are real tensors, compared inside the capture's trace
        return all((x is None) == (y is None) and (x is None or x.dtype == y.dtype and x.shape == y.shape
                                                   and torch.equal(x, y)) for x, y in zip(ka, kb))


def _view_facets(v):
    """An output's ``OutputInfo`` as comparable data (its replay is live objects)."""
    if v is None:
        return None
    value = None if isinstance(v.value, torch.Tensor) else regions.constant(v.value)
    return v.kind, v.index, v.view, v.requires_grad, v.is_leaf, v.is_view, value


def _plain_constant(t) -> bool:
    """A constant the program made (``torch.tensor([])``): a real tensor, not one of the trace's."""
    return type(t) is torch.Tensor and not t.requires_grad


def _with_views(values: list, views: tuple, ins: list) -> list:
    """The block's outputs from the template's forward values: the plain outputs, then the bases
    the views among them (``views``: each output's ``OutputInfo``, None for a plain one) are made of;
    an output that is one of the block's inputs (``ins``: T5's attention returns the position bias
    it was given) is this call's own, a number it returns the template's (what made it was read
    by the template's key, its stands and questions)."""
    if not views:
        return values
    n_plain = sum(v is None for v in views)
    plain = iter(values[:n_plain])
    return [next(plain) if v is None else ins[v.index] if v.kind == "input" else v.value if v.kind == "constant"
            else as_view(values[n_plain + v.index], v, None) for v in views]


def unseen_inputs(reuse: Reuse, setup, analysis) -> frozenset:
    """Indices of the inputs the joint's trace need not take (see :class:`.block_graph.Direct`): the
    parameters and buffers of one repeated block each, not shared with another block, passed once,
    not written or returned by the program, of a block no call of which ran flat in the metadata
    pass (a template refused: random ops, a mutation). Other uses are found by the trace itself."""
    if setup.rebase is not None:
        return frozenset()
    index: dict = {}
    for i, t in enumerate(setup.real_inputs):
        index[id(t)] = None if id(t) in index else i
    owners: dict = {}       # tensor id -> how many members hold it (None: one that ran flat does)
    for k, m in reuse.members.items():
        if m.inner:     # its tensors are its outer block's too
            continue
        for md, kind, attr in m.firsts:
            tid = id(md[kind][attr])
            owners[tid] = None if k in reuse.ran_flat or tid in owners else 1
    returned = {o.index for o in analysis.outputs if o.kind in ("input", "input_view", "input_detached", "input_set")}
    unseen = set()
    for tid, count in owners.items():
        i = index.get(tid)
        if count == 1 and i is not None and i not in returned:
            info = analysis.inputs[i]
            if not (info.mutates_data or info.mutates_metadata):
                unseen.add(i)
    return frozenset(unseen)


def _reads_in(module, frames, paths) -> tuple | None:
    """Each read the frames of a template's trace make when the block is ``module`` (submodules by
    path: ``paths``), rooted at the block (``block.attn.n_head``), the module tree's structure aside
    (the twins' key compares it); None where a read cannot be resolved (it would be refused at capture)."""
    ran = {i: _rebound(f, self_path, arg_paths, paths) for i, (f, self_path, arg_paths) in enumerate(frames)}
    rec = types.SimpleNamespace(frames=ran, switches={}, reflected=[])
    try:
        return tuple(resolve.Resolver(module, (), resolve.TWIN, rec, structure=False).resolve())
    except AotgradError:
        return None


def _facets(r) -> tuple:
    return r.source, r.kind, r.value


def _same_read(kind, was, now) -> bool:
    if kind in ("id", "type"):
        return was is now
    if kind == "eq":
        return freeze(was) == freeze(now)
    if kind == "dict":
        return list(was.items()) == list(now.items())
    return was == now       # frozen values, lengths, absences


def _varying_source(m: Member, i: int) -> str:
    path, attr = m.varying[i]
    return ".".join(filter(None, (resolve.TWIN, path, attr)))


def _replay_reads(rec, frames, paths, block, found) -> None:
    """Record on this block's objects the calls of its modules the template's trace recorded on the
    first block's; the reads of the rest of its frames are its proof's (``found``: ``Reuse._proven``),
    which the capture's resolver takes where they still hold, else it resolves those frames
    (``Resolver.resolve``)."""
    rest = []
    for f, self_path, arg_paths in frames:
        f = _rebound(f, self_path, arg_paths, paths)
        if f.kind != reads.MODULE_CALL:
            rest.append(f)
            continue
        g = f.globals
        key = (f.code, id(g) if g is not None else None, id(f.self_obj),
               tuple(sorted((n, id(v)) for n, v in f.args.items())) if f.kind == reads.USER else ())
        rec.frames.setdefault(key, f)
    rec.twins.append((block, found, tuple(rest)))


def _rebound(f, self_path, arg_paths, paths):
    """A frame of the template's trace as this block's: its ``self`` and object arguments that are the
    template block's objects (``self_path``, ``arg_paths``) replaced by this block's (``paths``)."""
    obj = paths[self_path] if self_path is not None else f.self_obj
    # (built directly: ``dataclasses.replace`` reads the fields again each call, twice per frame a twin)
    return reads.Frame(f.code, f.kind, f.globals, obj, {**f.args, **{n: paths[p] for n, p in arg_paths.items()}},
                       f.containers)


@contextlib.contextmanager
def reusing(setup, members: dict):
    """While tracing ``setup``'s function, calls of the repeated blocks ``members``
    (:func:`.block_groups.repeated`) go through templates."""
    reuse = Reuse(setup.session, members, reads.watching())
    with MODULE_CALLS(), tracing.scope(blocks=reuse):
        try:
            yield reuse
        finally:
            for entries in reuse.traced.values():
                for e in entries:
                    if e.traced is not None:
                        block_graph.TEMPLATES.pop(e.traced.template.key, None)
