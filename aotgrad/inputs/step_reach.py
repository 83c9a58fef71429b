"""What a training step reaches: the modules and optimizers a function can get to (its globals, its
closure, a bound ``self`` and what those hold), and the optimizers :mod:`.step` refuses to trace."""
from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

from ..errors import GraphBreakError, UnsupportedError
from ..guards.cache import code_names

_REFUSED = {"LBFGS": "its step(closure) re-evaluates the loss a data-dependent number of times",
            "SparseAdam": "it updates sparse gradients, which aotgrad does not trace"}


def reached(fn) -> tuple[dict, list]:
    """``({name: module}, [optimizers])`` the function can reach: names its code (and nested code)
    reads from its globals, its closure, a bound ``self`` and that object's attributes, and the
    members of lists, tuples and dicts among those. Empty when ``fn`` is a module."""
    if isinstance(fn, torch.nn.Module) or not callable(fn):
        return {}, []
    fn, found = unwrapped(fn)
    if getattr(fn, "__code__", None) is None:
        return {}, []
    while fn is not None:       # a decorator's wrapper (functools.wraps) and what it wraps
        found.update({name: value for _, name, value in variables(fn)})
        fn = getattr(fn, "__wrapped__", None)
        fn = fn if getattr(fn, "__code__", None) is not None else None
    modules, optimizers = {}, []
    for name, obj in found.items():
        for n, o in _members(name, obj):
            if isinstance(o, torch.nn.Module) and all(o is not m for m in modules.values()):
                modules[str(n).replace(".", "_")] = o
            elif isinstance(o, torch.optim.Optimizer):
                _with_held(o, optimizers)
    return modules, optimizers


def _with_held(opt, optimizers: list) -> None:
    """Add ``opt`` and the optimizers it holds (a wrapper's inner one: Lookahead's) to ``optimizers``."""
    if any(opt is o for o in optimizers):
        return
    optimizers.append(opt)
    for name, value in vars(opt).items():
        for _, o in _members(name, value) if isinstance(value, (list, tuple, torch.optim.Optimizer)) else ():
            if isinstance(o, torch.optim.Optimizer):
                _with_held(o, optimizers)


def unwrapped(fn) -> tuple:
    """``(plain function, {name: object})``: ``fn`` without its ``functools.partial`` and bound-method
    wrappers, and what those hold (the partial's arguments, ``self`` and its attributes)."""
    found: dict = {}
    while isinstance(fn, functools.partial):
        found.update({f"arg{i}": a for i, a in enumerate(fn.args)}, **fn.keywords)
        fn = fn.func
    if inspect.ismethod(fn):
        found["self"] = fn.__self__
        found.update({k: v for k, v in vars(fn.__self__).items() if not k.startswith("__")}
                     if hasattr(fn.__self__, "__dict__") and not isinstance(fn.__self__, torch.nn.Module) else {})
        fn = fn.__func__
    return fn, found


def variables(fn) -> list:
    """``(where, name, value)`` of each global the code of ``fn`` (a plain function) reads and each
    variable it closes over; ``where`` is the globals dict or the closure cell."""
    code = fn.__code__
    out = [(fn.__globals__, n, fn.__globals__[n]) for n in code_names(code) if n in fn.__globals__]
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):
            out.append((cell, name, cell.cell_contents))
    return out


def _members(name, obj):
    """``(name, object)`` of ``obj`` itself, or of each member of a list, tuple or dict, or each
    attribute of a plain namespace (``types.SimpleNamespace``, ``argparse.Namespace``)."""
    if isinstance(obj, dict):
        return obj.items()
    if isinstance(obj, (list, tuple)):
        return ((f"{name}{i}", o) for i, o in enumerate(obj))
    if type(obj).__name__ == "Namespace" or isinstance(obj, types.SimpleNamespace):
        return ((f"{name}_{k}", o) for k, o in vars(obj).items())
    return [(name, obj)]


def calls_backward(fn) -> bool:
    fn, _ = unwrapped(fn)
    code = getattr(fn, "__code__", None)
    return code is not None and "backward" in code_names(code) and "grad" in code_names(code)


_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_global_optimizer_pre_hooks",
          "_global_optimizer_post_hooks")


def hook_dicts(opt) -> list:
    """The step hooks that run around ``opt.step()``: its own, and those registered for every optimizer."""
    from torch.optim import optimizer as optim_mod
    return [getattr(opt, h, None) or {} for h in _HOOKS[:2]] + [getattr(optim_mod, h, None) or {} for h in _HOOKS[2:]]


def refuse_optimizer(opt, fn) -> None:
    name = type(opt).__name__
    if name in _REFUSED:
        raise UnsupportedError(f"{name} inside a captured training step is not supported: {_REFUSED[name]}; "
                               "capture the forward and backward and run the optimizer eagerly")
    hooks = [h for h, d in zip(_HOOKS, hook_dicts(opt)) if d]
    if hooks:
        raise UnsupportedError(f"{name} has step hooks ({', '.join(hooks)}); they are Python the graph would not "
                               "run at each step: remove them or run the optimizer eagerly")
    if any(g.get("fused") for g in opt.param_groups):
        raise GraphBreakError(
            f"{name}(fused=True) inside a captured training step: the step takes the learning rate as an input "
            "(so a scheduler needs no capture), and the fused kernel (one ATen op over every parameter) reads it "
            "as a number while traced; aotgrad.jit and torch.compile(step, backend=\"aotgrad\") run it (Dynamo "
            "splits the graph there), or use foreach=True or the for-loop implementation")
    if any(g.get("differentiable") for g in opt.param_groups):
        raise UnsupportedError(f"{name}(differentiable=True) inside a captured training step is not supported")
