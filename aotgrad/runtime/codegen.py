"""Turn an FX graph into one straight-line Python function.

Unlike ``GraphModule.__call__`` this skips ``nn.Module`` dispatch and calls
each ATen overload's C++ entry point directly (``OpOverload._op``), saving a
Python frame per operator; intermediates are released right after their last
use, as FX's own code does.

Generated source (this module's graphs, and the guards') is compiled by :func:`compile_source`
under a file name registered with :mod:`linecache`, so tracebacks, ``inspect.getsource`` and
debuggers show the generated lines instead of nothing.
"""
from __future__ import annotations

import itertools
import linecache
import operator
import re

import torch
import torch.fx as fx

from .. import errors
from .._torch import OpOverload
from . import regions


class _Emitter:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.globals: dict = {"torch": torch}
        self.names: dict[fx.Node, str] = {}

    def bind(self, value, hint: str) -> str:
        name = f"_{hint}{len(self.globals)}"
        self.globals[name] = value
        return name

    def arg(self, a) -> str:
        if isinstance(a, fx.Node):
            return self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        if a is None or isinstance(a, (bool, int, str)):
            return repr(a)
        if isinstance(a, float) and a == a and a not in (float("inf"), float("-inf")):
            return repr(a)
        return self.bind(a, "c")

    def call(self, n: fx.Node) -> str:
        t = n.target
        if t is operator.getitem:
            return f"{self.arg(n.args[0])}[{self.arg(n.args[1])}]"
        fn = t._op if isinstance(t, OpOverload) else t
        parts = [self.arg(a) for a in n.args] + [f"{k}={self.arg(v)}" for k, v in n.kwargs.items()]
        return f"{self.bind(fn, 'f')}({', '.join(parts)})"


class _OpFailure:
    """Raised into by a generated graph whose operator refused its inputs (a dtype, device or value
    check that fake tensors skip while tracing): an ``OpError`` naming the operator, its inputs and
    the user's line. An exception from deeper Python code (a hook the graph calls) passes unchanged."""

    def __init__(self, name: str, first: int, at: list):
        self.name, self.first, self.at = name, first, at

    def __call__(self, e: BaseException):
        tb = e.__traceback__
        while tb.tb_next is not None and tb.tb_next.tb_frame.f_code.co_name == self.name:
            tb = tb.tb_next
        i = tb.tb_lineno - self.first
        node = self.at[i] if tb.tb_next is None and 0 <= i < len(self.at) else None
        if node is None or type(e) is not RuntimeError:     # a typed error of torch's (LinAlgError) stays
            raise e
        raise errors.OpError(f"{node.target} refused its inputs ({_describe(node)}) as the compiled {self.name} "
                             f"graph ran: {str(e).strip().splitlines()[0][:300]}",
                             user_line=errors.traced_line(node.meta.get("stack_trace"))) from e


def _describe(node: fx.Node) -> str:
    def one(a):
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(x) for x in a) + "]"
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)} on {v.device.type}"
        return type(a).__name__ if isinstance(a, fx.Node) else repr(a)[:20]
    return ", ".join(one(a) for a in node.args)


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def python_function(gm: fx.GraphModule, name: str = "graph", boxed: bool = False, compile_region=None,
                    found=None):
    """A plain function computing ``gm``; its source is kept on ``fn.source``.

    ``boxed``: the function takes one list of inputs and empties it, so each
    input is freed right after its last use (a backward's saved activations)
    instead of living until the call returns; it is marked ``_boxed_call``.

    The copies of one repeated block that :func:`.regions.repeated` finds equal (``found``: those
    to compile so) are compiled once and called per copy, boxed (what a copy reads last dies inside
    it): by ``compile_region(region, name)`` (a backend's compiler; their layouts must then be equal
    too), else as a Python function like this one.
    """
    name = re.sub(r"\W", "_", name)
    name = name if name.isidentifier() else f"graph_{name}"
    if found is None:       # copies exist only where block reuse tagged nodes
        tagged = regions.ENABLED and any(regions.TAG in n.meta for n in gm.graph.nodes)
        found = regions.repeated(gm.graph) if tagged else ()
    fn = _function(gm, gm.graph, name, boxed, found, compile_region or _python_region)
    if found:
        regions.used(gm, found)
    return fn


def _python_region(r: regions.Region, name: str):
    return _function(None, r.graph(), name, True, (), None)


