"""Per-call overhead of a compiled training step.

The model is an 8-layer width-32 MLP on a batch of 8: each kernel takes a few
microseconds, so the time per forward+backward is dominated by what the
system does around the kernels (wrapping, argument handling, autograd glue).

    python -m benchmarks.overhead
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import SYSTEMS, per_call_us
from examples import models


def _call(system: str):
    """One forward+backward of ``system``'s step; gradients simply accumulate,
    which costs every system the same."""
    model, args = models.make_mlp(batch=8, width=32, depth=8)
    step = SYSTEMS[system](model, args)
    return lambda: step(*args).backward()


def run(iters: int = 300, repeats: int = 9) -> list[dict]:
    calls, rows = {}, {}
    for system in SYSTEMS:
        try:
            calls[system] = _call(system)
        except Exception as e:  # a broken system is a row in the report, not a crash
            rows[system] = {"system": system, "error": f"{type(e).__name__}: {e}"[:120]}
    # Interleaved rounds, so drift in machine speed hits every system alike.
    samples = {s: [] for s in calls}
    for _ in range(repeats):
        for system, call in calls.items():
            samples[system].append(per_call_us(call, iters=iters, repeats=1))
    for system, xs in samples.items():
        rows[system] = {"system": system, "us": statistics.median(xs)}
    base = rows["eager"].get("us")
    for row in rows.values():
        if "us" in row and base:
            row["over_eager_us"] = row["us"] - base
            row["ratio"] = row["us"] / base
    return [rows[s] for s in SYSTEMS]


def table(rows: list[dict]) -> str:
    lines = ["| system | µs / fwd+bwd | overhead vs eager |", "|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error']} | |")
        else:
            lines.append(f"| {r['system']} | {r['us']:.1f} | "
                         f"{r['over_eager_us']:+.1f} µs ({r['ratio']:.2f}x) |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads; one keeps tiny-kernel timings steady")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"MLP 8x32, batch 8, {torch.get_num_threads()} threads; "
          f"median of {a.repeats} x {a.iters} calls")
    print(table(run(a.iters, a.repeats)))


if __name__ == "__main__":
    main()
