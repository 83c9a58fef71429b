"""The one helper every behaviour test uses: run a program eagerly and
compiled, on identical fresh inputs, and compare everything a user can see.

Compared: outputs (pytree structure, values, dtype, shape, strides,
requires_grad, is_leaf, whether each output is a view and of which input, which
input storages it shares), the in-place effects on every input tensor and on
module parameters and buffers (values, metadata, requires_grad, is_leaf), the
global RNG state after the call and after the backward, and the gradients of
every leaf (inputs and parameters) after a backward pass through a fixed random
weighting of the outputs.

``assert_refused`` / ``Snapshot`` check the other allowed outcome: a typed
``aotgrad.errors`` refusal that leaves the user's module, inputs and RNG as they were.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

import aotgrad
from aotgrad.runtime import modes


@dataclass
class Run:
    fn: Any
    args: tuple
    kwargs: dict
    out: Any
    compiled: Any = None


def default_compile(fn, args, kwargs, **opts):
    capture_opts = {k: opts.pop(k) for k in ("dynamic",) if k in opts}
    captured = aotgrad.capture(fn, *args, **capture_opts, **kwargs)
    aotgrad.verify(captured)
    return captured.compile(**opts)


def as_is(fn, args, kwargs, **opts):
    """A ``compile`` that leaves the program eager (when what is compiled is its backward)."""
    return fn


def _fresh(fn, args, kwargs, make):
    if make is not None:
        torch.manual_seed(1234)     # both runs get the same random inputs, whatever ran before
        made = make()
        fn2, a, k = made if len(made) == 3 else (fn, *made)
        return fn2, tuple(a), dict(k)
    return copy.deepcopy((fn, tuple(args), dict(kwargs or {})))


def _tensors(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _state(fn, args, kwargs):
    """Every tensor the program can change, with a stable name."""
    named = {}
    if isinstance(fn, torch.nn.Module):
        for n, t in fn.named_parameters():
            named[f"param {n}"] = t
        for n, t in fn.named_buffers():
            named[f"buffer {n}"] = t
    for i, t in enumerate(_tensors((args, kwargs))):
        named[f"input tensor {i}"] = t
    return named


def _storage_ptr(t):
    """Its storage's address; None for what has no storage to read (nested tensors and wrapper
    subclasses hold a placeholder that raises when read)."""
    plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested
    return t.untyped_storage().data_ptr() if plain else None


def _alias_signature(out, inputs):
    sig = []
    ptrs = [_storage_ptr(t) for t in inputs]
    for o in _tensors(out):
        if o.layout != torch.strided:
            sig.append(((), ()))
            continue
        same = [i for i, t in enumerate(inputs) if o is t]
        shares = [i for i, p in enumerate(ptrs) if p == _storage_ptr(o) and p]
        sig.append((tuple(same), tuple(shares)))
    return sig


def _strides(t):
    """Strides where they matter: a dimension of size 1 is never stepped along."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n != 1)


def _view_signature(out, inputs):
    """Per output: is it a view, is its ``_base`` an input (or an input's base), is it a leaf."""
    sig = []
    for o in _tensors(out):
        base = o._base
        of_input = tuple(i for i, t in enumerate(inputs) if base is not None and (base is t or base is t._base))
        sig.append((o._is_view(), of_input, o.is_leaf))
    return sig


