"""The ``export`` entry: capture -> ``export(path)`` -> ``aotgrad.load`` in a fresh process -> call
the loaded step and train it ``STEPS`` SGD steps, compared with eager doing the same.

This process captures and exports every program of a batch and trains eager copies; ONE child
process (``python -m tests.differential.exported JOB OUT``) then loads every artifact, rebuilds the
program's inputs from its ``make`` under the same seed (the artifact holds the parameters, buffers
and graphs; the inputs are the caller's) and trains it the same way. A child that dies fails the
program it was running; the rest go to a new child. Compared per step: outputs (structure,
values within the case's tolerance, dtype, shape, strides, requires_grad, is_leaf, is view), the
inputs after the call, the RNG state after the call and after the backward, every gradient, and
every parameter, buffer and input after the update (``p -= LR * p.grad`` on every leaf with a grad).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import torch.utils._pytree as pytree

import aotgrad
from tests.eager_check import (Snapshot, _backward, _strides, _tensors, _weights, assert_close, assert_same_rng,
                               rng_state, unreadable)

from .entries import ENTRIES
from .harness import PROGRAMS, Result, _classify, _made, _one_line, on_device, tolerance

STEPS, LR = 3, 0.05
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DONE: dict = {}        # (program, device) -> Result, filled by a batch


def _record(t):
    if not isinstance(t, torch.Tensor):
        return t if t is None or isinstance(t, (bool, int, float, str, torch.dtype)) else repr(t)
    plain = t.layout == torch.strided and not t.is_nested and t.numel() > 1
    meta = (_strides(t) if plain else None, t.requires_grad, t.is_leaf, t._is_view())
    # A freed storage (FSDP-style) has no values to read or save: its size is what is compared.
    return {"meta": meta, "value": t.untyped_storage().nbytes() if unreadable(t) else t.detach().clone()}


def _snapshot(tree):
    leaves, spec = pytree.tree_flatten(tree)
    return str(spec), [_record(x) for x in leaves]


def _state(fn, args, kwargs) -> dict:
    """Parameters and buffers by name (the loaded step's are named as the module's), inputs by position."""
    named = {f"param {n}": p for n, p in fn.named_parameters()} if hasattr(fn, "named_parameters") else {}
    named.update({f"buffer {n}": b for n, b in fn.named_buffers()} if hasattr(fn, "named_buffers") else {})
    named.update({f"input tensor {i}": t for i, t in enumerate(_tensors((args, kwargs)))})
    return named


def train(fn, args, kwargs, prog) -> list[dict]:
    """``STEPS`` steps of call, weighted backward, SGD update; a step that raises ends the list."""
    records = []
    for step in range(STEPS):
        torch.manual_seed(step)
        snap = Snapshot(None, args, kwargs)     # inputs and RNG: what a refused call must leave as they were
        try:
            with prog.outer():
                out = fn(*args, **kwargs)
            rec = {"out": _snapshot(out), "inputs": _snapshot(_tensors((args, kwargs))), "rng_call": rng_state()}
            torch.manual_seed(100 + step)
            if prog.backward:
                _backward(out, _weights(out, step))
            rec["rng_backward"] = rng_state()
            named = _state(fn, args, kwargs)
            leaves = {n: t for n, t in named.items() if t.is_leaf and t.grad is not None}
            rec["grads"] = {n: _record(t.grad) for n, t in leaves.items()}
            with torch.no_grad():
                for t in leaves.values():
                    if not unreadable(t):       # a parameter freed by the step (FSDP's unsharded one): no update
                        t.sub_(LR * t.grad)
                    t.grad = None
            rec["state"] = {n: _record(t) for n, t in named.items()}
        except Exception as e:      # noqa: BLE001  compared with the other side's error
            records.append({"error": type(e).__name__, **_refusal(e, snap)})
            break
        records.append(rec)
    return records


def _refusal(e, snap) -> dict:
    """Whether ``e`` is a typed refusal that left the inputs and the RNG as they were, and its message."""
    message = _one_line(e)
    if not isinstance(e, aotgrad.errors.AotgradError):
        return {"typed": False, "message": message}
    try:
        snap.assert_unchanged()
    except AssertionError as unclean:
        return {"typed": False, "message": f"unclean refusal ({unclean}): {message}"}
    return {"typed": True, "message": message}


def _same(a, b, what, rtol, atol):
    if isinstance(a, dict) and "meta" in a:
        assert isinstance(b, dict) and "meta" in b, f"{what}: eager gave a tensor, the loaded step {b!r}"
        assert a["meta"] == b["meta"], f"{what}: (strides, requires_grad, is_leaf, is view) {a['meta']} vs {b['meta']}"
        _same(a["value"], b["value"], what, rtol, atol) if type(a["value"]) is int else \
            assert_close(a["value"], b["value"], what, rtol, atol)
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} vs {b!r}"


def _same_tree(a, b, what, rtol, atol):
    assert a[0] == b[0], f"{what}: structure differs:\n eager {a[0]}\n loaded {b[0]}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        _same(x, y, f"{what} {i}", rtol, atol)


def compare(eager: list, loaded: list, rtol, atol) -> str:
    """Assert the loaded step trained like eager; say how far it went."""
    for step, (e, c) in enumerate(zip(eager, loaded)):
        if "error" in e or "error" in c:
            said = [f"{r['error']}: {r['message']}" if "error" in r else "no error" for r in (e, c)]
            assert e.get("error") == c.get("error"), f"step {step}: eager {said[0]}; loaded step {said[1]}"
            return f"raised like eager at step {step}: {said[0]}"
        _same_tree(e["out"], c["out"], f"step {step}: output", rtol, atol)
        _same_tree(e["inputs"], c["inputs"], f"step {step}: input after the call", rtol, atol)
        assert_same_rng(e["rng_call"], c["rng_call"], f"after the call at step {step}")
        assert_same_rng(e["rng_backward"], c["rng_backward"], f"after the backward at step {step}")
        for kind, what in (("grads", "grad of"), ("state", "after the update:")):
            assert e[kind].keys() == c[kind].keys(), f"step {step}: {kind} of {sorted(e[kind])} vs {sorted(c[kind])}"
            for n in e[kind]:
                _same(e[kind][n], c[kind][n], f"step {step}: {what} {n}", rtol * 10, atol * 10)
    assert len(eager) == len(loaded), f"eager ran {len(eager)} steps, the loaded step {len(loaded)}"
    return f"{len(eager)} steps trained like eager"


def _export(prog, path) -> Result | list:
    """Export ``prog`` to ``path`` and train an eager copy: its records, or the Result that ends the case."""
    fn, args, kwargs = _made(prog)
    snap = Snapshot(fn, args, kwargs)
    try:
        with prog.outer():
            captured = aotgrad.capture(fn, *args, **kwargs)
    except aotgrad.errors.AotgradError:
        snap.assert_unchanged("after a refused capture")
        raise
    try:
        captured.export(path)
    except aotgrad.errors.AotgradError as e:     # the format's own limits (hooks, symbolic sizes ...)
        snap.assert_unchanged("after a refused export")
        return Result(prog.name, "export", "typed", f"export refused: {_one_line(e)}", e.user_line is not None)
    fn, args, kwargs = _made(prog)
    return train(fn, args, kwargs, prog)


def run(progs: list, device: str | None = None) -> dict:
    """``{name: Result}`` for ``progs`` on ``device`` (the current one by default), batched into one child."""
    from .harness import _DEVICE
    device = device or _DEVICE[0]
    todo = [p for p in progs if (p.name, device) not in _DONE]
    entry = ENTRIES["export"]
    with tempfile.TemporaryDirectory(prefix="aotgrad-diff-export-") as tmp, on_device(device):
        eager, job = {}, []
        for prog in todo:
            path = os.path.join(tmp, f"{prog.name}.aotgrad")
            got = _classify(prog, entry, lambda: _export(prog, path))
            if isinstance(got, Result):
                _DONE[prog.name, device] = got
            else:
                eager[prog.name] = got
                job.append((prog.name, path))
        for name, loaded in _children(job, device, tmp).items():
            prog = PROGRAMS[name]
            _DONE[name, device] = _classify(prog, entry, lambda: _judge(prog, eager[name], loaded, device))
    return {p.name: _DONE[p.name, device] for p in progs}


def _judge(prog, eager, loaded, device) -> Result:
    if isinstance(loaded, str):
        return Result(prog.name, "export", "fail", loaded)
    last, step = (loaded[-1], len(loaded) - 1) if loaded else ({}, 0)
    if last.get("typed"):       # a clean typed refusal (say, of inputs eager's own step changed) at any step
        return Result(prog.name, "export", "typed", f"the loaded step refused its call at step {step}: "
                      f"{last['message']}")
    return Result(prog.name, "export", "pass", compare(eager, loaded, *tolerance(prog, ENTRIES["export"], device)))


def _children(job, device, tmp) -> dict:
    """Run ``job`` in fresh processes: ``{name: records, or the reason it has none}``."""
    results, pending = {}, list(job)
    while pending:
        job_path, out_path = os.path.join(tmp, "job.pt"), os.path.join(tmp, "out.pt")
        torch.save({"device": device, "programs": pending}, job_path)
        if os.path.exists(out_path):
            os.remove(out_path)
        try:
            proc = subprocess.run([sys.executable, "-m", "tests.differential.exported", job_path, out_path],
                                  cwd=REPO, capture_output=True, text=True, timeout=300 + 30 * len(pending))
            died = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            died = "timed out"
        done = torch.load(out_path, weights_only=False) if os.path.exists(out_path) else {}
        results.update(done)
        pending = [(n, p) for n, p in pending if n not in done]
        if died and pending:        # the first one left is the one that killed the child
            results[pending[0][0]] = f"the loading process died ({died})"
            pending = pending[1:]
        elif not died:
            assert not pending, f"the child returned no result for {pending}"
    return results


def _child(job_path, out_path):
    job = torch.load(job_path, weights_only=False)
    out = {}
    with on_device(job["device"]):
        for name, path in job["programs"]:
            try:
                step = aotgrad.load(path)
            except Exception as e:      # noqa: BLE001  an artifact export wrote must load
                out[name] = f"exported, but loading it raised {_one_line(e)}"
            else:
                _, args, kwargs = _made(PROGRAMS[name])
                out[name] = train(step, args, kwargs, PROGRAMS[name])
            torch.save(out, out_path)   # after each: a crash keeps the ones before


if __name__ == "__main__":
    _child(*sys.argv[1:])
