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
import datetime
import json
import os
import socket
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

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


def _run(system, a):
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
    return {"ms": statistics.median(times[2:]) * 1e3, "peak": peak,
            "params": [p.to_local().clone() for p in model.parameters()]}


def _worker(rank, world, port, a, out):
    torch.set_num_threads(1)
    os.environ["AOTGRAD_CACHE"] = "0"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results, params = {}, {}
    try:
        for system in a.systems.split(","):
            try:
                r = _run(system, a)
                params[system] = r.pop("params")
                r["same"] = all(torch.equal(x, y) for x, y in zip(params[system], params.get("eager", [])))
                results[system] = r
            except Exception as e:      # one system failing still reports the others
                results[system] = {"error": f"{type(e).__name__}: {e}"[:300]}
            torch._dynamo.reset()
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def report(results: dict) -> str:
    base = results.get("eager", {})
    lines = ["| system | step ms | vs eager | peak KiB | vs eager | params = eager |", "|---|---|---|---|---|---|"]
    for system, r in results.items():
        if "error" in r or "error" in base:
            lines.append(f"| {system} | error: {r['error']} | | | | |")
            continue
        peak = r.get("peak")
        lines.append(f"| {system} | {r['ms']:.1f} | {r['ms'] / base['ms']:.2f}x | "
                     + f"{peak / 1024:,.0f} | {peak / base['peak']:.2f}x"
                     + f" | {r['same'] if system != 'eager' else '-'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mp.start_processes(_worker, args=(2, port, a, out), nprocs=2, join=True, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
    print(report(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