def rng_state() -> dict:
    """The global RNG streams a program can draw from, by device: the CPU's, and each CUDA device's
    once CUDA is initialised (reading them never initialises CUDA, so a CPU-only path stays one)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.update({f"cuda:{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def assert_same_rng(a, b, what):
    """Every device's stream that both states hold is equal. A CUDA device only one side holds was
    initialised in between (by compiling, say): nothing drew from it before, so there is no eager
    stream to compare with; a program that runs on CUDA initialises it on both sides."""
    differ = [d for d in a.keys() & b.keys() if not torch.equal(a[d], b[d])]
    assert not differ, \
        f"global RNG state of {sorted(differ)} differs {what}: the compiled program drew a different amount of randomness"


def _compare_outputs(out_e, out_c, ins_e, ins_c, rtol, atol):
    _, spec_e = pytree.tree_flatten(out_e)
    _, spec_c = pytree.tree_flatten(out_c)
    assert spec_e == spec_c, f"output structure differs:\n eager {spec_e}\n compiled {spec_c}"
    for i, (a, b) in enumerate(zip(pytree.tree_leaves(out_e), pytree.tree_leaves(out_c))):
        assert_close(a, b, f"output {i}", rtol, atol)
        if isinstance(a, torch.Tensor):
            assert a.requires_grad == b.requires_grad, f"output {i}: requires_grad {a.requires_grad} vs {b.requires_grad}"
            assert a.is_leaf == b.is_leaf, f"output {i}: is_leaf {a.is_leaf} vs {b.is_leaf}"
            if a.layout == torch.strided and not a.is_nested and a.numel() > 1:
                assert _strides(a) == _strides(b), f"output {i}: strides {a.stride()} vs {b.stride()}"
    assert _alias_signature(out_e, ins_e) == _alias_signature(out_c, ins_c), \
        f"outputs alias inputs differently: {_alias_signature(out_e, ins_e)} vs {_alias_signature(out_c, ins_c)}"
    assert _view_signature(out_e, ins_e) == _view_signature(out_c, ins_c), \
        f"outputs differ in (is view, base is input, is_leaf): {_view_signature(out_e, ins_e)} vs " \
        f"{_view_signature(out_c, ins_c)}"


def _compare_state(state_e, state_c, rtol, atol):
    for name, t in state_e.items():
        c = state_c[name]
        assert t.is_nested or _strides(t) == _strides(c) or t.numel() <= 1, \
            f"{name} strides after call: {t.stride()} vs {c.stride()}"
        assert_close(t, c, f"{name} after call", rtol, atol)
        assert (t.requires_grad, t.is_leaf) == (c.requires_grad, c.is_leaf), \
            f"{name} after call: (requires_grad, is_leaf) {(t.requires_grad, t.is_leaf)} vs " \
            f"{(c.requires_grad, c.is_leaf)}"


def unreadable(t) -> bool:
    """A dense tensor whose storage no longer covers its elements (freed with
    ``untyped_storage().resize_(0)``, as FSDP frees parameters): reading its values would read
    memory it does not own, which can kill the process; only its metadata can be compared."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_nested \
            or t.numel() == 0 or t.device.type == "meta":
        return False
    extent = t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() < extent * t.element_size()


def _placement(t) -> tuple:
    """Strides and storage offset (none for a nested tensor, which has neither)."""
    return (None, None) if t.is_nested else (t.stride(), t.storage_offset())


def _nbytes(t) -> int:
    return t.untyped_storage().nbytes()


def assert_close(a, b, what, rtol, atol):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: eager gave a tensor, compiled {type(b)}"
        if _wrapper_subclass(a) or _wrapper_subclass(b):     # compared by class, context and inner tensors
            _assert_same_subclass(a, b, what, rtol, atol)
            return
        if a.is_nested or b.is_nested:     # compared component by component (jagged sizes are symbolic)
            assert (a.is_nested, a.layout) == (b.is_nested, b.layout), f"{what}: layout {a.layout} vs {b.layout}"
            parts = a.unbind(), b.unbind()
            assert len(parts[0]) == len(parts[1]), f"{what}: {len(parts[0])} vs {len(parts[1])} components"
            for i, (x, y) in enumerate(zip(*parts)):
                assert_close(x, y, f"{what}[{i}]", rtol, atol)
            return
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
        assert a.device == b.device, f"{what}: device {a.device} vs {b.device}"
        if unreadable(a) or unreadable(b):
            sizes = [_nbytes(t) if t.layout == torch.strided else None for t in (a, b)]
            assert unreadable(a) and unreadable(b) and sizes[0] == sizes[1], \
                f"{what}: storage of {sizes[0]} vs {sizes[1]} bytes for {a.numel()} elements"
            return
        if a.dtype.itemsize == 1 and a.dtype.is_floating_point:   # float8: compare in float32
            a, b = a.float(), b.float()
        if not (a.dtype.is_floating_point or a.dtype.is_complex):  # integers, bools, masks: exact at any tolerance
            rtol = atol = 0
        torch.testing.assert_close(b.detach(), a.detach(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):    # a pytree leaf holding tensors
        assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
        for f in dataclasses.fields(a):
            assert_close(getattr(a, f.name), getattr(b, f.name), f"{what}.{f.name}", rtol, atol)
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} vs {b!r}"


