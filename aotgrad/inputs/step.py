"""A whole training step as one graph: forward, ``loss.backward()``, gradient clipping, the
optimizer's update and ``zero_grad``.

A plain function that reaches a ``torch.optim.Optimizer`` (through its globals, its closure, a
bound ``self`` or an attribute of one) is captured as a *step*. What eager keeps in Python objects
becomes graph inputs and outputs:

* the parameters and buffers of every module the function reaches, lifted as for a module;
* each parameter's ``.grad`` (an input where it exists; the graph returns the new one);
* each optimizer's per-parameter state (``exp_avg``, ``step``, momentum buffers) and each group's
  learning rate, which enters as a float64 tensor read with ``.item()`` (an unbacked float in the
  trace), so a scheduler changing it between steps does not recompile.

:class:`Root` is a module holding the user's modules; its ``forward(state, *args, **kwargs)``
installs the traced stand-ins (``.grad``, the optimizer's ``state`` and ``param_groups``), runs the
function with ``.backward()`` as :func:`_accumulate` (``autograd.grad``, then eager's
AccumulateGrad rule in Python: the engine's own cannot write into a functional tensor), and
returns ``(outputs, new state, which outputs required grad)``. :class:`Binding` gathers the state
before each call and installs the new one after, as eager would have left it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
import warnings
from collections import defaultdict

import torch

from .._torch import data_dependent_errors, pytree, torch_functions_off, traceable_subclass
from torch.overrides import TorchFunctionMode
from ..guards import reads
from ..errors import DataDependentError, InputMismatchError, UnsupportedError, caller_line
from .. import tracing
from ..tracing.patches import traced_data_write
from . import flatten
from .step_reach import calls_backward, hook_dicts, refuse_optimizer, unwrapped, variables, reached


def step_root(fn):
    """The :class:`Root` standing for ``fn`` when it is a training step (it reaches an optimizer, or
    modules and calls ``backward()`` itself: a hand-written update, ``p -= lr * p.grad``), else None."""
    modules, optimizers = reached(fn)
    if not optimizers and not (modules and calls_backward(fn)):
        return None
    return Root(fn, modules, optimizers)


def step_reads(fn, found: list) -> list:
    """The reads a trace of ``fn`` made, less those of what a step takes as its state argument (each
    optimizer's ``state`` and ``param_groups``, and what they hold): gathered and matched at every
    call (hyperparameters by value, tensors as inputs), not guarded as Python state."""
    if not isinstance(fn, Root):
        return found
    held = set()
    for opt in fn.binding.optimizers:
        held.update(map(id, (opt.state, *opt.state.values(), opt.param_groups, *opt.param_groups)))
    attrs = {id(vars(opt)) for opt in fn.binding.optimizers}
    flat = {b.untyped_storage().data_ptr() for b in fn.binding._gathered().get("grad_bases", ())}
    kept = []
    for r in found:
        if id(r.where) in held or id(r.where) in attrs and r.key in _HELD:
            continue
        if r.kind == "id" and r.key == "__dict__":      # which dict an object holds; its entries are read apart
            kept.append(r)
            continue
        v = _held_at(r.where, r.key)
        over = flat and [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)
                         and t.untyped_storage().data_ptr() in flat]
        if over:
            if not isinstance(v, torch.Tensor) or (id(r.where), r.key) not in fn.binding.swapped:
                raise UnsupportedError(
                    f"the training step reads `{r.source}`, a tensor over the flat buffer its .grad tensors are "
                    "views of, through a path aotgrad does not hand the traced buffer to (a global, a closed-over "
                    "variable or an attribute of self holding the buffer itself): the read would see the buffer "
                    "as it was before the step; read it through such a variable")
            continue        # the step's own input
        kept.append(r)
    return kept


_HELD = ("state", "param_groups")


def _held_at(where, key):
    try:
        if isinstance(where, types.CellType):
            return where.cell_contents
        return where[key] if isinstance(where, dict) else getattr(where, key)
    except Exception:       # a cell, a missing entry: not a buffer
        return None


class Root(torch.nn.Module):
    """The modules a step reaches, as one module whose forward takes the step's state first."""
    whole_step = True       # capture: nothing the graph returns takes part in a later backward

    def __init__(self, fn, modules: dict, optimizers: list):
        super().__init__()
        self.__dict__["step_fn"] = fn       # neither a submodule nor state: plain attributes
        self._hold(modules)
        self.__dict__["binding"] = Binding(self, optimizers, fn)
        self.__name__ = getattr(fn, "__name__", "step")

    def _hold(self, modules: dict) -> None:
        self._modules.clear()
        for name, m in modules.items():     # a variable named like a Module attribute ("forward") keeps apart
            self.add_module(name if name.isidentifier() and not hasattr(Root, name) else f"module_{name}", m)

    def around(self, call, args, kwargs):
        """``Jit.around``: what the step reaches is bound again where it changed (another optimizer,
        module, ``step`` function or hook), so that ``jit`` captures it again; then the binding's call."""
        if self.binding.changed() is not None:
            was = (dict(self._modules), self.binding)
            try:
                modules, optimizers = reached(self.step_fn)
                self._hold(modules)
                binding = Binding(self, optimizers, self.step_fn)
            except BaseException:
                self._hold(was[0])
                raise
            binding.rebound = was[1].rebound + 1
            self.__dict__["binding"] = binding
        return self.binding.around(call, args, kwargs)

    def forward(self, state, *args, **kwargs):
        b = self.binding
        if any(isinstance(a, torch.optim.Optimizer) and all(a is not o for o in b.optimizers)
               for a in pytree.tree_leaves((args, kwargs))):
            raise UnsupportedError("an optimizer passed as an argument of a captured training step: aotgrad finds "
                                   "a step's optimizers through its globals, closure or self's attributes, before "
                                   "the call; reach it through one of those", user_line=caller_line())
        leaves = b.stand_ins()
        arguments = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        with tracing.scope(backward=functools.partial(_accumulate, leaves, arguments, b.params)), warnings.catch_warnings(), \
                b.optimizers_holding(leaves, state["optimizer"]), _data_writes(self):
            # The trace's stand-ins for parameters are not leaves to autograd: their .grad is ours.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            bases = state.get("grad_bases", ())
            for t, name in zip(leaves, b.names):
                t.grad = _placed(state["grad"][name], bases)
            with b.bases_named(bases), _Held(b.params, leaves):
                out = self.step_fn(*args, **kwargs)
            out = b.rates_named(out)
            new = ({name: t.grad for name, t in zip(b.names, leaves)}, b.read_states(leaves))
            for t in leaves:
                t.grad = None
        flat, spec = pytree.tree_flatten(out)
        needs = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
        out = pytree.tree_unflatten([t.detach() if n else t for t, n in zip(flat, needs)], spec)
        return out, new, needs


def _tree(module) -> tuple:
    """Every module under ``module`` (itself included), in order, by walking the children dicts."""
    out, todo = [], [module]
    while todo:
        m = todo.pop()
        out.append(m)
        todo.extend(c for c in reversed(m._modules.values()) if c is not None)
    return tuple(out)


def _grad_hooks(p) -> tuple:
    """The hooks eager's AccumulateGrad runs for ``p``: its tensor hooks, then its post-accumulate ones
    (read from ``p`` itself, not the stand-in :class:`_Held` gives for it)."""
    with torch_functions_off():
        return (*(p._backward_hooks or {}).values(), None,
                *(getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())


class _Held(TorchFunctionMode):
    """A parameter the step reaches other than through its module or its optimizer's groups (a list
    made once, ``params = list(model.parameters())``; ``self.params``; an optimizer's own list) is the
    tensor its module holds, as in eager: while the step is traced, each torch function and tensor
    method given it (``p.grad`` and ``p.grad = None``, ``p.add_``, ``clip_grad_norm_``'s foreach ops, a
    penalty ``p.pow(2).sum()``) is given its stand-in, as ``m.weight`` is. (Its ``.grad`` read the
    caller's gradient of before the call, and an update of it wrote nothing the graph kept.) Keyed by
    identity, which no torch function sees: an optimizer's state keyed by it is refused
    (:meth:`Binding.optimizers_holding`)."""

    def __init__(self, params, stand_ins):
        super().__init__()
        self.of = {id(p): s for p, s in zip(params, stand_ins) if p is not s}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _holds(self.of, args) or _holds(self.of, kwargs.values()):
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self.of.get(id(t), t), (args, kwargs))
        return func(*args, **kwargs)


def _holds(of: dict, items) -> bool:
    for a in items:
        if id(a) in of or type(a) in (list, tuple) and _holds(of, a) or type(a) is dict and _holds(of, a.values()):
            return True
    return False


def _temporary() -> int:
    """What ``sys.getrefcount`` says of a value nothing else holds, inside the function a property's
    setter hands it to (``tracing.patches.TENSOR_DATA``'s path to ``_data_writes``), measured now: a
    profiler or tracer running (the read recording, another thread's watch) may hold more."""
    seen = []

    def inner(own, t, v):
        seen.append(sys.getrefcount(v))

    def outer(t, v):
        return inner(None, t, v)
    holder = type("Holder", (), {"x": property(None, outer)})
    holder().x = object()
    return seen[0]




@contextlib.contextmanager
def _data_writes(root):
    """``t.data = v`` on a parameter or buffer while the step is traced is eager's in-place swap of its
    value: recorded as ``t.copy_(v)`` (the same values in the tensor the graph writes back), where ``v``
    is a new tensor of ``t``'s shape and dtype that nothing else holds (a later write to ``v`` would
    change ``t`` in eager, not in the copy); refused otherwise. Other tensors' ``.data``, and other
    threads', is torch's (``tracing.patches.TENSOR_DATA``)."""
    held = {id(t) for t in (*root.parameters(), *root.buffers())}

    def set_data(own, t, v):
        if id(t) not in held:
            return traced_data_write(own, t, v)
        if not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype or v._is_view() \
                or id(v) in held or sys.getrefcount(v) > _temporary():
            raise UnsupportedError(
                "`.data = ` on a parameter or buffer inside a captured training step, with a tensor of another "
                "shape or dtype, or one still held elsewhere: the graph cannot rebind the module's tensor; "
                "write its values in place (`with torch.no_grad(): p.copy_(new)`)", user_line=caller_line())
        with torch.no_grad():
            t.copy_(v)
    with tracing.scope(data=set_data):
        yield


def _accumulate(leaves, arguments, params, tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                grad_variables=None, inputs=None):
    """``torch.autograd.backward`` inside a traced step: the gradients by ``autograd.grad``, then
    accumulated as eager's AccumulateGrad does (a new gradient stored with the parameter's strides,
    an existing one added to in place), with the hooks the user's parameter (``params``, the
    stand-in's real tensor) holds: its tensor hooks on the gradient before, its post-accumulate-grad
    hooks after."""
    if create_graph:
        raise UnsupportedError("backward(create_graph=True) inside a captured training step: the step's "
                               "gradients would themselves need gradients; use torch.autograd.grad for "
                               "the inner derivative", user_line=caller_line())
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_variables is not None:      # torch's deprecated name for grad_tensors
        warnings.warn("`grad_variables` is deprecated. Use `grad_tensors` instead.", FutureWarning, stacklevel=3)
        if grad_tensors is not None:
            raise RuntimeError("`grad_tensors` and `grad_variables` (deprecated) arguments both passed to "
                               "`backward()`. Please only use `grad_tensors`.")
        grad_tensors = grad_variables
    if isinstance(grad_tensors, torch.Tensor):
        grad_tensors = (grad_tensors,)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    targets = [t for t in (list(inputs) if inputs is not None else leaves + arguments) if t.requires_grad]
    with torch.autograd.set_multithreading_enabled(False):
        got = torch.autograd.grad(tensors, targets, grad_tensors, retain_graph=retain_graph, allow_unused=True)
    with torch.no_grad():
        for t, g in zip(targets, got):
            if g is None:
                continue
            if not any(t is leaf for leaf in leaves):
                raise UnsupportedError(
                    f"backward() inside a captured training step reaches a tensor of shape {tuple(t.shape)} that "
                    "is not a parameter of a module the step uses (an input with requires_grad=True?); its .grad "
                    "would not be written back: detach it, or make it a parameter", user_line=caller_line())
            real = next(p for leaf, p in zip(leaves, params) if leaf is t)
            hooks = _grad_hooks(real)
            for hook in hooks[:hooks.index(None)]:
                changed = hook(g)
                g = g if changed is None else changed
            if t.grad is None:
                t.grad = g if g.stride() == t.stride() else torch.empty_like(t).copy_(g)
            else:
                t.grad += g
            for hook in hooks[hooks.index(None) + 1:]:
                if hook(t) is not None:
                    raise RuntimeError("Tensor post accumulate grad hooks should return None.")


class Binding:
    """Where a step's state lives in Python: the parameters (lifted order), their homes, the optimizers."""

    def __init__(self, root: Root, optimizers: list, fn):
        self.optimizers = tuple(optimizers)
        slots = [(n, p, slot) for n, p, slot in flatten._slots(root) if slot.is_param]
        self.names = tuple(n for n, _, _ in slots)
        self.params = tuple(p for _, p, _ in slots)
        self.homes = tuple((slot.module, slot.attr) for _, _, slot in slots)
        self.position = {n: i for i, n in enumerate(self.names)}
        index = {id(p): i for i, p in enumerate(self.params)}
        for opt in self.optimizers:
            refuse_optimizer(opt, fn)
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in index:
                        raise UnsupportedError(
                            f"{type(opt).__name__} updates a tensor of shape {tuple(p.shape)} that is not a parameter "
                            f"of a module {getattr(fn, '__name__', 'the step')} reaches (modules found: "
                            f"{', '.join(n for n, _ in root.named_children()) or 'none'}); make the module a global "
                            "or closed-over variable of the step function")
        self.keys = tuple(f"{type(opt).__name__}{k}" for k, opt in enumerate(self.optimizers))
        self.opt_index = tuple(tuple(tuple(index[id(p)] for p in g["params"]) for g in opt.param_groups)
                               for opt in self.optimizers)
        self.fn, self.root, self.rebound, self.swapped = fn, root, 0, set()
        self.bound_reach = self.reach()

    def stand_ins(self) -> list:
        """What the modules hold now for each parameter (the trace's stand-ins while tracing)."""
        return [sub._parameters[attr] for sub, attr in self.homes]

    def gather(self) -> dict:
        """The state a call takes: each parameter's ``.grad``, and per optimizer its groups' learning
        rates (and tensor entries) and its per-parameter state, keyed by parameter name."""
        changed = self.changed()
        if changed is not None:
            raise InputMismatchError(
                f"{changed} since {self.made}: its graphs train what the step reached then; "
                f"{self.remedy}", user_line=caller_line())
        state = self._gathered()
        if self.rebound:        # another structure: a graph of the objects bound before does not fit
            state["rebound"] = self.rebound
        return state

    def reach(self) -> list:
        """``(what, objects)`` a step's graphs were made for and each call checks: the modules and
        optimizers its function reaches (its variables, ``self``'s attributes), the module tree, each
        optimizer's ``step`` (its class's and one set on the instance), its hooks and parameter groups,
        and the parameters the modules hold."""
        modules, optimizers = reached(self.fn)
        out = [("the modules and optimizers the step reaches", (*modules.values(), *optimizers)),
               ("the module tree", _tree(self.root))]
        for opt in self.optimizers:
            name = type(opt).__name__
            out.append((f"{name}'s step function", (type(opt).step, vars(opt).get("step"))))
            out.append((f"{name}'s hooks", tuple(h for d in hook_dicts(opt) for h in d.values())))
            out.append((f"{name}'s parameter groups", (*(p for g in opt.param_groups for p in g["params"]),
                                                       len(opt.param_groups))))
        out.append(("a parameter of the modules", tuple(sub._parameters.get(attr) for sub, attr in self.homes)))
        out.append(("a parameter's gradient hooks", tuple(h for p in self.params if p._backward_hooks
                                                          or getattr(p, "_post_accumulate_grad_hooks", None)
                                                          for h in (p, *_grad_hooks(p)))))
        return [(what, objects, tuple(("n", o) if type(o) is int else id(o) for o in objects)) for what, objects in out]

    def hooked(self) -> list:
        """The parameters whose gradient hooks the step runs (code, which an export cannot carry)."""
        return [n for n, p in zip(self.names, self.params) if len(_grad_hooks(p)) > 1]

    def changed(self) -> str | None:
        """What differs from :meth:`reach` when the step was bound, in words; None where nothing does."""
        for (what, _, was), (_, _, now) in zip(self.bound_reach, self.reach()):
            if was != now:      # ids: the bound objects are alive (held here), so none is another's
                return f"{what} changed"
        return None

    def _gathered(self) -> dict:
        bases = []      # flat buffers .grad tensors are parts of (gradient-as-bucket-view)
        for p in self.params:
            base = p.grad._base if p.grad is not None else None
            if base is not None and base.numel() > p.grad.numel() and all(base is not b for b in bases):
                bases.append(base)
        state = {"grad": {n: _place(p.grad, bases) for n, p in zip(self.names, self.params)},
                 "optimizer": {key: {"groups": tuple(_group_inputs(g) for g in opt.param_groups),
                                     "state": self._states(opt, index, self.params)}
                               for key, opt, index in zip(self.keys, self.optimizers, self.opt_index)}}
        if bases:
            state["grad_bases"] = tuple(bases)
        return state

    @contextlib.contextmanager
    def bases_named(self, stand_ins):
        """The step's variables (globals, closed-over, ``self``'s attributes) that hold a buffer the
        gradients are views of name its stand-in while the step is traced, so a read of it after
        ``backward()`` sees the gradients as eager's does."""
        if not stand_ins:
            yield
            return
        real = self._gathered().get("grad_bases", ())
        fn, found = unwrapped(self.fn)
        places = [(w, n, v) for w, n, v in variables(fn)] if getattr(fn, "__code__", None) else []
        obj = found.get("self")
        places += [(vars(obj), n, v) for n, v in vars(obj).items()] if hasattr(obj, "__dict__") else []
        swaps = [(w, n, stand_ins[k]) for w, n, v in places for k, b in enumerate(real) if v is b]
        rec = reads.watching()
        for w, n, _ in swaps:       # the write watch sees them as the user holds them
            if rec is not None and isinstance(w, dict):
                rec.writes.module_dict(w)
        undo = [(w, n, _get(w, n)) for w, n, _ in swaps]
        self.swapped = {(id(w), n if isinstance(w, dict) else None) for w, n, _ in swaps}
        try:
            for w, n, v in swaps:
                _put(w, n, v)
            yield
        finally:
            for w, n, v in undo:
                _put(w, n, v)

    def _states(self, opt, index, params) -> dict:
        return {self.names[i]: dict(opt.state[params[i]]) if params[i] in opt.state else None
                for group in index for i in group}

    @contextlib.contextmanager
    def optimizers_holding(self, live, states: dict):
        """Each optimizer's groups list the stand-ins and its ``state`` is keyed by them, for the trace
        (a group two optimizers share, a wrapper's and the one it wraps, is installed once)."""
        saved, ours, groups = [], [], {}
        _as_found(self.optimizers)
        try:
            for key, opt, index in zip(self.keys, self.optimizers, self.opt_index):
                mine = [g for g in opt.param_groups if id(g) not in groups]
                saved.append((opt, opt.state, [(g, dict(g)) for g in mine], vars(opt).get("step")))
                opt.step = _eager_step(opt.step, type(opt).__name__)
                for group, idx, inputs in zip(opt.param_groups, index, states[key]["groups"]):
                    if id(group) not in groups:
                        groups[id(group)] = (type(opt).__name__, len(groups), dict(group),
                                             _install_group(group, [live[i] for i in idx], inputs))
                held = defaultdict(dict)
                for name, st in states[key]["state"].items():
                    if st is not None:
                        held[live[self.position[name]]] = dict(st)
                opt.state = held
                ours += [held, *(g["params"] for g in opt.param_groups)]
            yield
            _forget(ours + [st for held in ours if isinstance(held, defaultdict) for st in held.values()])
            traced = {id(t) for t in live}
            for opt in self.optimizers:
                if any(id(k) not in traced for k in opt.state):
                    raise UnsupportedError(
                        f"{type(opt).__name__}'s state gets an entry keyed by something other than a parameter of "
                        "its param_groups (a parameter reached through a list of its own, or a key of another kind): "
                        "the step takes and returns the state of each of its parameters only; key it by the "
                        "parameters param_groups holds", user_line=caller_line())
            for gid, (name, k, before, installed) in groups.items():
                _refuse_group_writes(name, k, next(g for o in self.optimizers for g in o.param_groups if id(g) == gid),
                                     before, installed)
        finally:
            for opt, state, mine, step in reversed(saved):
                if step is None:
                    vars(opt).pop("step", None)
                else:
                    opt.step = step
                opt.state = state
                for group, was in mine:
                    group.clear()
                    group.update(was)

    def read_states(self, live) -> dict:
        """Each optimizer's per-parameter state after the traced step (None where it has none)."""
        return {key: self._states(opt, index, live)
                for key, opt, index in zip(self.keys, self.optimizers, self.opt_index)}

    def install(self, result):
        """Leave the Python objects as eager would after the step; return the function's outputs."""
        out, (grads, opts), needs = result
        for p, n in zip(self.params, self.names):
            if p.grad is not grads[n] and not _same_place(p.grad, grads[n]):
                p.grad = grads[n]       # (a .grad that is a view of a flat buffer stays the view it was)
        for key, opt in zip(self.keys, self.optimizers):
            for name, st in opts[key].items():
                if st is None:
                    continue
                held = opt.state[self.params[self.position[name]]]
                for k, value in st.items():
                    if held.get(k) is not value:
                        held[k] = value
        flat, spec = pytree.tree_flatten(out)
        return pytree.tree_unflatten([self._live(t) if n else self.optimizers[t.opt].param_groups[t.group]["lr"]
                                      if isinstance(t, _Rate) else t for t, n in zip(flat, needs)], spec)

    def rates_named(self, out):
        """A learning rate the step returns (``group['lr']``, an input read as a number while traced)
        stands for the group's rate, read again after each call, as eager returns it."""
        rates = {id(g["lr"]): _Rate(i, k) for i, opt in enumerate(self.optimizers)
                 for k, g in enumerate(opt.param_groups) if isinstance(g.get("lr"), torch.SymFloat)}
        return pytree.tree_map(lambda v: rates.get(id(v), v) if isinstance(v, torch.SymFloat) else v, out)

    def _live(self, t):
        """An output that required grad in eager: a parameter (or a view of one) is the live parameter
        (a view of it), as eager returns it; anything else's graph was spent by the step's backward."""
        for p in () if traceable_subclass(t) else self.params:     # a subclass holds no storage of its own
            if not traceable_subclass(p) and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() \
                    and t.dtype == p.dtype:
                return p if _same_place(p, t) else p.as_strided(t.size(), t.stride(), t.storage_offset())
        return _Spent.apply(t, _ANCHOR)

    # What a call whose state no longer fits is told (a loaded step's binding says it of its export).
    made = "the capture"
    remedy = "capture again, or use aotgrad.jit, which captures again"
    first_step = "capture after one eager step, or use aotgrad.jit, which captures again"

    def around(self, call, args, kwargs):
        """``Jit.around``: the state gathered before the call and installed after it."""
        try:
            result = call(self.gather(), *args, **kwargs)
        except InputMismatchError as e:
            why = str(e).split(";")[0]
            if "['groups']" in why:
                raise InputMismatchError(
                    f"an optimizer hyperparameter changed since {self.made} ({why}): the graph bakes every "
                    f"hyperparameter but the learning rate (an input); {self.remedy}", user_line=caller_line()
                ) from None
            if not why.startswith("args[0]"):
                raise
            raise InputMismatchError(
                f"the training step's state is not what it was at {self.made} ({why}): an "
                "optimizer creates its state on its first step, and zero_grad(set_to_none=True) makes .grad None; "
                f"{self.first_step}", user_line=caller_line()) from None
        return self.install(result)


def _as_found(optimizers) -> None:
    """Show the capture's write watch each optimizer as the user holds it (its attributes, groups and
    state), before the trace's stand-ins are installed: what the watch puts back after the trace, and
    what it names as written, is then the user's own state, never the stand-ins."""
    rec = reads.watching()
    if rec is None:
        return
    w = rec.writes
    for opt in optimizers:
        w.attrs(opt)
        for c in (opt.param_groups, *opt.param_groups, opt.state, *opt.state.values()):
            if isinstance(c, (list, dict)) and not w.known(c):
                w.value(c, type(opt).__name__)


def _forget(containers) -> None:
    """The trace's own containers (the stand-in state and parameter lists) are not the user's state:
    the write watch need not put them back. What the step wrote into them is the step's new state."""
    rec = reads.watching()
    if rec is not None:
        for c in containers:
            rec.writes.snaps.pop(id(c), None)


def _place(g, bases):
    """A ``.grad`` that is a view of one of ``bases``: where it lies in it (the trace makes it a view
    of the base's stand-in); any other ``.grad`` as it is."""
    for k, b in enumerate(bases):
        if g is not None and g._base is b:
            return ("view", k, tuple(g.size()), tuple(g.stride()), g.storage_offset() - b.storage_offset())
    return g


def _placed(g, bases):
    if isinstance(g, tuple):
        _, k, size, stride, offset = g
        return bases[k].as_strided(size, stride, bases[k].storage_offset() + offset)
    return g


def _get(where, name):
    return where[name] if isinstance(where, dict) else where.cell_contents


def _put(where, name, value):
    if isinstance(where, dict):
        where[name] = value
    else:
        where.cell_contents = value


def _same_place(a, b) -> bool:
    """Two tensors over the same memory, the same way (one a fresh view object of the other's place)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.size() == b.size() \
        and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def _group_inputs(group: dict) -> dict:
    """A group's entries as the graph takes them: the learning rate as a float64 tensor (an input, so a
    scheduler changes it without a capture), tensors as inputs, every other hyperparameter (betas,
    weight_decay, momentum, amsgrad...) as a constant of the call signature: the trace bakes it, so a
    change between calls misses the entry (``jit`` captures again; a staged step refuses)."""
    out = {k: v for k, v in group.items() if k != "params"}
    if type(out.get("lr")).__module__ == "numpy" and not isinstance(out["lr"], float):
        raise UnsupportedError(
            f"an optimizer's learning rate is a numpy scalar ({type(out['lr']).__name__}): the step takes it as "
            "an input read as a Python number, which would change eager's numpy arithmetic; set the group's "
            "lr to float(lr) (or a tensor)", user_line=caller_line())
    if isinstance(out.get("lr"), float):
        out["lr"] = torch.tensor(out["lr"], dtype=torch.float64)
    return out


@contextlib.contextmanager
def eager_paths():
    """Inside a trace, ``torch.compiler.is_compiling()`` answers False again (the tracing session's
    patch reads ``Trace.eager_path``), so ``torch.optim`` takes the path it takes in eager: it reads its step
    count with ``.item()`` and does its scalar arithmetic in Python floats (double precision), which
    the trace records as symbolic float operations, exact as eager's. Its compile path would round
    them in float32 tensors instead."""
    with tracing.scope(eager_path=True):
        yield


def _eager_step(step, name: str):
    @functools.wraps(step)
    def run(*args, **kwargs):
        with eager_paths():
            try:
                return step(*args, **kwargs)
            except data_dependent_errors() as e:     # RAdam (rho_t > 5), ASGD: a Python branch on the state
                raise DataDependentError(
                    f"{name}.step() branches in Python on a value its state holds (its eager code path reads it "
                    "with .item()), so one graph cannot serve every step; run this optimizer eagerly after a "
                    "captured forward and backward", user_line=caller_line()) from e
    return run


@dataclasses.dataclass(frozen=True)
class _Rate:
    """The learning rate of ``optimizers[opt].param_groups[group]``, as a step's output."""
    opt: int
    group: int


