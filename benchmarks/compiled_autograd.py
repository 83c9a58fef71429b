"""Backward time with compiled autograd against eager autograd and PyTorch's
own compiled autograd, plus the fixed cost paid at the start of every
backward (the engine's cache lookup and the wrapper around the graph), and
the first backward of each (capture and compile).

Each (system, model) runs in its own process: PyTorch's compiled autograd
and ours both claim the engine's per-node hooks, once per process.

    python -m benchmarks.compiled_autograd
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

SYSTEMS = ("eager", "torch_ca", "aotgrad_eager", "aotgrad_inductor")
MODELS = ("tiny", "mlp", "gpt1", "cnn")


def _model(name):
    import torch
    from dataclasses import replace
    from examples import models
    if name == "tiny":       # almost no compute: the backward's fixed cost
        x = torch.randn(4, requires_grad=True)
        return lambda: (x * 2).sum()
    if name == "mlp":
        m, batch = models.make_mlp(batch=64, width=256, depth=8)
    elif name == "cnn":
        m, batch = models.make_cnn(batch=8)
        m.eval()            # running stats would change between steps; same graph either way
    else:
        m, batch = models.make_gpt(replace(models.GPT_TINY, n_layer=1, dropout=0.0), batch=4)
    return lambda: m(*batch)


def _median_ms(loss_fn, n):
    """(first backward: capture + compile, median of later ones), in ms."""
    loss = loss_fn()
    t = time.perf_counter()
    loss.backward()
    first = time.perf_counter() - t
    for _ in range(2):
        loss_fn().backward()
    times = []
    for _ in range(n):
        loss = loss_fn()
        t = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - t)
    return first * 1e3, sorted(times)[n // 2] * 1e3


def _child(system, model, n):
    import torch
    torch.set_num_threads(1)
    loss_fn = _model(model)
    if system == "eager":
        return _median_ms(loss_fn, n)
    if system == "torch_ca":
        from torch._dynamo import compiled_autograd as ca   # the comparison only, never under aotgrad/
        with ca._enable(lambda gm: gm):
            return _median_ms(loss_fn, n)
    import aotgrad
    with aotgrad.compiled_autograd(system.removeprefix("aotgrad_")):
        return _median_ms(loss_fn, n)


def run(n: int) -> dict:
    out = {}
    for model in MODELS:
        for system in SYSTEMS:
            cmd = [sys.executable, "-m", "benchmarks.compiled_autograd", "--child", system, model, "--n", str(n)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            lines = p.stdout.strip().splitlines()
            ok = p.returncode == 0 and lines
            out[(model, system)] = tuple(map(float, lines[-1].split())) if ok else None
    return out


def table(res, which: int) -> str:
    """``which``: 0 = first backward (capture + compile), 1 = median later backward."""
    rows = ["| model | " + " | ".join(SYSTEMS) + " |", "|---|" + "---:|" * len(SYSTEMS)]
    for model in MODELS:
        eager = res[(model, "eager")] and res[(model, "eager")][which]
        cells = []
        for s in SYSTEMS:
            v = res[(model, s)] and res[(model, s)][which]
            cells.append("error" if v is None else f"{v:.3f} ms" + (f" ({v / eager:.2f}x)" if eager and s != "eager" else ""))
        rows.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=2)
    p.add_argument("--n", type=int, default=30)
    a = p.parse_args()
    if a.child:
        print(*_child(*a.child, a.n))
        return
    res = run(a.n)
    print("median backward time, 1 thread (tiny = fixed cost per backward: cache lookup + wrapper)")
    print(table(res, 1))
    print("\nfirst backward (capture + compile for the compiled systems; torch_ca runs its graph uncompiled)")
    print(table(res, 0))


if __name__ == "__main__":
    main()
