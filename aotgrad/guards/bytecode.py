"""What a code object reads and writes, from its bytecode: the access chains its loads make
(``SCALE``, ``self.fc.weight``, ``helpers.act``, ``cfg['lr']``, ``type(x).k``, ``getattr(x, "k")``)
and the stores to state that outlives the call (a global, a closure cell, an attribute of an
argument, a container changed by a method). Read once per code object and cached; Python 3.11's
spelling, newer Pythons' instructions normalized to it.
"""
from __future__ import annotations

import dis
import functools
from dataclasses import dataclass

@dataclass(frozen=True)
class Chain:
    root: str            # "global", "deref" (a free variable), "fast" (an argument), "globals" (every global),
    #                      "import" (a module the code imports: ``name`` its dotted name, relative ones led by dots)
    name: str
    steps: tuple         # ("attr", name) or ("item", constant), in load order
    line: int | None


@dataclass(frozen=True)
class Store:
    """An assignment to state that outlives the call (a global, a closure cell, an attribute of an argument)."""
    target: str
    line: int | None
    on: Chain | None = None     # an attribute write's: the chain of the object written (None: no chain names it)
    name: str | None = None     # and the attribute's name (``ANY``: ``setattr(x, ...)``, ``x.__dict__[k] = v``)


ANY = "*"


_ROOTS = {"LOAD_GLOBAL": "global", "LOAD_DEREF": "deref", "LOAD_CLASSDEREF": "deref", "LOAD_FAST": "fast"}
_ATTR = ("LOAD_ATTR", "LOAD_METHOD")
# Methods that change a list, dict or set in place: ``HISTORY.append(x)`` writes to ``HISTORY``.
# A container's methods that change it: one loaded as a value is a store on it here; one its thread
# called (a C call whose ``__self__`` it is) makes a change of it the capture's (``attribution``).
CHANGERS = frozenset((
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "__setitem__", "__delitem__", "difference_update", "intersection_update",
    "symmetric_difference_update", "__iadd__", "__ior__", "__imul__", "__isub__", "__iand__", "__ixor__"))
_MUTATORS = frozenset(("attr", m) for m in CHANGERS)


@functools.cache        # a true cache: code objects are immutable, so their chains never change
def chains(code) -> tuple:
    """``(chains, stores)`` of one code object (cached)."""
    return _scan(code)


