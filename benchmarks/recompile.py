"""First-call, disk-cache, per-call and recompile times of the frontends.

For ``aotgrad.jit``, ``torch.compile(backend=aotgrad)`` and
``torch.compile(backend="aot_eager")`` on the 2-layer GPT (``GPT_TINY``):

* cold first call: a fresh process with an empty aotgrad disk cache; the span
  is wrapping the model plus its first forward+backward (imports excluded);
* warm first call: the same in a second process that finds the first one's
  disk cache (only ``aotgrad.jit`` reads it; the others start cold again);
* hit overhead: per-call time of a four-tensor ``a + b + c + d`` through the
  frontend minus calling it eagerly, and for ``jit`` also minus running its
  compiled entry directly (guards and dispatch alone);
* recompile: the first forward+backward after the batch size changes
  4 -> 8 -> 3 -> 4 (8 recompiles; 3 and 4 should reuse an entry), in the
  cold process, and 4 -> 8 again in the warm one (jit loads the dynamic entry).

Every number is the median over ``--repeats`` fresh process pairs.

``--warm-start`` times only the first forward+backward (and the part of it spent in aotgrad's
stages: the rest is Dynamo's tracing and the kernels' first run), cold then warm, of each model of
``--models`` (``examples.models``; ``gpt_sdpa`` is the 4-layer GPT with fused causal attention)
for ``aotgrad.jit`` and ``torch.compile(backend=aotgrad)`` (Dynamo still traces bytecode in the
warm process; aotgrad's capture, partition and graph compile are loaded).

    python -m benchmarks.recompile [--repeats 3]
    python -m benchmarks.recompile --warm-start [--models gpt_tiny,gpt_sdpa,gpt_small,cnn,mlp]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEMS = ("aotgrad.jit", "torch.compile(aotgrad)", "torch.compile(aot_eager)")
BATCHES = (8, 3, 4)


def _wrap(system: str, fn):
    import torch

    import aotgrad
    if system == "aotgrad.jit":
        return aotgrad.jit(fn)
    backend = aotgrad.backend() if system == "torch.compile(aotgrad)" else "aot_eager"
    return torch.compile(fn, backend=backend)


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _hit_overhead(system: str) -> dict:
    import torch

    from benchmarks.common import per_call_us
    xs = [torch.randn(4) for _ in range(4)]

    def add4(a, b, c, d):
        return a + b + c + d

    step = _wrap(system, add4)
    out = {"eager_us": per_call_us(lambda: add4(*xs), iters=2000, repeats=7),
           "call_us": per_call_us(lambda: step(*xs), iters=2000, repeats=7)}
    if system == "aotgrad.jit":
        entry = step.entries[0].compiled
        flat, _ = entry.path.match(tuple(xs), {})
        out["direct_us"] = per_call_us(lambda: entry.path.run(flat), iters=2000, repeats=7)
    return out


def child(system: str) -> dict:
    import torch

    import aotgrad  # noqa: F401 - imported before the clock starts, for every system
    from examples import models
    torch.manual_seed(0)
    cfg = models.GPT_TINY
    model, args = models.make_gpt(cfg, batch=4)
    step = None

    def first():
        nonlocal step
        step = _wrap(system, model)
        step(*args).backward()

    result = {"first_s": _seconds(first)}
    for b in BATCHES:
        batch = models.gpt_batch(cfg, batch=b)
        result[f"batch{b}_s"] = _seconds(lambda: step(*batch).backward())
    result["steady_ms"] = 1e3 * statistics.median(_seconds(lambda: step(*args).backward()) for _ in range(5))
    result.update(_hit_overhead(system))
    return result


def first_call(system: str, model: str) -> dict:
    """Seconds of wrapping ``model`` and its first forward+backward, and whether the disk cache served it."""
    import torch

    import aotgrad  # noqa: F401 - imported before the clock starts
    from examples import models
    module, args = getattr(models, f"make_{model}")()
    step = None

    def first():
        nonlocal step
        step = _wrap(system, module)
        step(*args).backward()
    with aotgrad.trace() as sink:
        seconds = _seconds(first)
    loaded = [e.loaded for e in step.entries] if system == "aotgrad.jit" else None
    return {"first_s": seconds, "aotgrad_s": _busy(sink.events), "loaded": loaded, "torch": torch.__version__}


def _busy(events) -> float:
    """Seconds inside aotgrad's stages (the union of their spans): the first call minus Dynamo's
    tracing and the first run of the kernels, which a warm start cannot skip."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X")
    total, end = 0.0, float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total / 1e6


