"""Five systems × four models: first call, steady step, overhead, peak memory.

Systems: eager; ``torch.compile(backend="aot_eager")``; ``torch.compile()``
(Inductor); aotgrad with its eager backend; aotgrad with its inductor
backend. Models: GPT tiny, GPT small, MLP and CNN from ``examples/models.py``.
Each system gets its own freshly seeded copy of the model.

* first call: make the step (aotgrad captures and compiles here; Dynamo
  wraps lazily) plus the first forward+backward, with Inductor's and
  aotgrad's caches off, so it is a cold compile in a warm process;
* steady step: forward+backward, median over interleaved rounds (every round
  times each system in turn, so load drift hits all alike);
* overhead: steady step minus eager's, and the ratio;
* peak: the most bytes live at once during one forward+backward (gradients
  reset to ``None`` first), summed from the profiler's allocation events.
  Those come from the CPU allocator itself, so Inductor's own buffers count,
  unlike ``aotgrad.partition.measure_peak``'s dispatch mode, under which
  Dynamo falls back to eager.

    python -m benchmarks.matrix [--models gpt_tiny,mlp] [--rounds 7] [--png chart.png]
    python -m benchmarks.matrix --replot bench-results/latest.json --png chart.png
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Callable

import torch

from examples import models

MODELS = {
    "gpt_tiny": lambda: models.make_gpt_tiny(batch=4),
    "gpt_small": lambda: models.make_gpt_small(batch=4),
    "mlp": lambda: models.make_mlp(batch=8, width=32, depth=8),
    "cnn": lambda: models.make_cnn(batch=8),
}


def _aotgrad(backend: str):
    def make(model, args):
        import aotgrad
        return aotgrad.capture(model, *args).compile(fw_compiler=backend)
    return make


SYSTEMS: dict[str, Callable] = {
    "eager": lambda model, args: model,
    "torch.compile aot_eager": lambda model, args: torch.compile(model, backend="aot_eager"),
    "torch.compile inductor": lambda model, args: torch.compile(model),
    "aotgrad eager": _aotgrad("eager"),
    "aotgrad inductor": _aotgrad("inductor"),
}
INDUCTOR = {"torch.compile inductor", "aotgrad inductor"}


def _fwd_bwd(step, args):
    def once():
        step(*args).backward()
    return once


@contextlib.contextmanager
def _cold_caches():
    """Inductor's and aotgrad's on-disk caches off, so a first call compiles."""
    import torch._inductor.config as inductor_config
    before = os.environ.get("AOTGRAD_CACHE")
    os.environ["AOTGRAD_CACHE"] = "0"
    try:
        with inductor_config.patch(force_disable_caches=True):
            yield
    finally:
        if before is None:
            del os.environ["AOTGRAD_CACHE"]
        else:
            os.environ["AOTGRAD_CACHE"] = before


def first_call(system: str, model, args):
    """``system``'s step, and the seconds to make it and run its first forward+backward."""
    with _cold_caches():
        t0 = time.perf_counter()
        step = SYSTEMS[system](model, args)
        step(*args).backward()
        return step, time.perf_counter() - t0


