"""Real models (``tests/models/zoo.py``: tiny random-init HuggingFace and timm models, dropout on):
aotgrad's four entry points against eager, ``torch.compile(backend="aot_eager")`` and default
``torch.compile`` (Inductor), in one run.

* first call: make the step and run its first forward+backward, Inductor's and aotgrad's caches
  off and Dynamo reset, so each is a cold compile in a warm process; ``×aot_eager`` is its ratio to
  ``torch.compile(backend="aot_eager")``'s first call on the same model;
* steady step: forward+backward, median of interleaved rounds (each round times every system in
  turn, so load drift hits all alike), and its ratio to eager;
* peak: the most bytes live at once in one forward+backward (gradients reset first), from the CPU
  allocator's own events (``benchmarks.matrix.peak_bytes``), so Inductor's buffers and compiled
  autograd's count. ``aotgrad.partition.measure_peak`` is a dispatch mode, under which Dynamo
  falls back to eager: it would report eager's peak for the ``torch.compile`` rows.

A system that fails is a row with its error, typed (``aotgrad.errors``) or not.

    python -m benchmarks.models [--models gpt2,resnet18 | all] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import aotgrad
from benchmarks import matrix
from tests.models import zoo

DEFAULT_MODELS = ("gpt2", "resnet18")


def _fwd_bwd(step, args):
    def once():
        step(*args).backward()
    return once


def _compiled_autograd(model, args):
    """Eager forward; every backward captured and run by aotgrad's compiled autograd."""
    aotgrad.compiled_autograd.reset()

    def once():
        loss = model(*args)
        with aotgrad.compiled_autograd("eager"):
            loss.backward()
    return once


# Each makes ``once()``, one forward+backward of ``model`` on ``args``; Dynamo's systems start
# from a reset Dynamo (the same forward code of a fresh model would otherwise count as a recompile).
SYSTEMS = {
    "eager": lambda m, a: _fwd_bwd(m, a),
    "torch.compile aot_eager": lambda m, a: _fwd_bwd(torch.compile(m, backend="aot_eager"), a),
    "torch.compile inductor": lambda m, a: _fwd_bwd(torch.compile(m), a),
    "aotgrad capture": lambda m, a: _fwd_bwd(aotgrad.capture(m, *a).compile(), a),
    "aotgrad torch.compile": lambda m, a: _fwd_bwd(torch.compile(m, backend="aotgrad"), a),
    "aotgrad jit": lambda m, a: _fwd_bwd(aotgrad.jit(m), a),
    "aotgrad compiled_autograd": _compiled_autograd,
}


def first_call(system: str, model, args):
    """``once`` for ``system``, and the seconds to make it and run it the first time."""
    torch._dynamo.reset()
    with matrix._cold_caches():
        t0 = time.perf_counter()
        once = SYSTEMS[system](model, args)
        once()
        return once, time.perf_counter() - t0


def _error(e: Exception) -> str:
    kind = "typed " if isinstance(e, aotgrad.errors.AotgradError) else ""
    return f"{kind}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def _first_calls(name: str, systems, log) -> tuple[dict, dict]:
    rows, calls = {}, {}
    make = zoo.MODELS[name][0]
    for system in systems:
        model, args = make()
        try:
            once, first = first_call(system, model, args)
            for _ in range(2):      # warm-up: any lazy recompile or first-use cost
                once()
        except Exception as e:      # a failing system is a row in the report, not a crash
            rows[system] = {"model": name, "system": system, "error": _error(e)}
            log(f"  {name} / {system}: error {rows[system]['error']}")
            continue
        rows[system] = {"model": name, "system": system, "first_s": first}
        calls[system] = (model, once)
        log(f"  {name} / {system}: first call {first:.2f} s")
    return rows, calls


def _ratios(rows: dict) -> None:
    eager, aot = rows.get("eager", {}), rows.get("torch.compile aot_eager", {})
    for row in rows.values():
        if "step_ms" in row and "step_ms" in eager:
            row["step_ratio"] = row["step_ms"] / eager["step_ms"]
            row["peak_ratio"] = row["peak"] / eager["peak"] if eager["peak"] else float("nan")
        if "first_s" in row and "first_s" in aot and row["system"] != "eager":   # eager compiles nothing
            row["first_ratio"] = row["first_s"] / aot["first_s"]


def run_model(name: str, systems, rounds: int, round_s: float = 0.5, log=print) -> list[dict]:
    rows, calls = _first_calls(name, systems, log)
    samples = matrix._steady_seconds(calls, rounds, round_s) if calls else {}
    for system, (model, once) in calls.items():
        rows[system].update(step_ms=1e3 * statistics.median(samples[system]), peak=matrix.peak_bytes(model, once))
    _ratios(rows)
    torch._dynamo.reset()
    return [rows[s] for s in systems]


def warm_up(names) -> None:
    """Pay once-per-process costs (importing Dynamo, Inductor, transformers, timm) outside the rows."""
    matrix.warm_up(SYSTEMS, first_call)
    for name in names:
        zoo.MODELS[name][0]()


def run(names, rounds: int = 5, skip=frozenset(), log=print) -> list[dict]:
    """Rows for every model; each model's table is logged as soon as it is measured (a full run takes an hour)."""
    warm_up(names)
    rows = []
    for name in names:
        rows += run_model(name, [s for s in SYSTEMS if (name, s) not in skip], rounds, log=log)
        log(table([r for r in rows if r["model"] == name]))
    return rows


def _fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    lines = ["| model | system | first call (s) | ×aot_eager | steady step (ms) | ×eager | peak (KiB) | ×eager |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['system']} | {r['error']} ||||||")
            continue
        lines.append(f"| {r['model']} | {r['system']} | {r['first_s']:.2f} | {_fmt(r.get('first_ratio'), '.2f')} "
                     f"| {r['step_ms']:.2f} | {_fmt(r.get('step_ratio'), '.2f')} | {r['peak'] / 1024:,.0f} "
                     f"| {_fmt(r.get('peak_ratio'), '.2f')} |")
    return "\n".join(lines)


def parse_models(text: str) -> list[str]:
    names = list(zoo.MODELS) if text == "all" else text.split(",")
    unknown = set(names) - set(zoo.MODELS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from {','.join(zoo.MODELS)} or all")
    return names


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"subset of {','.join(zoo.MODELS)}, or all")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-inductor", action="store_true", help="leave out default torch.compile (minutes of compiling)")
    a = p.parse_args()
    torch.set_num_threads(1)
    names = parse_models(a.models)
    skip = {(n, "torch.compile inductor") for n in names} if a.no_inductor else set()
    print(table(run(names, a.rounds, skip)))


if __name__ == "__main__":
    main()