def _wrapper_subclass(t) -> bool:
    """A traceable wrapper subclass (TwoTensor, float8): its values live in its inner tensors."""
    return not t.is_nested and type(t) not in (torch.Tensor, torch.nn.Parameter) and \
        hasattr(t, "__tensor_flatten__") and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _assert_same_subclass(a, b, what, rtol, atol):
    assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
    assert (a.shape, a.dtype, a.device, _strides(a)) == (b.shape, b.dtype, b.device, _strides(b)), \
        f"{what}: (shape, dtype, device, stride) {(a.shape, a.dtype, a.device, a.stride())} vs " \
        f"{(b.shape, b.dtype, b.device, b.stride())}"
    (keys_a, ctx_a), (keys_b, ctx_b) = a.__tensor_flatten__(), b.__tensor_flatten__()
    assert list(keys_a) == list(keys_b), f"{what}: inner tensors {keys_a} vs {keys_b}"
    assert repr(ctx_a) == repr(ctx_b), f"{what}: flatten context {ctx_a!r} vs {ctx_b!r}"
    for k in keys_a:
        x, y = getattr(a, k), getattr(b, k)
        assert_close(x, y, f"{what}.{k}", rtol, atol)
        if not _wrapper_subclass(x) and x.numel() > 1:
            assert _strides(x) == _strides(y), f"{what}.{k}: strides {x.stride()} vs {y.stride()}"


def _weights(out, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(_dense(o).shape, generator=g, dtype=o.dtype).to(o.device)
            if o.requires_grad else None for o in _tensors(out)]


def _dense(o):
    """What an output's weight multiplies: a jagged nested tensor's values (its ragged size is a
    nested int tied to its own offsets, which eager's and the compiled output do not share)."""
    return o.values() if o.is_nested else o


def _backward(out, weights, penalty_of=None):
    """Backward of a fixed weighting of the outputs. ``penalty_of``: leaves whose gradients,
    taken with ``create_graph=True``, are squared into the loss (a double backward, like a
    gradient penalty)."""
    # Complex outputs contribute their real part: backward needs a real scalar.
    terms = [torch.real((_dense(o) * w).sum()) for o, w in zip(_tensors(out), weights) if w is not None]
    if terms:
        loss = torch.stack(terms).sum()
        leaves = [t for t in penalty_of or () if t.requires_grad]
        if leaves:
            grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
            loss = loss + sum(g.pow(2).sum() for g in grads if g is not None)
        loss.backward()
    return bool(terms)