def _function(root, graph: fx.Graph, name: str, boxed: bool, outlined, compile_region):
    em = _Emitter(root)
    starts = {r.nodes[0]: r for r in outlined}
    inside = {n for r in outlined for n in r.nodes}
    items = [starts.get(n, n) for n in graph.nodes if n in starts or n not in inside]
    last_use: dict[fx.Node, object] = {}
    for it in items:
        for a in (it.inputs if isinstance(it, regions.Region) else it.all_input_nodes):
            last_use[a] = it
    compiled: dict = {}     # region key -> the bound name of its function
    params, body, at = [], [], []     # at[i]: the node body line i computes
    unpacked = _unpacked(items)
    for n in items:
        if type(n) is fx.Node and n in unpacked.taken:
            continue            # bound where its call unpacks its result (a Region is never one)
        if isinstance(n, regions.Region):
            body.append(_region_call(em, n, compiled, lambda r, k=n.key: compile_region(r, f"{name}_block{k}"),
                                     last_use))
            at.append(None)
            continue
        var = n.name
        em.names[n] = var
        if n.op == "placeholder":
            params.append(var)
            continue
        if n.op == "get_attr":
            em.names[n] = em.bind(_fetch(root, n.target), "a")
            continue
        if n.op == "output":
            body.append(f"return {em.arg(tuple(n.args[0]))}")
            at.append(None)
            continue
        assert n.op == "call_function", f"cannot generate code for {n.op} node {n}"
        items_of = unpacked.get(n)
        if items_of is not None:
            for g in items_of:
                if g is not None:
                    em.names[g] = g.name
            var = ", ".join(g.name if g is not None else "_" for g in items_of) + ("," if len(items_of) == 1 else "")
        dead = [em.names[a] for a in n.all_input_nodes if last_use.get(a) is n and a.op != "get_attr"]
        if getattr(n.target, "_boxed_call", False):     # a block's half: what it reads last dies inside it
            body.append(f"_b = {em.arg(n.args[0])}" + (f"; del {', '.join(dead)}" if dead else ""))
            at.append(n)
            dead, call = [], f"{em.bind(n.target, 'f')}(_b)"
        else:
            call = em.call(n)
        body.append(f"{var} = {call}")
        at.append(n)
        dead += ["_"] * (items_of is not None and None in items_of)
        if dead:
            body.append(f"del {', '.join(dead)}")
            at.append(None)
    head = []
    if boxed:
        head = [f"{', '.join(params)}{',' if len(params) == 1 else ''} = args" if params else "pass", "args.clear()"]
        params = ["args"]
    fail = em.bind(_OpFailure(name, 2 + len(head) + 1, at), "fail")
    lines = [*head, "try:", *(f"    {b}" for b in body), "except RuntimeError as e:", f"    {fail}(e)"]
    src = f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile_source(src, name), em.globals)
    fn = em.globals[name]
    fn.source = src
    fn._boxed_call = boxed
    return fn


class _Unpacked(dict):
    """call node -> its result's items by position (None where nothing reads one); ``taken``: the
    getitem nodes those bind."""
    taken: frozenset = frozenset()


def _unpacked(items: list) -> _Unpacked:
    """The calls whose result only ``getitem`` nodes with constant positions read: one line unpacks
    the result (``a, _, b = f(...)``, then ``del _``: an item nothing reads dies at once) instead of
    a line per item (a block's half returns its saved values, 16 a layer for a GPT block)."""
    out = _Unpacked()
    emitted = set(items)        # a getitem inside a region reads the call by its name: left as is
    for n in items:
        val = n.meta.get("val") if isinstance(n, fx.Node) and n.op == "call_function" else None
        if type(val) not in (list, tuple) or not val or not n.users \
                or any(u not in emitted or u.target is not operator.getitem or type(u.args[1]) is not int
                       or not 0 <= u.args[1] < len(val) or u.args[0] is not n for u in n.users):
            continue
        by = [None] * len(val)
        for u in n.users:
            if by[u.args[1]] is not None:
                break           # one item read by two getitem nodes: left as lines
            by[u.args[1]] = u
        else:
            out[n] = by
    out.taken = frozenset(g for by in out.values() for g in by if g is not None)
    for by in out.values():     # an item nothing reads (a trace unpacks every one) dies at once
        by[:] = [g if g is not None and g.users else None for g in by]
    return out


def _region_call(em: _Emitter, r: regions.Region, compiled: dict, compile_region, last_use: dict) -> str:
    """One line calling the function of ``r``'s key (compiled from the first run of it): its inputs
    go in a list the function empties, and the caller's names for those read last here go first."""
    if r.key not in compiled:
        compiled[r.key] = em.bind(compile_region(r), "block")
    ins = [em.names[a] for a in r.inputs]
    dead = [em.names[a] for a in r.inputs if last_use.get(a) is r and a.op != "get_attr"]
    for o in r.outputs:
        em.names[o] = o.name
    outs = "".join(f"{o.name}, " for o in r.outputs) + "= " * bool(r.outputs)    # none: random draws alone
    return f"_b = [{', '.join(ins)}]; {'del ' + ', '.join(dead) + '; ' if dead else ''}{outs}{compiled[r.key]}(_b)"


# --- compiling generated source

_numbers = itertools.count()


def compile_source(src: str, what: str):
    """``compile(src, ..., "exec")`` under a fresh ``<aotgrad what #n>`` file name whose lines
    ``linecache`` knows (an entry with no modification time survives ``checkcache``)."""
    filename = f"<aotgrad {what} #{next(_numbers)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    return compile(src, filename, "exec")


def source_of(fn) -> str | None:
    """The generated source ``fn`` was compiled from (by :func:`compile_source`), or None."""
    code = getattr(fn, "__code__", None)
    if code is None or not code.co_filename.startswith("<aotgrad "):
        return None
    return "".join(linecache.getlines(code.co_filename)) or None
