"""All benchmarks, as one markdown report (``make bench``).

    python -m benchmarks.run [--quick] [--json bench-results/latest.json]

Timings are only as quiet as the machine: run nothing else heavy meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from benchmarks import compile_time, overhead


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    p.add_argument("--json", help="also write the raw numbers here")
    a = p.parse_args()
    t0 = time.perf_counter()
    print(f"# aotgrad benchmarks\n\ntorch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, 1 intra-op thread, load average {os.getloadavg()[0]:.1f} at start\n")

    # One intra-op thread throughout: on a small shared machine, OpenMP's
    # spinning threads turn any background load into wild timing swings.
    torch.set_num_threads(1)
    iters, repeats = (100, 3) if a.quick else (300, 9)
    rows_o = overhead.run(iters=iters, repeats=repeats)
    print(f"## Per-call overhead: MLP 8x32, batch 8, forward+backward\n\n"
          f"Median of {repeats} interleaved rounds x {iters} calls.\n")
    print(overhead.table(rows_o) + "\n")

    n = 1 if a.quick else 3
    rows_c = compile_time.run(repeats=n)
    print(f"## Capture + compile: gpt_small training step\n\n"
          f"Median of {n}. *make step* is aotgrad's capture + compile (PyTorch's traces lazily, "
          f"in the first step); *compile* = make step + first step - one steady step; "
          f"*cold* runs in a fresh interpreter, so imports count.\n")
    print(compile_time.table(rows_c) + "\n")
    print(f"total {time.perf_counter() - t0:.0f} s")

    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"overhead": rows_o, "compile_time": rows_c}, f, indent=1)


if __name__ == "__main__":
    main()