def _install_group(group: dict, params: list, inputs: dict) -> dict:
    """The trace's group: its stand-in parameters, its learning rate read from its input (a Python
    number where the user's was), its other entries as the call has them; what was installed."""
    group["params"] = params
    was_float = isinstance(group.get("lr"), float)
    for name, value in inputs.items():
        group[name] = value.item() if name == "lr" and was_float else value
    return dict(group)


def _refuse_group_writes(name: str, k: int, group: dict, was: dict, held: dict) -> None:
    """A step that changes a group's entries (an LR scheduler's ``step()`` inside it) would change them at
    every trace and never when the graph runs: each must still be what the trace installed."""
    for key in set(group) | set(was):
        if key != "params" and group.get(key, was) is not held.get(key, was):
            what = "learning rate" if key == "lr" else f"param_groups[{k}]['{key}']"
            raise UnsupportedError(f"the step sets {name}'s {what} inside the captured function "
                                   "(an LR scheduler's step()?); the graph cannot repeat a Python write: call "
                                   "the scheduler outside the step", user_line=caller_line())


class _Spent(torch.autograd.Function):
    """An output that required grad in eager: its graph was used by the step's own backward (freed),
    so calling backward on it again fails as eager's does."""

    @staticmethod
    def forward(ctx, t, anchor):
        return t

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("Trying to backward through the graph a second time: the captured training step "
                           "already ran backward() through it (eager frees that graph the same way)")


_ANCHOR = torch.empty(0, requires_grad=True)     # makes _Spent's output require grad, as eager's did