def _scan(code, instructions=None):
    n_args = code.co_argcount + code.co_kwonlyargcount
    args, free = set(code.co_varnames[:n_args]), set(code.co_freevars)
    found, stores, cur, line, pending = [], [], None, None, None
    ins_list = _normalized(dis.get_instructions(code) if instructions is None else instructions)
    imports = _imports(ins_list, args)
    callee, ended = None, None      # ``cur`` is the first argument of a call of a builtin in _THROUGH
    copied = None       # the chain ``x.k += v`` copies for its store of ``k`` (``COPY 1`` ... ``SWAP 2; STORE_ATTR``)
    setter, space = False, None     # ``cur`` is the object a setter call writes; (a namespace loaded, its line)
    by_vars = False     # the setter is ``vars`` itself (its dict is written where it is then used)
    skip, last = 0, (None, -1)      # (the chain an instruction ended last, its index)
    for at, ins in enumerate(ins_list):
        line = ins.positions.lineno if getattr(ins, "positions", None) and ins.positions.lineno else line
        if skip:
            skip -= 1
            continue
        if ins.opname == "LOAD_CONST" and ins.argval in SETTER_NAMES:
            # ``getattr(object, "__setattr__")(x, ...)``, ``methodcaller("__setattr__", ...)``: a setter
            # looked up by its name, called where no chain shows on what
            stores.append(Store("", line, None, ANY))
        op = ins.opname
        sup, skip = _super(cur, code, ins_list, at) if cur is not None else (None, 0)
        if sup is not None:
            cur = sup
            continue
        if callee is not None and cur is not None:
            step, skip = _through(callee, ins_list, at)
            if step is not None:        # ``type(x)``, ``vars(x)``, ``getattr(x, "k"[, d])``, ``hasattr(x, "k")``
                cur, callee = Chain(cur.root, cur.name, cur.steps + (step,), cur.line), None
                # (``vars(x).update(...)``: written where the dict is; ``operator.setitem(vars(x), ...)``: here)
                setter = setter and not (by_vars and step == ("attr", "__dict__"))
                continue
            if callee in ("getattr", "hasattr") and op not in _ATTR and not (
                    op == "LOAD_CONST" and at + 1 < len(ins_list) and ins_list[at + 1].opname == "BINARY_SUBSCR"):
                # a name computed at run time (``getattr(self, name)``): any attribute may be the one read
                cur = Chain(cur.root, cur.name, cur.steps + (("any", None),), cur.line)
                callee = None
        if op not in _ATTR + ("LOAD_CONST", "BINARY_SUBSCR"):
            callee = None
        ended = _callee(cur)
        if cur is not None and op in _ATTR:
            cur = Chain(cur.root, cur.name, cur.steps + (("attr", ins.argval),), cur.line)
            continue
        if cur is not None and op == "LOAD_CONST" and isinstance(ins.argval, (str, int)):
            step, skip = _method_read(cur, ins_list, at)
            if step is not None:        # ``x.__getattribute__("k")``, ``x.__dict__.get("k"[, d])``
                cur = Chain(cur.root, cur.name, cur.steps[:-1] + (step,), cur.line)
                continue
            pending = ins.argval
            continue
        if cur is not None and op == "BINARY_SUBSCR" and pending is not None:
            cur, pending = Chain(cur.root, cur.name, cur.steps + (("item", pending),), cur.line), None
            continue
        if op == "COPY":
            copied = cur if ins.argval == 1 else None
        if op in ("STORE_ATTR", "DELETE_ATTR"):     # ``self.n += 1`` leaves no chain before its store
            on = cur if cur is not None else copied if at and ins_list[at - 1].opname == "SWAP" else None
            stores.append(Store((_text(cur) if cur is not None else "") + "." + ins.argval, line, on, ins.argval))
        if op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            # the container: the chain before a constant key, or the chain the key's one load ended
            # (``self._buffers[name] = t``); a key computed otherwise leaves it unnamed
            box = cur if cur is not None and pending is not None else last[0] if last[1] == at - 1 \
                and ins_list[at - 1].opname in _KEY_LOADS else None
            if box is not None or cur is not None:
                stores.append(Store(_text(box if box is not None else cur) + "[...]", line, box,
                                    None if box is None else _name(pending, box is cur)))
        ns = cur if cur is not None and _namespace(cur) else space[0] if space and space[1] == line else None
        if op in ("STORE_SUBSCR", "DELETE_SUBSCR") and ns is not None and ns is not box:
            # ``x.__dict__["k"] = v``, ``globals()[k] += 1`` (its key loaded after the namespace, on its line)
            stores.append(Store(_text(ns) + "[...]", line, ns, _name(pending, ns is cur)))
        target = False
        if cur is not None:
            cur = _ended(cur, op)
            found.append(cur)
            last = (cur, at)
            if cur.steps and cur.steps[-1] in _MUTATORS:
                # ``L.append(x)``, ``map(L.append, xs)``: a write of the container; ``vars(x).update(...)``: of
                # x's attributes (a method handed to C is called where no profile event shows it)
                stores.append(Store(_text(cur), line, _less(cur), ANY))
            elif op in ("STORE_FAST", "STORE_DEREF") and _namespace(cur):     # ``d = vars(x)``: written as ``d``
                stores.append(Store(_text(cur), line, cur, ANY))
            if cur.steps and cur.steps[-1][1] in _SETTERS and cur.steps[-1][0] in ("attr", "anyclass"):
                stores.append(Store(_text(cur), line, _less(cur), ANY))     # ``self.__setattr__``, ``super().__setattr__``
            if setter:      # (a call's result, or a reading function's: named by the chain after)
                target = _callee(cur) in _THROUGH
                if not target:
                    called = op.startswith(("PRECALL", "CALL")) and not (isinstance(ins.argval, int) and ins.argval > 1)
                    stores.append(Store(_text(cur), line, None if called else cur, _name(pending, True)))
            if not target and _sets(cur):
                target, by_vars = True, not cur.steps and cur.name == "vars"
            space = (cur, line) if _namespace(cur) else space
        elif op in _ATTR and ins.argval in ("__dict__", *_SETTERS):     # (``f().__dict__``: of no chain)
            stores.append(Store("", line, None, ANY))
        cur, pending, setter = None, None, False
        root = _ROOTS.get(op)
        if root == "deref" and ins.argval in args:
            # An argument nested code closes over (``self`` read in a comprehension too) is a cell
            # of this frame, loaded with LOAD_DEREF: still the argument.
            root = "fast"
        if root == "deref" and ins.argval not in free or root == "fast" and ins.argval not in args:
            root = None
        if root is None and op == "LOAD_FAST" and ins.argval in imports:
            cur, setter = Chain("import", *imports[ins.argval], line), target
        elif root is not None:
            callee = ended if ended in _THROUGH else None    # the reading function loaded just before this chain
            cur, setter = Chain(root, ins.argval, (), line), target
        elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.append(Store(ins.argval, line, _GLOBALS, ins.argval))
        elif op == "STORE_DEREF" and ins.argval in free:
            stores.append(Store(ins.argval, line))
        if target and not setter:       # ``setattr(f(), ...)``: an object no chain names
            stores.append(Store("", line, None, ANY))
    if cur is not None:
        found.append(cur)
    return tuple(dict.fromkeys(found)), tuple(stores)