def peak_bytes(model, once) -> int:
    """Peak bytes allocated and not yet freed during ``once()``."""
    from torch.profiler import ProfilerActivity, profile
    for p in model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        once()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def _round_seconds(once, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    return (time.perf_counter() - t0) / iters


def _first_calls(name: str, systems: list[str], log) -> tuple[dict, dict]:
    """Row with the first-call time, and a warmed-up forward+backward, per system."""
    rows, calls = {}, {}
    for system in systems:
        model, args = MODELS[name]()
        try:
            step, first = first_call(system, model, args)
        except Exception as e:  # a broken system is a row in the report, not a crash
            rows[system] = {"model": name, "system": system, "error": f"{type(e).__name__}: {e}"[:160]}
            log(f"  {name} / {system}: error {rows[system]['error']}")
            continue
        once = _fwd_bwd(step, args)
        for _ in range(3):      # warm-up: any lazy recompile or first-use cost
            once()
        rows[system] = {"model": name, "system": system, "first_s": first}
        calls[system] = (model, once)
        log(f"  {name} / {system}: first call {first:.2f} s")
    return rows, calls


def _steady_seconds(calls: dict, rounds: int, round_s: float) -> dict[str, list[float]]:
    """Per-call seconds, one sample per system per round; each round visits
    every system in turn, so drift in machine speed hits all alike."""
    slowest = max(_round_seconds(once, 1) for _, once in calls.values())
    iters = max(1, int(round_s / slowest))    # about ``round_s`` for the slowest system
    samples = {s: [] for s in calls}
    for _ in range(rounds):
        for system, (_, once) in calls.items():
            samples[system].append(_round_seconds(once, iters))
    return samples


def run_model(name: str, systems: list[str], rounds: int, round_s: float = 0.25,
              log=print) -> list[dict]:
    rows, calls = _first_calls(name, systems, log)
    samples = _steady_seconds(calls, rounds, round_s) if calls else {}
    for system, (model, once) in calls.items():
        rows[system].update(step_ms=1e3 * statistics.median(samples[system]),
                            peak=peak_bytes(model, once), rounds=rounds)
    base = rows.get("eager", {})
    for row in rows.values():
        if "step_ms" in row and "step_ms" in base:
            row["over_us"] = 1e3 * (row["step_ms"] - base["step_ms"])
            row["step_ratio"] = row["step_ms"] / base["step_ms"]
            row["peak_ratio"] = row["peak"] / base["peak"] if base["peak"] else float("nan")
    return [rows[s] for s in systems]


def warm_up(systems=None, call=None) -> None:
    """Pay the once-per-process costs (importing Dynamo, Inductor and their
    C++ toolchain checks) on a throwaway function, so that the first system
    of a kind does not carry them for the others. ``systems``/``call``: another
    table's systems and its first-call function (default: this module's)."""
    import warnings
    warnings.filterwarnings("ignore", message=".*force_disable_caches.*")
    model, args = models.make_mlp(batch=2, width=4, depth=2)
    for system in SYSTEMS if systems is None else systems:
        try:
            (call or first_call)(system, model, args)
        except Exception:   # reported where it matters, in the model's own row
            pass


def run(model_names: list[str], rounds: int = 7, skip: set[tuple[str, str]] = frozenset(),
        log=print) -> list[dict]:
    warm_up()
    out = []
    for name in model_names:
        systems = [s for s in SYSTEMS if (name, s) not in skip]
        out += run_model(name, systems, rounds, log=log)
    return out


def _fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | system | first call (s) | steady step (ms) | ×eager "
             "| overhead vs eager (µs) | peak (KiB) | ×eager |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['system']} | error: {r['error']} ||||||")
            continue
        ratio = lambda k: f"{r[k]:.2f}" if k in r else ""  # noqa: E731
        over = f"{r['over_us']:+.0f}" if "over_us" in r else ""
        lines.append(f"| {r['model']} | {r['system']} | {r['first_s']:.2f} "
                     f"| {_fmt_ms(r['step_ms'])} | {ratio('step_ratio')} | {over} "
                     f"| {r['peak'] / 1024:,.0f} | {ratio('peak_ratio')} |")
    return "\n".join(lines)


def chart(rows: list[dict], path: str) -> None:
    """Three panels, one bar group per model: first call in seconds on a log
    axis (eager's is a plain step, so ratios to it say little), then steady
    step and peak memory as ratios to eager."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    model_names = list(dict.fromkeys(r["model"] for r in rows))
    panels = [("first_s", "first call: make + first fwd+bwd", "seconds", list(SYSTEMS)),
              ("step_ratio", "steady step (fwd+bwd, median)", "× eager (lower is better)",
               [s for s in SYSTEMS if s != "eager"]),
              ("peak_ratio", "peak memory in one fwd+bwd", "× eager (lower is better)",
               [s for s in SYSTEMS if s != "eager"])]
    colours = dict(zip(SYSTEMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    by_key = {(r["model"], r["system"]): r for r in rows}
    for ax, (key, title, unit, systems) in zip(axes, panels):
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            cells = [(j, by_key.get((m, system), {}).get(key)) for j, m in enumerate(model_names)]
            cells = [(j + (i - (len(systems) - 1) / 2) * width, v) for j, v in cells if v]
            bars = ax.bar([x for x, _ in cells], [v for _, v in cells], width,
                          label=system, color=colours[system])
            ax.bar_label(bars, fmt="%.3g", fontsize=6, rotation=90, padding=2)
        if key == "first_s":
            ax.set_yscale("log")    # spans milliseconds (eager) to a minute (Inductor)
        else:
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.margins(y=0.15)      # room for the value labels
        ax.set_xticks(range(len(model_names)), model_names)
        ax.set_title(title)
        ax.set_ylabel(unit)
    present = [s for s in SYSTEMS if any(r["system"] == s and "error" not in r for r in rows)]
    fig.legend([Patch(color=colours[s]) for s in present], present,
               loc="lower center", ncol=len(present), frameon=False)
    fig.suptitle(f"aotgrad benchmarks, CPU, {torch.get_num_threads()} thread(s)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--png", help="also draw the chart here")
    p.add_argument("--replot", metavar="JSON",
                   help="measure nothing: redraw from `benchmarks.run --json`'s file")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.replot:
        with open(a.replot) as f:
            rows = json.load(f)["matrix"]
    else:
        rows = run(a.models.split(","), a.rounds)
    print(table(rows))
    if a.png:
        chart(rows, a.png)


if __name__ == "__main__":
    main()
