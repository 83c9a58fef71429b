"""Run one program through one entry point and classify the outcome.

PASS: every call matches eager through ``tests.eager_check.check``. TYPED: aotgrad refused
with an ``aotgrad.errors.AotgradError`` that left the user's module, inputs and RNG as they
were (a failure for a ``must_match`` program). FAIL: any mismatch, untyped exception, or
unclean refusal. SKIP: the combination tests nothing (say why).

Every case runs on a ``device``: ``cpu``, or ``cuda`` where ``torch.cuda.is_available()``: the
program is built under ``torch.device(device)`` (its modules, inputs and closures live there),
and a program eager itself cannot run there (a CPU tensor made inside the function) is skipped.
Floats compare within the program's tolerance, raised to the entry's and the device's.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.utils._pytree as pytree

import aotgrad
from aotgrad.runtime import modes
from tests.eager_check import _backward, _leaked, _tensors, _weights, check, refusal_guard, unreadable

from .entries import ENTRIES, Entry
from .programs import PROGRAMS, Program, leaf_with

SEED = 1234
# Floors per device: CUDA's atomics (index_add_, scatter_add_, many backwards) sum in any order.
DEVICE_TOL = {"cpu": (0.0, 0.0), "cuda": (1e-5, 1e-5)}


def devices() -> list[str]:
    """The devices cases run on here (never initialises CUDA)."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@dataclass
class Result:
    program: str
    entry: str
    outcome: str            # pass / typed / fail / skip
    detail: str = ""
    user_line: bool = True  # for typed: whether the error names the user's line
    device: str = "cpu"


_DEVICE = ["cpu"]           # the device of the case running now (set by run_case)


def _made(prog: Program, **kw):
    torch.manual_seed(SEED)
    with torch.device(_DEVICE[0]) if _DEVICE[0] != "cpu" else contextlib.nullcontext():
        return prog.make(**kw)


def tolerance(prog: Program, entry: Entry, device: str) -> tuple:
    return tuple(max(t) for t in zip(prog.tol, entry.tol, DEVICE_TOL[device]))


def _bigger(prog: Program, by: int = 2):
    n = inspect.signature(prog.make).parameters.get("n")
    return None if n is None else {"n": n.default + by}


def _restrided(t):
    if t.dim() < 2 or t.numel() <= 1:
        return None
    shape = (*t.shape[:-2], t.shape[-1], t.shape[-2])
    stride = list(torch.empty(shape).stride())
    stride[-1], stride[-2] = stride[-2], stride[-1]
    return leaf_with(t.detach(), tuple(stride), 0).requires_grad_(t.requires_grad)


def _offset(t):
    return leaf_with(t.detach(), t.stride(), 3).requires_grad_(t.requires_grad) if t.numel() else None


_TRANSFORMS = {"stride": _restrided, "offset": _offset}


def _variant_args(prog, variant):
    """Fresh ``(args, kwargs)`` for one call, or None when the variant changes nothing."""
    if variant in ("size", "resize"):
        kw = _bigger(prog, 2 if variant == "size" else 3)
        return None if kw is None else _made(prog, **kw)[1:]
    _, args, kwargs = _made(prog)
    if variant == "base":
        return args, kwargs
    changed = []

    def change(x):
        if not isinstance(x, torch.Tensor) or type(x) is not torch.Tensor or not x.is_leaf or \
                x.layout != torch.strided or x.is_nested or x._is_view() or unreadable(x):
            return x
        y = _TRANSFORMS[variant](x)
        changed.append(y is not None)
        return x if y is None else y
    new = pytree.tree_map(change, (args, kwargs))
    return new if any(changed) else None


def _eager_runs(prog, variant) -> bool:
    """Whether eager itself runs the program on this variant's inputs (``x.view(-1)`` of a
    transposed input, or a closure sized for the first ``n``, does not: nothing to compare)."""
    fn, (args, kwargs) = _made(prog)[0], _variant_args(prog, variant)
    try:
        with prog.outer():
            out = fn(*args, **kwargs)
        if prog.backward:
            _backward(out, _weights(out, 0))
        return True
    except Exception:       # noqa: BLE001  any eager failure makes the variant inapplicable
        return False


def _compare(prog, entry, fns, compiled_box, variant):
    first, second = _variant_args(prog, variant), _variant_args(prog, variant)
    if first is None or (variant != "base" and not _eager_runs(prog, variant)):
        return False
    pair = iter([(fns[0], *first), (fns[1], *second)])
    rtol, atol = tolerance(prog, entry, _DEVICE[0])

    def compile_once(fn, args, kwargs):
        if compiled_box[0] is None:
            compiled_box[0] = refusal_guard(lambda f, a, k: entry.compile(f, a, k))(fn, args, kwargs)
        return compiled_box[0]
    run = check(None, make=lambda: next(pair), compile=compile_once, backward=prog.backward,
                backward_context=entry.backward_context, call_context=prog.outer,
                double_backward=prog.double_backward, rtol=rtol, atol=atol, seed=0, calls=prog.calls)
    return any(o.requires_grad for o in _tensors(run.out))