_SETTERS = ("__setattr__", "__delattr__")
SETTER_NAMES = frozenset(("setattr", "delattr", *_SETTERS))     # (as strings: a setter looked up)
_KEY_LOADS = ("LOAD_FAST", "LOAD_CONST", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLASSDEREF")
_GLOBALS = Chain("globals", "", (), None)


def _name(pending, given: bool) -> str:
    """The attribute a setter or a namespace's item names: the string constant given after the object, or any."""
    return pending if given and isinstance(pending, str) else ANY


def _sets(chain) -> bool:
    """Whether ``chain`` is a function whose call writes its first argument: an attribute of it, whichever
    it names (``setattr``, ``delattr``, ``vars``: the dict it answers, ``object.__setattr__``), or its
    items (``operator.setitem``, ``operator.iadd``, ``dict.__setitem__``, ``list.append``: a container's
    changing method called on the type)."""
    if not chain.steps:
        return chain.root == "global" and chain.name in ("setattr", "delattr", "vars", *_OPERATOR_WRITES)
    kind, name = chain.steps[-1]
    return name in _SETTERS or len(chain.steps) == 1 and kind == "attr" and chain.root in ("global", "import") and (
        chain.name == "operator" and name in _OPERATOR_WRITES or chain.name in _CONTAINER_TYPE_NAMES and (kind, name) in _MUTATORS)


# operator's functions writing their first argument; the types whose changing methods write theirs
_OPERATOR_WRITES = frozenset(("setitem", "delitem", "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul",
                              "imod", "imul", "ior", "ipow", "irshift", "isub", "itruediv", "ixor"))
_CONTAINER_TYPE_NAMES = frozenset(("dict", "list", "set", "bytearray", "OrderedDict", "defaultdict", "deque", "Counter"))


def _namespace(chain, drop=0) -> bool:
    """Whether ``chain`` (less its last ``drop`` steps) is a namespace: an object's ``__dict__``, ``globals()``."""
    steps = chain.steps[:len(chain.steps) - drop]
    return steps[-1:] == (("attr", "__dict__"),) or not steps and chain.root == "globals"


def _less(chain) -> Chain:
    return Chain(chain.root, chain.name, chain.steps[:-1], chain.line)


def _imports(ins, args) -> dict:
    """The local names only ``import`` statements bind: name -> (the module's name, led by a dot per
    level of a relative import; the steps from it). ``import a.b`` binds ``a``; ``import a.b as c``
    binds ``a.b``; ``from a import x`` binds ``a``'s ``x``."""
    bound: dict = {}        # name -> what each import binding it binds
    stored = [i.argval for i in ins if i.opname in ("STORE_FAST", "DELETE_FAST")]
    for at, i in enumerate(ins):
        if i.opname != "IMPORT_NAME" or at < 2 or ins[at - 2].opname != "LOAD_CONST":
            continue
        fromlist, name = ins[at - 1].argval, "." * ins[at - 2].argval + i.argval
        k = at + 1
        if fromlist is None and k < len(ins) and ins[k].opname == "STORE_FAST":     # (no relative form)
            bound.setdefault(ins[k].argval, []).append((name.split(".")[0], ()))
            continue
        while k < len(ins) and ins[k].opname in ("IMPORT_FROM", "SWAP", "POP_TOP"):
            k += 1      # ``import a.b as c``: each IMPORT_FROM steps into a submodule
            if fromlist is not None and ins[k - 1].opname == "IMPORT_FROM" and k < len(ins) \
                    and ins[k].opname == "STORE_FAST":
                bound.setdefault(ins[k].argval, []).append((name, (("attr", ins[k - 1].argval),)))
                k += 1
        if fromlist is None and k < len(ins) and ins[k].opname == "STORE_FAST":
            bound.setdefault(ins[k].argval, []).append((name, ()))
    # a name also bound otherwise (assigned, an argument, imports of two things) is a plain local
    return {n: v[0] for n, v in bound.items() if n not in args and stored.count(n) == len(v) and len(set(v)) == 1}


_PAIRS = {"LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"), "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
          "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST")}
