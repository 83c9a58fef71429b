"""A small GPT under FSDP2 (``fully_shard`` on each block, then the root; 2 processes, gloo, CPU):
step time and peak memory of a whole training step (forward, backward, SGD) per entry point.

    python -m benchmarks.fsdp [--steps 8] [--layers 4] [--width 256]

Systems, in the same two processes on fresh, identically seeded models: eager FSDP2; ``torch.compile``
of the step with ``aotgrad`` (Dynamo splits at FSDP's hooks, which run eagerly); ``aotgrad.jit`` of
the step and the staged ``aotgrad.capture(step).compile()`` with each partitioner (one graph, FSDP's
all-gathers and reduce-scatters in it, ``aotgrad/inputs/fsdp_graph.py``). ``ms``: median of
``--steps`` timed steps after 2 warm-up steps. ``peak``: most bytes live at once during one step on
rank 0, from the CPU allocator's profiler events (``benchmarks.matrix.peak_bytes``). ``same``: the
parameters after the timed steps equal eager's bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .distributed import on_two_ranks  # noqa: E402

SYSTEMS = ("eager", "compile", "jit", "capture", "capture_min_cut")


def _model(a):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from examples import models
    cfg = models.GPTConfig(n_layer=a.layers, n_head=4, d_model=a.width, vocab=512, block_size=64)
    model, batch = models.make_gpt(cfg, batch=4, seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh), batch


_EAGER: dict = {}     # this process's eager parameters after its steps, for the others to compare with


def _run(system, a):
    os.environ["AOTGRAD_CACHE"] = "0"
    try:
        return _measure(system, a)
    finally:
        torch._dynamo.reset()


def _measure(system, a):
    import aotgrad

    from .matrix import peak_bytes
    model, batch = _model(a)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    if system == "compile":
        fn = torch.compile(step, backend="aotgrad")
    elif system == "jit":
        fn = aotgrad.jit(step)
    elif system.startswith("capture"):
        fn = aotgrad.capture(step, *batch).compile(partitioner="min_cut" if system.endswith("min_cut") else "default")
    else:
        fn = step
    times = []
    for i in range(a.steps + 2):
        t0 = time.perf_counter()
        fn(*batch)
        times.append(time.perf_counter() - t0)
    peak = peak_bytes(model, lambda: fn(*batch))
    params = [p.to_local().clone() for p in model.parameters()]
    if system == "eager":
        _EAGER["params"] = params
    same = all(map(torch.equal, params, _EAGER["params"])) if system != "eager" and "params" in _EAGER else None
    return {"ms": statistics.median(times[2:]) * 1e3, "peak": peak, "same": same}


def report(results: dict) -> str:
    base = results.get("eager", {})
    lines = ["| system | step ms | vs eager | peak KiB | vs eager | params = eager |", "|---|---|---|---|---|---|"]
    for system, r in results.items():
        if "error" in r or "ms" not in base:
            lines.append(f"| {system} | error: {r.get('error') or 'no eager run to compare with'} | | | | |")
            continue
        peak = r["peak"]
        lines.append(f"| {system} | {r['ms']:.1f} | {r['ms'] / base['ms']:.2f}x | "
                     + f"{peak / 1024:,.0f} | {peak / base['peak']:.2f}x"
                     + f" | {'-' if r['same'] is None else r['same']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    results = on_two_ranks(_run, a.systems.split(","), a)
    print(report(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
