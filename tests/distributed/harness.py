"""Run test cases in 2 gloo processes on 127.0.0.1: a free port, a bounded wait, processes killed on failure.

``run(cases, tmp_path)`` spawns the ranks once for a whole group of cases (process start and
``init_process_group`` cost more than most cases); each rank writes ``{case: result}`` as JSON.
A case is a name that ``tests.distributed.cases.run(name, rank, world)`` (or the runner given) turns into a JSON-able result; an exception
in one case is recorded as ``{"error": "Type: message"}`` and the next case runs.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, names, out_dir, runner):
    os.environ["AOTGRAD_CACHE"] = "0"
    import torch
    torch.set_num_threads(1)
    if runner is None:
        from .cases import run as runner
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    results = {}
    try:
        for name in names:
            try:
                results[name] = runner(name, rank, world)
            except Exception as e:     # recorded for the test to read; the other cases still run
                results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            dist.barrier()
    finally:
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".part", "w") as f:
            json.dump(results, f)
        os.replace(path + ".part", path)     # whole, or not there: what ``run`` reads after a crash
        dist.destroy_process_group()


def run(names, out_dir, timeout=600, world=WORLD, runner=None) -> list:
    """``[{case: result}]`` per rank, ``world`` processes, each case run by ``runner(name, rank, world)``
    (a module-level function: the spawned ranks import it; ``cases.run`` where None). Raises if a rank
    fails before both wrote their results, or the group outlives ``timeout`` seconds."""
    ctx = mp.start_processes(_worker, args=(world, free_port(), list(names), str(out_dir), runner), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed cases {names} did not finish in {timeout}s")
    except mp.ProcessExitedException as e:
        # A rank that died after both wrote every case's result died tearing down (seen once in many
        # runs: SIGABRT, "terminate called without an active exception", a C++ thread still joinable
        # at exit): the results stand, and the crash is reported as a warning, not as a case's failure.
        if not all((out_dir / f"rank{r}.json").exists() for r in range(world)):
            raise
        warnings.warn(f"a rank of {names} died after writing its results: {e}", RuntimeWarning)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