_SAME = {"LOAD_FAST_CHECK": "LOAD_FAST", "LOAD_FAST_BORROW": "LOAD_FAST"}


def _normalized(instructions) -> list:
    """Instructions as 3.11 spells them: newer Pythons' paired loads and stores
    (``LOAD_FAST_LOAD_FAST (x, self)``, 3.13) are two instructions, and ``PUSH_NULL`` (which 3.13
    puts between a called function and its arguments) is dropped."""
    out = []
    for ins in instructions:
        if ins.opname == "PUSH_NULL":
            continue
        pair = _PAIRS.get(ins.opname)
        if pair is not None and isinstance(ins.argval, tuple) and len(ins.argval) == 2:
            out += [ins._replace(opname=op, argval=name) for op, name in zip(pair, ins.argval)]
        else:
            out.append(ins._replace(opname=_SAME[ins.opname]) if ins.opname in _SAME else ins)
    return out


def _super(cur, code, ins, at):
    """``(chain, instructions to skip)`` where ``cur`` with ``ins[at:]`` is ``super().k``: ``k`` read in
    every class of the first argument (3.11: a call of ``super``; 3.12: its own instruction); or a
    call of ``globals()`` (:func:`_globals`)."""
    if cur.root == "global" and cur.name == "globals" and not cur.steps:
        return _globals(cur, ins, at)
    if ins[at].opname == "LOAD_SUPER_ATTR" and cur.root == "fast" and not cur.steps:
        return Chain(cur.root, cur.name, (("anyclass", ins[at].argval),), cur.line), 0
    if cur.root == "global" and cur.name == "super" and not cur.steps and code.co_argcount:
        end = _call_at(ins, at, 0)
        if end is not False and end + 1 < len(ins) and ins[end + 1].opname in _ATTR:
            return Chain("fast", code.co_varnames[0], (("anyclass", ins[end + 1].argval),), cur.line), end + 1 - at
    return None, 0


def _globals(cur, ins, at):
    """``(chain, instructions to skip)`` where ``ins[at:]`` calls ``globals()``: ``globals()["K"]`` and
    ``globals().get("K"[, default])`` are the global ``K``; any other use of the dict (a name computed
    at run time, iterating it) is every global, the chain rooted at ``"globals"``."""
    end = _call_at(ins, at, 0)
    if end is False:
        return None, 0
    k = end + 1
    name = ins[k].argval if k < len(ins) and ins[k].opname == "LOAD_CONST" else None
    if isinstance(name, str) and k + 1 < len(ins) and ins[k + 1].opname == "BINARY_SUBSCR":
        return Chain("global", name, (), cur.line), k + 1 - at
    if k + 1 < len(ins) and ins[k].opname in _ATTR and ins[k].argval == "get" \
            and ins[k + 1].opname == "LOAD_CONST" and isinstance(ins[k + 1].argval, str):
        done = _call_at(ins, k + 2, 1)
        if done is False and k + 2 < len(ins) and ins[k + 2].opname == "LOAD_CONST":
            done = _call_at(ins, k + 3, 2)
        if done is not False:
            return Chain("global", ins[k + 1].argval, (), cur.line), done - at
    return Chain("globals", "", (), cur.line), end - at