def check(fn, args=(), kwargs=None, *, make: Callable | None = None,
          compile: Callable = default_compile, backward: bool = True,
          backward_context: Callable = contextlib.nullcontext,
          call_context: Callable = contextlib.nullcontext, double_backward: bool = False,
          rtol: float = 1.3e-6, atol: float = 1e-5, seed: int = 0, calls: int = 1,
          **opts) -> Run:
    """Compare ``fn(*args, **kwargs)`` eagerly and compiled; return the compiled run.

    ``make`` returns fresh ``(args, kwargs)`` or ``(fn, args, kwargs)`` per run,
    for inputs that cannot be deep-copied (non-leaf views, shared storages).
    ``calls`` runs both that many times on the same inputs (state carried over).
    The compiled run's backward runs inside ``backward_context()`` (compiled
    autograd: ``compile=as_is, backward_context=lambda: aotgrad.compiled_autograd()``).
    Compiling and every forward call run inside ``call_context()`` (an outer ``no_grad``
    or autocast the program is called under); the backward runs outside it.
    ``double_backward`` adds the squared input gradients (``create_graph=True``) to the loss.
    """
    settings = modes.global_state()     # what a program may leave changed (grad mode, determinism...)
    with modes.put_back(settings):      # a program's leftover settings: the next run (and test) starts clean
        fn_e, args_e, kw_e = _fresh(fn, args, kwargs, make)
        for _ in range(calls):
            torch.manual_seed(seed)
            with call_context():
                out_e = fn_e(*args_e, **kw_e)
        rng_e = rng_state()
        weights = _weights(out_e, seed)
        state_e = _state(fn_e, args_e, kw_e)
        settings_e = modes.global_state()
    with modes.put_back(settings):      # the compiled run starts from the settings eager's did
        fn_c, args_c, kw_c = _fresh(fn, args, kwargs, make)
        with call_context():
            compiled = compile(fn_c, args_c, kw_c, **dict(opts))
        for _ in range(calls):
            torch.manual_seed(seed)
            with call_context():
                out_c = compiled(*args_c, **kw_c)
        rng_c = rng_state()
        state_c = _state(fn_c, args_c, kw_c)
        settings_c = modes.global_state()

    _compare_outputs(out_e, out_c, _tensors((args_e, kw_e)), _tensors((args_c, kw_c)), rtol, atol)
    assert_same_rng(rng_e, rng_c, "after the call")
    assert settings_e == settings_c, \
        f"settings after the call differ: {modes.describe(modes.GLOBAL_NAMES, settings_e, settings_c)}"
    _compare_state(state_e, state_c, rtol, atol)

    torch.manual_seed(seed + 2)         # both backwards start from one RNG state and must end at one
    penalty = list(state_e.values()) if double_backward else None
    if backward and _backward(out_e, weights, penalty):
        rng_e = rng_state()
        torch.manual_seed(seed + 2)
        with backward_context():
            assert _backward(out_c, weights, list(state_c.values()) if double_backward else None)
        assert_same_rng(rng_e, rng_state(), "after the backward")
        for name, t in state_e.items():
            c = state_c[name]
            if not t.is_leaf:
                continue            # gradients reach non-leaves' bases, compared there
            if t.grad is None:
                assert c.grad is None or not c.grad.any(), f"{name}: eager has no grad, compiled does"
            else:
                assert c.grad is not None, f"{name}: compiled produced no grad"
                assert_close(t.grad, c.grad, f"grad of {name}", rtol * 10, atol * 10)
        for i, (a, b) in enumerate(zip(_tensors(out_e), _tensors(out_c))):
            if a.retains_grad and a.grad is not None:      # retain_grad() inside the program
                assert b.retains_grad and b.grad is not None, f"output {i}: retained grad missing"
                assert_close(a.grad, b.grad, f"retained grad of output {i}", rtol * 10, atol * 10)
    return Run(fn_c, args_c, kw_c, out_c, compiled)