def warm_start(models: list, repeats: int) -> list:
    rows = []
    for model in models:
        for system in SYSTEMS[:2]:
            cold, warm = [], []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory(prefix="aotgrad-bench-cache-") as d:
                    cold.append(_spawn(system, d, child=["--first", model]))
                    warm.append(_spawn(system, d, child=["--first", model]))
            rows.append((model, system, *(_median(runs, k) for runs in (cold, warm) for k in ("first_s", "aotgrad_s"))))
    return rows


def warm_table(rows: list) -> str:
    lines = ["| model | system | cold first call (s) | warm first call (s) | warm / cold | aotgrad stages cold (s) "
             "| aotgrad stages warm (s) | warm / cold |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m} | {s} | {c:.2f} | {w:.2f} | {w / c:.2f}× | {ca:.2f} | {wa:.3f} | {wa / ca:.3f}× |"
              for m, s, c, ca, w, wa in rows]
    return "\n".join(lines)


def _spawn(system: str, cache_dir: str, attempts: int = 2, child: list = ()) -> dict:
    env = {**os.environ, "AOTGRAD_CACHE_DIR": cache_dir, "AOTGRAD_CACHE": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    for attempt in range(attempts):    # a shared working tree may be mid-edit: retry once
        proc = subprocess.run([sys.executable, "-m", "benchmarks.recompile", "--child", system, *child],
                              capture_output=True, text=True, env=env, cwd=root, timeout=900)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        time.sleep(5)
    raise RuntimeError(f"{system} child failed:\n{proc.stderr[-3000:]}")


def run(repeats: int) -> dict:
    samples = {s: {"cold": [], "warm": []} for s in SYSTEMS}
    for _ in range(repeats):
        for system in SYSTEMS:
            with tempfile.TemporaryDirectory(prefix="aotgrad-bench-cache-") as d:
                samples[system]["cold"].append(_spawn(system, d))
                samples[system]["warm"].append(_spawn(system, d))
    return samples


def _median(rows: list, key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(samples: dict) -> str:
    head = ("| system | cold first call (s) | warm first call (s) | steady step (ms) | hit overhead vs eager (µs) "
            "| guards+dispatch vs entry (µs) | bs 4→8 (s) | 8→3 (s) | 3→4 (s) | bs 4→8, warm (s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for system, s in samples.items():
        cold, warm = s["cold"], s["warm"]
        both = cold + warm
        overhead = _median(both, "call_us") - _median(both, "eager_us")
        direct = (f"{_median(both, 'call_us') - _median(both, 'direct_us'):.1f}"
                  if "direct_us" in both[0] else "n/a")
        lines.append(f"| {system} | {_median(cold, 'first_s'):.2f} | {_median(warm, 'first_s'):.2f} "
                     f"| {_median(both, 'steady_ms'):.1f} | {overhead:.1f} | {direct} | "
                     + " | ".join(f"{_median(cold, f'batch{b}_s'):.2f}" for b in BATCHES)
                     + f" | {_median(warm, 'batch8_s'):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=SYSTEMS)
    p.add_argument("--json", help="also write the raw samples here")
    p.add_argument("--table", metavar="JSON", help="only print the table of samples written by --json")
    p.add_argument("--warm-start", action="store_true", help="cold and warm first call per model")
    p.add_argument("--models", default="gpt_tiny,gpt_sdpa,gpt_small,cnn,mlp")
    p.add_argument("--first", metavar="MODEL", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child and a.first:
        print(json.dumps(first_call(a.child, a.first)))
        return
    if a.warm_start:
        print(f"first forward+backward, medians of {a.repeats} process pairs")
        print(warm_table(warm_start(a.models.split(","), a.repeats)))
        return
    if a.child:
        print(json.dumps(child(a.child)))
        return
    if a.table:
        with open(a.table) as f:
            print(table(json.load(f)))
        return
    samples = run(a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)
    print(f"2-layer GPT (GPT_TINY), batch 4, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"medians of {a.repeats} process pairs")
    print(table(samples))


if __name__ == "__main__":
    main()
