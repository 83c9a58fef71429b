"""Per-call overhead of a compiled training step.

The model is an 8-layer width-32 MLP (batch 16 from the command line, 8 in
``benchmarks.run``): each kernel takes a few microseconds, so the time per
forward+backward is dominated by what the system does around the kernels
(wrapping, argument handling, guards, autograd glue). Rows: eager, PyTorch's
AOTAutograd with no-op compilers (``aot_function`` over ``functional_call``, and
``aot_module`` as issue #61 names it), the staged ``aotgrad.capture(m, x).compile()``
and ``aotgrad.jit`` (both with the eager backend); the last column is each one's
overhead over eager as a fraction of ``aot_module``'s (the median of each round's share).

    python -m benchmarks.overhead [--batch 16]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import SYSTEMS, per_call_us
from examples import models


def _aot_module(model, args=()):
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_module
    return aot_module(model, fw_compiler=nop, bw_compiler=nop)


def _jit(model, args=()):
    import aotgrad
    return aotgrad.jit(model, fw_compiler="eager")


ROWS = {**SYSTEMS, "torch_aot_module": _aot_module, "aotgrad.jit": _jit}
REFERENCE = "torch_aot_module"


def _call(system: str, batch: int):
    """One forward+backward of ``system``'s step; gradients simply accumulate,
    which costs every system the same."""
    model, args = models.make_mlp(batch=batch, width=32, depth=8)
    step = ROWS[system](model, args)
    return lambda: step(*args).backward()


def run(iters: int = 300, repeats: int = 9, batch: int = 8) -> list[dict]:
    calls, rows = {}, {}
    for system in ROWS:
        try:
            calls[system] = _call(system, batch)
        except Exception as e:  # a broken system is a row in the report, not a crash
            rows[system] = {"system": system, "error": f"{type(e).__name__}: {e}"[:120]}
    # Interleaved rounds, so drift in machine speed hits every system alike; the share of the
    # reference's overhead is the median of each round's own share (a loaded machine's speed drifts
    # within seconds: one round's systems ran close together).
    samples = {s: [] for s in calls}
    for call in calls.values():
        per_call_us(call, iters=1, repeats=1)       # warm-up
    for r in range(repeats):
        order = list(calls.items())
        for system, call in order[r % len(order):] + order[:r % len(order)]:
            samples[system].append(per_call_us(call, iters=iters, repeats=1, warmup=2))
    for system, xs in samples.items():
        rows[system] = {"system": system, "us": statistics.median(xs)}
    base = rows["eager"].get("us")
    for row in rows.values():
        if "us" in row and base:
            row["over_eager_us"] = row["us"] - base
            row["ratio"] = row["us"] / base
    if REFERENCE in samples:
        eager, ref = samples["eager"], samples[REFERENCE]
        for system, xs in samples.items():
            shares = [(x - e) / (r - e) for x, e, r in zip(xs, eager, ref) if r > e]
            if shares:
                rows[system]["of_reference"] = statistics.median(shares)
    return [rows[s] for s in ROWS]


def table(rows: list[dict]) -> str:
    lines = [f"| system | µs / fwd+bwd | overhead vs eager | overhead / {REFERENCE}'s |", "|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error']} | | |")
        else:
            share = f"{r['of_reference']:.3f}" if "of_reference" in r else ""
            lines.append(f"| {r['system']} | {r['us']:.1f} | "
                         f"{r['over_eager_us']:+.1f} µs ({r['ratio']:.2f}x) | {share} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--repeats", type=int, default=61)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads; one keeps tiny-kernel timings steady")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"MLP 8x32, batch {a.batch}, {torch.get_num_threads()} threads; "
          f"median of {a.repeats} x {a.iters} calls, interleaved")
    print(table(run(a.iters, a.repeats, a.batch)))


if __name__ == "__main__":
    main()