def check_usage(make: Callable, usage: Callable, *, compile: Callable = default_compile,
                rtol: float = 1.3e-6, atol: float = 1e-5, **opts):
    """Compare a usage pattern (several calls, backwards, optimizer steps and writes in between,
    in any order) eagerly and compiled; return what the compiled run kept, or the exception both
    raised.

    ``make()`` returns fresh ``(fn, args, kwargs)``, called under one seed for both runs.
    ``usage(call, fn, args, kwargs)`` runs the pattern with ``call`` (``fn`` itself, or ``fn``
    compiled) and returns what the user kept: any pytree of tensors, as they are (not copied: a
    later call must not change what an earlier one returned). Compared once the pattern ends: the
    kept tensors (as ``check`` compares outputs), every state tensor and its ``.grad``, the RNG.
    When eager raises, the compiled run must raise an exception of the same type saying the same
    (``_gist``)."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(1234)
        fn, args, kwargs = make()
        call = compile(fn, args, kwargs, **dict(opts)) if compiled else fn
        torch.manual_seed(0)
        try:
            runs.append((usage(call, fn, args, kwargs), _state(fn, args, kwargs), rng_state()))
        except aotgrad.errors.AotgradError:
            raise
        except Exception as e:      # noqa: BLE001  eager's error is compared, not hidden
            runs.append((e, None, None))
    (kept_e, state_e, rng_e), (kept_c, state_c, rng_c) = runs
    if isinstance(kept_e, Exception) or isinstance(kept_c, Exception):
        said = [f"{type(k).__name__}: {k}" if isinstance(k, Exception) else "no error" for k in (kept_e, kept_c)]
        assert type(kept_e) is type(kept_c) and _gist(kept_e) == _gist(kept_c), \
            f"eager: {said[0]}; compiled: {said[1]}"
        return kept_c
    _compare_outputs(kept_e, kept_c, list(state_e.values()), list(state_c.values()), rtol, atol)
    _compare_state(state_e, state_c, rtol, atol)
    assert_same_rng(rng_e, rng_c, "after the usage")
    for name, t in state_e.items():
        g, c = t.grad if t.is_leaf else None, state_c[name].grad if state_c[name].is_leaf else None
        assert (g is None) == (c is None), f"{name}: grad is {g is not None} eager, {c is not None} compiled"
        if g is not None:
            assert_close(g, c, f"grad of {name}", rtol * 10, atol * 10)
    return kept_c


def _gist(e: Exception) -> str:
    """What an error says, without the details that name graph nodes: the text before its first
    colon or parenthesis ("one of the variables needed for gradient computation has been modified
    by an inplace operation", "Trying to backward through the graph a second time ")."""
    return str(e).split(":")[0].split("(")[0].strip()


def _named_state(model):
    return {**{f"param {n}": p for n, p in model.named_parameters()},
            **{f"buffer {n}": b for n, b in model.named_buffers()}}


def check_training(make: Callable, *, steps: int = 3, batches: Callable | None = None,
                   optimizer: Callable = lambda ps: torch.optim.SGD(ps, lr=0.1),
                   compile: Callable = default_compile, backward_context: Callable = contextlib.nullcontext,
                   rtol: float = 1e-5, atol: float = 1e-5,
                   seed: int = 0, **opts) -> list[tuple[float, float]]:
    """Train an eager and a compiled copy of a model side by side; return the
    per-step ``(eager loss, compiled loss)``.

    ``make()`` returns ``(model, args)`` with ``model(*args)`` the loss and must
    build identical copies on each call; capture uses ``args``, and
    ``batches(step)``, if given, supplies each step's args. Every step compares
    the loss, each gradient, and every parameter and buffer after the update,
    so a drift is reported at the step it starts, not after it has compounded.
    """
    model_e, args = make()
    model_c, args_c = make()
    compiled = compile(model_c, tuple(args_c), {}, **dict(opts))
    opt_e, opt_c = optimizer(model_e.parameters()), optimizer(model_c.parameters())
    losses = []
    for step in range(steps):
        batch = tuple(batches(step)) if batches is not None else tuple(args)
        results = []
        for fn, opt, context in ((model_e, opt_e, contextlib.nullcontext), (compiled, opt_c, backward_context)):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(seed + step)
            loss = fn(*batch)
            with context():
                loss.backward()
            results.append(loss)
        assert_close(results[0], results[1], f"loss at step {step}", rtol, atol)
        for (name, t), c in zip(_named_state(model_e).items(), _named_state(model_c).values()):
            if t.grad is not None:
                assert c.grad is not None, f"{name}: compiled produced no grad at step {step}"
                assert_close(t.grad, c.grad, f"grad of {name} at step {step}", rtol * 10, atol * 10)
        opt_e.step()
        opt_c.step()
        for (name, t), c in zip(_named_state(model_e).items(), _named_state(model_c).values()):
            assert_close(t, c, f"{name} after step {step}", rtol * 10, atol * 10)
        losses.append((results[0].item(), results[1].item()))
    return losses


# --- clean refusals ------------------------------------------------------------

def _is_tracing_tensor(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(x, (FakeTensor, FunctionalTensor)) or (
        isinstance(x, torch.Tensor) and type(x) is not torch.nn.Parameter and torch._is_functional_tensor(x))


def _leaked(fn) -> list[str]:
    """Names of tracing tensors (Fake/Functional) left in a module's attributes, or a function's closure."""
    found = []
    if isinstance(fn, torch.nn.Module):
        for mname, m in fn.named_modules(remove_duplicate=False):
            for attr, v in vars(m).items():
                vals = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
                found += [f"{mname or 'module'}.{attr}" for x in vals if _is_tracing_tensor(x)]
    for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
        try:
            found += [f"closure cell {i}"] if _is_tracing_tensor(cell.cell_contents) else []
        except ValueError:
            pass
    return found


class Snapshot:
    """Everything a refused call must leave as it was: the module's parameters and buffers
    (identity, values, metadata, requires_grad), the input tensors, and the global RNG."""

    def __init__(self, fn, args=(), kwargs=None):
        self.fn, self.named = fn, _state(fn, args, kwargs or {})
        # A lazy module's uninitialized parameters hold no values yet: only their identity is kept.
        self.named = {n: t for n, t in self.named.items()
                      if not isinstance(t, torch.nn.parameter.UninitializedTensorMixin)}
        self.saved = {n: (id(t), _nbytes(t) if unreadable(t) else t.detach().clone(), *_placement(t),
                          t.requires_grad, t.is_leaf)
                      for n, t in self.named.items()}
        self.rng, self.settings = rng_state(), modes.global_state()

    def assert_unchanged(self, what="after the refusal"):
        leaked = _leaked(self.fn)
        assert not leaked, f"tracing tensors left in the user's program {what}: {leaked}"
        assert_same_rng(self.rng, rng_state(), what)
        now = modes.global_state()
        assert now == self.settings, f"settings changed {what}: {modes.describe(modes.GLOBAL_NAMES, self.settings, now)}"
        now = _state(self.fn, (), {}) if isinstance(self.fn, torch.nn.Module) else {}
        for name, (ident, value, stride, offset, rg, leaf) in self.saved.items():
            t = now.get(name, self.named[name])
            assert id(t) == ident, f"{name} was replaced {what}"
            assert (*_placement(t), t.requires_grad, t.is_leaf) == (stride, offset, rg, leaf), \
                f"{name} metadata changed {what}"
            if isinstance(value, int):      # a freed storage: its size is all there is to compare
                assert unreadable(t) and _nbytes(t) == value, f"{name}'s freed storage changed {what}"
            else:
                assert_close(value, t.detach(), f"{name} {what}", 0, 0)


def refusal_guard(compile: Callable) -> Callable:
    """Wrap a ``compile`` (as ``check`` takes it) so that a typed refusal, at compile time or
    at any call, is checked to leave the user's state unchanged before it propagates."""
    def guarded(fn, args, kwargs, **opts):
        snap = Snapshot(fn, args, kwargs)
        try:
            compiled = compile(fn, args, kwargs, **opts)
        except aotgrad.errors.AotgradError:
            snap.assert_unchanged("after a refused compile")
            raise

        def call(*a, **k):
            snap = Snapshot(fn, a, k)
            try:
                return compiled(*a, **k)
            except aotgrad.errors.AotgradError:
                snap.assert_unchanged("after a refused call")
                raise
        call.compiled = compiled
        return call
    return guarded


def assert_refused(fn, args=(), kwargs=None, *, make: Callable | None = None,
                   compile: Callable = default_compile, calls: int = 1, **opts):
    """Assert compiling and calling ``fn`` raises an ``aotgrad.errors.AotgradError`` subclass and
    leaves its module, inputs and the RNG unchanged; return the error."""
    fn_c, args_c, kw_c = _fresh(fn, args, kwargs, make)
    try:
        compiled = refusal_guard(compile)(fn_c, args_c, kw_c, **opts)
        for _ in range(calls):
            compiled(*args_c, **kw_c)
    except aotgrad.errors.AotgradError as e:
        return e
    raise AssertionError("expected a typed aotgrad.errors refusal; the call succeeded")