def _expect_raise(prog, entry):
    fn, args, kwargs = _made(prog)
    try:
        with prog.outer():
            refusal_guard(lambda f, a, k: entry.compile(f, a, k))(fn, args, kwargs)(*args, **kwargs)
    except aotgrad.errors.AotgradError as e:
        return Result(prog.name, entry.name, "typed", _one_line(e), e.user_line is not None)
    except RuntimeError as e:
        return Result(prog.name, entry.name, "pass", f"raised like eager: {_one_line(e)}")
    return Result(prog.name, entry.name, "fail", "eager raises, compiled returned a result")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    inner = [f for f in frames if "/aotgrad/" in f.filename] or frames
    if not inner:
        return ""
    f = inner[-1]
    return f" [{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}]"


def _classify(prog, entry, body) -> Result:
    try:
        return body()
    except aotgrad.errors.BudgetError as e:
        return Result(prog.name, entry.name, "skip", f"budget unreachable for this program: {_one_line(e)}")
    except aotgrad.errors.AotgradError as e:
        if prog.must_match and entry.name not in prog.may_refuse:
            return Result(prog.name, entry.name, "fail", f"refused a must_match program: {_one_line(e)}")
        return Result(prog.name, entry.name, "typed", _one_line(e), e.user_line is not None)
    except AssertionError as e:
        kind = "unclean refusal" if isinstance(e.__context__, aotgrad.errors.AotgradError) else "mismatch"
        return Result(prog.name, entry.name, "fail", f"{kind}: {_one_line(e)}"[:400])
    except Exception as e:      # noqa: BLE001  an untyped exception is a failure to report, not to crash on
        return Result(prog.name, entry.name, "fail", f"untyped {_one_line(e)}{_where(e)}"[:400])


@contextlib.contextmanager
def on_device(device: str):
    """Build and run the programs of the cases inside on ``device``."""
    before, _DEVICE[0] = _DEVICE[0], device
    try:
        yield
    finally:
        _DEVICE[0] = before


def run_case(prog: Program, entry: Entry, isolate: bool = True, device: str = "cpu") -> Result:
    """Run ``prog`` through ``entry`` on ``device`` for every input variant; the first non-pass decides.
    Programs tagged ``isolate`` run in a child process unless ``isolate=False``."""
    if device not in devices():
        return Result(prog.name, entry.name, "skip", f"no {device} on this machine", device=device)
    if isolate and "isolate" in prog.tags:
        return run_isolated(prog.name, entry.name, device=device)
    # A program's eager run may leave global settings changed (the *_left_* programs): the next starts clean.
    with modes.put_back(modes.global_state()), on_device(device):
        if device != "cpu" and not _eager_runs(prog, "base"):
            result = Result(prog.name, entry.name, "skip", f"eager itself does not run this program on {device}")
        elif entry.name == "export":
            from .exported import run as run_exported
            result = run_exported([prog])[prog.name]
        else:
            result = _run_entry(prog, entry)
    result.device = device
    return result


def _run_entry(prog: Program, entry: Entry) -> Result:
    entry.reset()
    if prog.eager_raises:
        return _classify(prog, entry, lambda: _expect_raise(prog, entry))

    ran = []

    def body():
        fns = (_made(prog)[0], _made(prog)[0])
        box, grads = [None], False
        for variant in entry.variants:
            ran.append(f"{variant}?")
            try:
                got = _compare(prog, entry, fns, box, variant)
            except aotgrad.errors.InputMismatchError:
                if not entry.staged or variant == "base":
                    raise
                ran[-1] = f"{variant} (refused: not the captured inputs)"
                continue
            ran.pop()
            if got is not False or variant == "base":
                ran.append(variant)
                grads = grads or got
        leaked = _leaked(fns[1])
        assert not leaked, f"tracing tensors left in the user's program: {leaked}"
        if entry.name == "compiled_autograd" and not (prog.backward and grads):
            return Result(prog.name, entry.name, "skip", "no backward to compile")
        return Result(prog.name, entry.name, "pass", "calls: " + ", ".join(ran))
    try:
        result = _classify(prog, entry, body)
    finally:
        entry.reset()
    if result.outcome != "pass" and ran and ran[-1].endswith("?") and ran[-1] != "base?":
        result.detail = f"[at the {ran[-1][:-1]} call, after {', '.join(ran[:-1])}] {result.detail}"
    return result


def run_isolated(program: str, entry: str, timeout: float = 300, device: str = "cpu") -> Result:
    """Run one case in a child process: a program that may kill its process (a crash is a FAIL)."""
    code = ("import json; from tests.differential.harness import *; "
            f"r = run_case(PROGRAMS[{program!r}], ENTRIES[{entry!r}], isolate=False, device={device!r}); "
            "print('RESULT' + json.dumps(asdict(r)))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Result(program, entry, "fail", f"timed out after {timeout:.0f} s", device=device)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return Result(**json.loads(line[len("RESULT"):]))
    return Result(program, entry, "fail", f"process died (exit {proc.returncode}): {proc.stderr.strip()[-300:]}",
                  device=device)


def cases():
    """Every (program, entry, device) of the table, in table order (CUDA ones skip without CUDA)."""
    return [(p, e, d) for p in PROGRAMS for e in ENTRIES for d in ("cpu", "cuda")]
