"""All benchmarks, as one markdown report (``make bench``).

    python -m benchmarks.run [--quick] [--gpt-small-inductor/--no-gpt-small-inductor] [--no-memory-inductor]
                             [--sections matrix,overhead,compile,memory,recompile,models]
                             [--real-models gpt2,resnet18 | all]
                             [--out bench-results] [--json bench-results/latest.json]

Writes ``<out>/bench.md`` (everything printed) and ``<out>/bench.png`` (the
systems × models chart). ``--quick`` is a smoke run: the matrix without the
Inductor rows, fewer rounds, and only the overhead section besides.

Timings are only as quiet as the machine: run nothing else heavy meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

# One intra-op thread throughout, children included: on a small shared
# machine, OpenMP's spinning threads turn any background load into wild
# timing swings. Set before torch is imported so it sticks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks import compile_time, matrix, memory, models, overhead, recompile  # noqa: E402

SECTIONS = ("matrix", "overhead", "compile", "memory", "recompile", "models")


class Report:
    """Prints as it goes and keeps the text for ``bench.md``."""

    def __init__(self):
        self.parts: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.parts.append(text)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("\n".join(self.parts) + "\n")


def progress(text: str) -> None:
    """Progress lines go to stderr, not into the report."""
    print(text, file=sys.stderr, flush=True)


def section_matrix(out: Report, a, results: dict) -> None:
    skip = set() if a.gpt_small_inductor else {("gpt_small", s) for s in matrix.INDUCTOR}
    if a.quick:
        skip |= {(m, s) for m in matrix.MODELS for s in matrix.INDUCTOR}
    rounds = 3 if a.quick else 9
    rows = matrix.run(list(matrix.MODELS), rounds=rounds, skip=skip, log=progress)
    results["matrix"] = rows
    out(f"## Systems × models: first call, steady step, peak memory\n\n"
        f"*first call* = make the step + first forward+backward, Inductor's and aotgrad's caches "
        f"off (a cold compile in a warm process). *steady step* = forward+backward, median of "
        f"{rounds} interleaved rounds; ×eager is its ratio to eager and *overhead* the difference. "
        f"*peak* = most bytes live at once in one forward+backward (gradients included), from the "
        f"CPU allocator's profiler events. Batches: GPT 4×block, MLP 8×32 (8 layers), CNN 8×1×16×16.\n")
    if skip:
        out(f"Left out: {', '.join(sorted(f'{m} / {s}' for m, s in skip))}"
            + (" (`--quick`)." if a.quick else " (`--no-gpt-small-inductor`).") + "\n")
    out(matrix.table(rows) + "\n")
    png = os.path.join(a.out, "bench.png")
    matrix.chart(rows, png)
    out(f"![systems × models]({os.path.basename(png)})\n")


def section_overhead(out: Report, a, results: dict) -> None:
    iters, repeats = (100, 3) if a.quick else (300, 9)
    rows = overhead.run(iters=iters, repeats=repeats)
    results["overhead"] = rows
    out(f"## Per-call overhead: MLP 8x32, batch 8, forward+backward\n\n"
        f"Median of {repeats} interleaved rounds x {iters} calls. *torch_aot* is PyTorch's "
        f"`aot_function` with no-op compilers, without Dynamo.\n")
    out(overhead.table(rows) + "\n")


def section_compile(out: Report, a, results: dict) -> None:
    n = 1 if a.quick else 3
    rows = compile_time.run(repeats=n)
    results["compile_time"] = rows
    out(f"## Capture + compile: gpt_small training step\n\n"
        f"Median of {n}. *make step* is aotgrad's capture + compile (PyTorch's traces lazily, "
        f"in the first step); *compile* = make step + first step - one steady step; "
        f"*cold* runs in a fresh interpreter, so imports count.\n")
    out(compile_time.table(rows) + "\n")


def section_memory(out: Report, a, results: dict) -> None:
    rows = [r for name in memory.MODELS for r in memory.rows_for(name)]
    results["memory"] = rows
    out("## Saved activations and peak per partitioner, predicted vs measured\n\n"
        "One step after a warm-up, counted by `aotgrad.partition.measure_peak` (every storage an "
        "ATen op creates, inputs and parameters excluded) and by saved-tensor hooks. "
        "Batches: MLP 64×256 (8 layers), gpt_small 4, CNN 32.\n")
    out(memory.table(rows) + "\n")
    if a.memory_inductor:
        rows = [r for name in matrix.MODELS for r in memory.inductor_rows(name)]
        results["memory_inductor"] = rows
        out("### Peak with Inductor: eager, torch.compile(), aotgrad's inductor backend per partitioner\n\n"
            "One warmed-up step, from the CPU allocator's profiler events (they see Inductor's own "
            "buffers); saved bytes from saved-tensor hooks. Models and batches of the matrix above.\n")
        out(memory.inductor_table(rows) + "\n")


def section_recompile(out: Report, a, results: dict) -> None:
    n = 1 if a.quick else 3
    samples = recompile.run(n)
    results["recompile"] = samples
    out(f"## Frontends: first call, disk cache, hit overhead, recompiles (GPT tiny)\n\n"
        f"Medians of {n} fresh process pairs (cold: empty aotgrad disk cache; warm: the first "
        f"one's cache). See `benchmarks/recompile.py` for each column.\n")
    out(recompile.table(samples) + "\n")


def section_models(out: Report, a, results: dict) -> None:
    names = models.parse_models(a.real_models)
    skip = {(n, "torch.compile inductor") for n in names} if a.quick else set()
    rounds = 3 if a.quick else 5
    rows = models.run(names, rounds=rounds, skip=skip, log=progress)
    results["models"] = rows
    out(f"## Real models: aotgrad's entry points vs eager, aot_eager and Inductor\n\n"
        f"Tiny random-init models of `tests/models/zoo.py`, dropout on. *first call* = make the step + "
        f"first forward+backward, caches off, Dynamo reset; ×aot_eager is its ratio to "
        f"`torch.compile(backend=\"aot_eager\")`'s. *steady step*: median of {rounds} interleaved rounds. "
        f"*peak*: most bytes live at once, from the CPU allocator's profiler events. See `benchmarks/models.py`.\n")
    if skip:
        out("Left out: the `torch.compile inductor` rows (`--quick`).\n")
    out(models.table(rows) + "\n")


RUNNERS = {"matrix": section_matrix, "overhead": section_overhead, "compile": section_compile,
           "memory": section_memory, "recompile": section_recompile, "models": section_models}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: no Inductor rows, fewer repeats")
    p.add_argument("--gpt-small-inductor", action=argparse.BooleanOptionalAction, default=True,
                   help="include GPT small's two Inductor rows (about two minutes of compiling)")
    p.add_argument("--memory-inductor", action=argparse.BooleanOptionalAction, default=True,
                   help="the memory section's Inductor peak table (compiles each matrix model 3 more times)")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--real-models", default=",".join(models.DEFAULT_MODELS),
                   help="the models section's models (tests/models/zoo.py names), or all")
    p.add_argument("--out", default="bench-results", help="folder for bench.md and bench.png")
    p.add_argument("--json", help="also write the raw numbers here")
    a = p.parse_args()
    sections = a.sections.split(",") if a.sections else (
        ["matrix", "overhead"] if a.quick else list(SECTIONS))
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    out, results = Report(), {}
    out(f"# aotgrad benchmarks\n\ntorch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cores, 1 intra-op thread, load average {os.getloadavg()[0]:.1f} at start"
        + (", `--quick`" if a.quick else "") + "\n")
    for name in sections:
        ts = time.perf_counter()
        progress(f"[bench] {name} ...")
        RUNNERS[name](out, a, results)
        progress(f"[bench] {name} done in {time.perf_counter() - ts:.0f} s")
    out(f"total {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.1f} at end")
    md = os.path.join(a.out, "bench.md")
    out.write(md)
    progress(f"[bench] wrote {md}" + (f" and {os.path.join(a.out, 'bench.png')}"
                                      if "matrix" in sections else ""))

    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
