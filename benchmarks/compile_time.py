"""Time from nothing to a trained step: capture + compile of gpt_small.

Two views, medians over repeats:

* cold: a fresh ``python`` per measurement, so importing torch and the
  system's own modules counts, as it does for a user starting a job;
* warm: in this process after one warm-up, so only tracing and compiling
  count.

PyTorch's ``aot_function`` traces lazily on the first call, so for every
system the measured span is: make the step, run the first forward+backward.
The *compile* column subtracts one steady-state step from that span.

    python -m benchmarks.compile_time
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# No torch import at module level: a cold child must time it.
COMPARED = ("eager", "torch_aot", "aotgrad")
LIBRARY_IMPORTS = {
    "eager": "",
    "torch_aot": "import functorch.compile, torch._functorch.aot_autograd",
    "aotgrad": "import aotgrad",
}


def _timed_step(system: str) -> dict:
    """Build gpt_small, make ``system``'s step and train two steps; seconds."""
    from benchmarks.common import SYSTEMS, train_once
    from examples import models

    t0 = time.perf_counter()
    model, args = models.make_gpt_small(batch=4)
    t1 = time.perf_counter()
    step = SYSTEMS[system](model, args)
    t2 = time.perf_counter()
    train_once(step, args)
    t3 = time.perf_counter()
    train_once(step, args)
    t4 = time.perf_counter()
    return {"build": t1 - t0, "make": t2 - t1, "first": t3 - t2, "steady": t4 - t3,
            "compile": (t3 - t1) - (t4 - t3)}


def child(system: str) -> dict:
    """Run inside a fresh interpreter: time imports, then the step."""
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    exec(LIBRARY_IMPORTS[system])
    t2 = time.perf_counter()
    return {"import_torch": t1 - t0, "import_lib": t2 - t1, **_timed_step(system)}


def cold(system: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", system],
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process": wall}


def warm(system: str) -> dict:
    return _timed_step(system)


def _median(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def run(repeats: int = 3) -> list[dict]:
    rows = []
    for system in COMPARED:
        row = {"system": system}
        try:
            row["cold"] = _median([cold(system) for _ in range(repeats)])
            warm(system)  # warm-up: first-use costs belong to the cold view
            row["warm"] = _median([warm(system) for _ in range(repeats)])
        except Exception as e:  # a broken system is a row in the report, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:160]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| system | cold: process | cold: import lib | cold: compile | warm: compile "
             "| warm: make + first step | steady step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error']} | | | | | |")
            continue
        c, w = r["cold"], r["warm"]
        lines.append(f"| {r['system']} | {c['process']:.2f} s | {c['import_lib']:.2f} s "
                     f"| {c['compile']:.2f} s | {w['compile']:.2f} s "
                     f"| {w['make'] + w['first']:.2f} s | {w['steady'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=COMPARED, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    print(f"gpt_small training step, median of {a.repeats}")
    print(table(run(a.repeats)))


if __name__ == "__main__":
    main()
