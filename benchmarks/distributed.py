"""A small GPT under DistributedDataParallel (2 processes, gloo, CPU): step time per entry point, and
when each gradient bucket's all-reduce is issued relative to the end of the backward.

    python -m benchmarks.distributed [--steps 8] [--layers 4] [--width 256] [--bucket-mb 1]

Systems, all in the same two processes, one after the other on fresh, identically seeded models:
eager DDP; ``torch.compile`` with ``aot_eager`` and with ``aotgrad`` (Dynamo's DDPOptimizer splits the
graph at bucket boundaries); ``aotgrad.jit(ddp)``; eager forward + ``aotgrad.compiled_autograd``
backward (aotgrad's bucketed reducer). A step is forward, backward and an SGD step; the median of
``--steps`` timed steps after 2 warm-up steps, as a ratio to eager.

Overlap: a post-accumulate-grad hook on every parameter records when the last gradient of the
backward was ready ("end of backward"); each bucket's issue time is reported relative to it
(negative: issued while gradients were still being computed, so the all-reduce overlaps the rest
of the backward). Eager DDP's issue times come from a communication hook that does DDP's
default all-reduce (a separate 2-step run: that Python hook would slow the timed one);
compiled autograd's from its reducer's timeline. On this 2-core machine the
absolute times mean little; the ratios and the overlap shape are the point. Nothing here is
gloo- or CPU-specific except the backend and device chosen in ``_worker``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
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

SYSTEMS = ("eager", "compile_aot_eager", "compile_aotgrad", "jit", "compiled_autograd")


def _model(a):
    from examples import models
    cfg = models.GPTConfig(n_layer=a.layers, n_head=4, d_model=a.width, vocab=512, block_size=64)
    model, batch = models.make_gpt(cfg, batch=4, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    return ddp, batch


def _recording_allreduce(times):
    """DDP's default all-reduce as a communication hook that also records when it was issued."""
    def hook(state, bucket):
        times.append((bucket.index(), time.perf_counter()))
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    return hook


def _step_fn(system, ddp):
    import aotgrad
    if system.startswith("compile_"):
        return torch.compile(ddp, backend=system[len("compile_"):])
    if system == "jit":
        return aotgrad.jit(ddp)
    return ddp


def _backward(system):
    if system != "compiled_autograd":
        return lambda loss: loss.backward()
    import aotgrad

    def backward(loss):
        with aotgrad.compiled_autograd("eager"):
            loss.backward()
    return backward


def _run_system(system, a):
    steps = 2 if system == "eager_overlap" else a.steps
    torch._dynamo.reset()
    ddp, batch = _model(a)
    issued: list = []
    if system == "eager_overlap":      # timed separately: the recording hook is Python, DDP's default is not
        ddp.register_comm_hook(None, _recording_allreduce(issued))
        system = "eager"
    last_grad = [0.0]
    for p in ddp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: last_grad.__setitem__(0, time.perf_counter()))
    step, backward = _step_fn(system, ddp), _backward(system)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times, overlaps = [], []
    for i in range(2 + steps):
        dist.barrier()
        issued.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = step(*batch)
        backward(loss)
        opt.step()
        times.append(time.perf_counter() - t0)
        reducer = getattr(ddp, "_aotgrad_reducer", None)
        buckets = [(k, t) for k, t in reducer.timeline if k != "end"] if reducer is not None else issued
        overlaps.append([round((t - last_grad[0]) * 1e3, 2) for _, t in sorted(buckets, key=lambda kt: kt[1])])
    del ddp, step, opt
    gc.collect()
    return {"ms": statistics.median(times[2:]) * 1e3, "overlap_ms": overlaps[-1]}


def _ranked(rank, world, port, run, systems, a, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = {}
    try:
        for system in systems:
            try:
                results[system] = run(system, a)
            except Exception as e:      # one system failing still reports the others
                results[system] = {"error": f"{type(e).__name__}: {e}"[:300]}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def on_two_ranks(run, systems, a) -> dict:
    """``{system: run(system, a)}`` as rank 0 of two gloo processes (127.0.0.1) returned it: the systems
    one after the other with a barrier between, a system that raises reporting its error. ``run`` is a
    module-level function (the processes are spawned)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mp.start_processes(_ranked, args=(2, port, run, list(systems), a, out), nprocs=2, join=True,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def report(results: dict) -> str:
    base = results.get("eager", {}).get("ms")
    lines = ["| system | step ms | vs eager |", "|---|---|---|"]
    for system, r in results.items():
        if system != "eager_overlap":
            ratio = f"{r['ms'] / base:.2f}x" if base and "ms" in r else "-"
            lines.append(f"| {system} | " + (f"error: {r['error']} | |" if "error" in r else f"{r['ms']:.1f} | {ratio} |"))
    lines += ["", "Bucket all-reduces issued, ms relative to the backward's last gradient (negative: overlapped):"]
    for system, label in (("eager_overlap", "eager DDP (C++ reducer)"), ("compiled_autograd", "compiled autograd")):
        r = results.get(system, {})
        times = ", ".join(f"{v:+.1f}" for v in r.get("overlap_ms", [])) or r.get("error", "not run")
        lines.append(f"- {label}: {times}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    results = on_two_ranks(_run_system, a.systems.split(",") + ["eager_overlap"], a)
    print(report(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