def _ended(cur, op) -> Chain:
    """The chain ``cur`` as the instruction ``op`` ends it: iterated (``for v in self.it``: an iterator
    is advanced), or ``x.__getattribute__(name)`` with a name computed at run time (a class's own,
    ``object.__getattribute__``, is a library object where following stops at once)."""
    if op == "GET_ITER":
        return Chain(cur.root, cur.name, cur.steps + (("iter", None),), cur.line)
    if cur.steps and cur.steps[-1] in _GETATTRS:
        return Chain(cur.root, cur.name, cur.steps[:-1] + (("any", None),), cur.line)
    return cur


# Functions whose call with a chain as first argument reads on along it: ``type(x).k`` is
# ``x.__class__.k``, ``vars(x)["k"]`` is ``x.__dict__["k"]``, ``getattr(x, "k")`` and ``hasattr(x, "k")`` read
# ``x.k``, and so do ``object.__getattribute__(x, "k")``, ``nn.Module.__getattr__(x, "k")`` and
# ``inspect.getattr_static(x, "k")`` (each a "getattr" here).
_THROUGH = ("type", "vars", "getattr", "hasattr", "next")
_GETATTRS = frozenset(("attr", n) for n in ("__getattribute__", "__getattr__", "getattr_static"))


def _callee(chain) -> str | None:
    """Which reading function of ``_THROUGH`` the chain just loaded is, if it is one."""
    if chain is None:
        return None
    if chain.steps:
        return "getattr" if chain.steps[-1] in _GETATTRS else None
    return ("getattr" if chain.name == "getattr_static" else chain.name) if chain.root == "global" else None


def _method_read(chain, ins, at):
    """``(step, instructions to skip)`` where the chain's last step is a method that reads an entry named
    by the constant at ``ins[at]`` and is called with it: ``x.__getattribute__("k")`` reads ``x.k``,
    ``d.get("k"[, default])`` reads ``d["k"]`` where ``d`` is a dict (a "get" step)."""
    last = chain.steps[-1] if chain.steps else None
    if last in _GETATTRS and isinstance(ins[at].argval, str):
        end = _call_at(ins, at + 1, 1)
        return (("attr", ins[at].argval), end - at) if end is not False else (None, 0)
    if last == ("attr", "get"):
        end = _call_at(ins, at + 1, 1)
        if end is False and at + 1 < len(ins) and ins[at + 1].opname == "LOAD_CONST":
            end = _call_at(ins, at + 2, 2)
        return (("get", ins[at].argval), end - at) if end is not False else (None, 0)
    return None, 0


def _call_at(ins, k, n):
    """The index of the call of ``n`` arguments that ``ins[k:]`` is (3.11: PRECALL first), else False."""
    if k < len(ins) and ins[k].opname == "PRECALL":
        k += 1
    return k < len(ins) and ins[k].opname == "CALL" and ins[k].argval == n and k


def _through(callee, ins, at):
    """``(step, instructions to skip after this one)`` where ``ins[at:]`` ends the call of ``callee``
    whose first argument was just loaded, else ``(None, 0)``."""
    call = functools.partial(_call_at, ins)
    if callee == "next":        # ``next(x)``, ``next(x, default)``: x advanced
        end = call(at, 1)
        if end is False and ins[at].opname == "LOAD_CONST":
            end = call(at + 1, 2)
        return (("next", None), end - at) if end is not False else (None, 0)
    if callee in ("type", "vars"):
        end = call(at, 1)
        return ((("attr", "__class__" if callee == "type" else "__dict__"), end - at) if end is not False
                else (None, 0))
    if ins[at].opname != "LOAD_CONST" or not isinstance(ins[at].argval, str):
        return None, 0
    end = call(at + 1, 2)
    if end is False and callee == "getattr" and at + 1 < len(ins) and ins[at + 1].opname == "LOAD_CONST":
        end = call(at + 2, 3)   # with a constant default
    return (("attr", ins[at].argval), end - at) if end is not False else (None, 0)


def _text(chain: Chain) -> str:
    return chain.name + "".join(f".{s}" if k == "attr" else f"[{s!r}]" for k, s in chain.steps
                                if k not in ("next", "iter"))


def attr_names(codes) -> set:
    """Every attribute name the given code objects load (for objects reached by value): through
    any value, a local variable's included (``c = self.cfg["a"]; c.w``, ``for b in self.blocks: b.w``),
    and, in code that calls ``getattr`` or ``hasattr``, its string constants (``getattr(c, "w")``)."""
    names: set = set()
    for code in codes:
        names |= _loaded_names(code)
    return names


def probed_names(codes) -> set:
    """The names code may ask of an object that lacks them: where it calls ``getattr`` or ``hasattr``,
    its string constants (``getattr(c, "w", 0.0)``); the names it loads where an exception is caught
    (``try: s = c.w / except AttributeError``, ``with suppress(AttributeError)``, a handler of any kind)."""
    names: set = set()
    for code in codes:
        names |= _probed(code)
    return names


@functools.cache
def _loaded_names(code) -> frozenset:
    ins = _normalized(dis.get_instructions(code))
    names = {i.argval for i in ins if i.opname in _ATTR + ("LOAD_SUPER_ATTR",) and isinstance(i.argval, str)}
    return frozenset(names | _probed(code))


@functools.cache
def _probed(code) -> frozenset:
    names = set()
    if {"getattr", "hasattr"} & set(code.co_names):
        names.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())
    caught = [(e.start, e.end) for e in dis.Bytecode(code).exception_entries]
    if caught:
        names.update(i.argval for i in dis.get_instructions(code) if i.opname in _ATTR
                     and isinstance(i.argval, str) and any(a <= i.offset < b for a, b in caught))
    return frozenset(names)


def operator_names(codes) -> set:
    """The special methods the given code objects' operators may call (``a * b``: ``__mul__``, ``__rmul__``;
    ``a[i]``: ``__getitem__``): for a tensor's, which ``torch.Tensor`` may have patched."""
    names: set = set()
    for code in codes:
        names |= _operators(code)
    return names


_BINARY = {"+": "add", "-": "sub", "*": "mul", "/": "truediv", "//": "floordiv", "%": "mod", "**": "pow",
           "@": "matmul", "&": "and", "|": "or", "^": "xor", "<<": "lshift", ">>": "rshift"}
_COMPARE = {"<": ("lt", "gt"), "<=": ("le", "ge"), ">": ("gt", "lt"), ">=": ("ge", "le"), "==": ("eq", "eq"),
            "!=": ("ne", "ne")}
_UNARY = {"UNARY_NEGATIVE": "neg", "UNARY_POSITIVE": "pos", "UNARY_INVERT": "invert", "BINARY_SUBSCR": "getitem",
          "STORE_SUBSCR": "setitem", "DELETE_SUBSCR": "delitem"}


@functools.cache
def _operators(code) -> frozenset:
    names = set()
    for i in _normalized(dis.get_instructions(code)):
        sym = i.argrepr.removeprefix("bool(").removesuffix(")")
        if i.opname == "BINARY_OP" and sym == "[]":        # 3.14's subscript
            names.add("__getitem__")
        elif i.opname == "BINARY_OP" and sym.rstrip("=") in _BINARY:
            op = _BINARY[sym.rstrip("=")]
            names.update((f"__{op}__", f"__r{op}__", f"__i{op}__"))
        elif i.opname == "COMPARE_OP" and sym in _COMPARE:
            names.update(f"__{op}__" for op in _COMPARE[sym])
        elif i.opname in _UNARY:
            names.add(f"__{_UNARY[i.opname]}__")
    return frozenset(names)


_ASKS_NAMES = frozenset({"type", "id"})
_ASKS_ATTRS = frozenset({"is_", "is_not"})      # operator.is_


@functools.cache
def asks_type_or_identity(code) -> bool:
    """Whether the code asks a value what only the value itself answers: its exact type
    (``type(v)``), its identity (``id(v)``), or whether it is some other object (``v is w``,
    ``operator.is_``; ``v is None`` and the like, against a constant that is no int, are not
    such questions). Cached per code object."""
    ins = _normalized(dis.get_instructions(code))
    return any(i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF") and i.argval in _ASKS_NAMES
               or i.opname in _ATTR and i.argval in _ASKS_ATTRS
               or i.opname == "IS_OP" and not (at and ins[at - 1].opname == "LOAD_CONST"
                                               and type(ins[at - 1].argval) is not int)
               for at, i in enumerate(ins))
