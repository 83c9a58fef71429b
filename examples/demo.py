"""Train a tiny GPT with aotgrad next to eager PyTorch and show they agree.

    python -m examples.demo

Captures the training step's forward and backward once, compiles it, then
runs a few AdamW steps on identical batches in both worlds, printing the
losses and the largest gradient difference per step. Exits with status 1 if
any step differs beyond float tolerance. Then compares what each partitioner
saves for the backward, and writes ``aotgrad-out/trace.json`` (Chrome trace
events of every stage) and ``aotgrad-out/report.html`` (stages, graphs,
saved activations, a picture of the joint graph).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import aotgrad
from aotgrad.observe.report import write_report
from examples import models

OUT = "aotgrad-out"
STEPS = 5
BATCH = 4
DROPOUT = 0.1  # exercises in-graph RNG: the compiled step must draw eager's masks
LOSS_RTOL, GRAD_ATOL = 1e-5, 1e-4


def _batch(step):
    return models.gpt_batch(models.GPT_TINY, BATCH, seed=1000 + step)


def _max_grad_diff(eager, compiled):
    diffs = [(pe.grad - pc.grad).abs().max().item()
             for pe, pc in zip(eager.parameters(), compiled.parameters())]
    return max(diffs)


def _build():
    """Two identical models: one stays eager, one is captured and compiled."""
    eager, args = models.make_gpt_tiny(BATCH, dropout=DROPOUT)
    model, _ = models.make_gpt_tiny(BATCH, dropout=DROPOUT)
    t0 = time.perf_counter()
    captured = aotgrad.capture(model, *args)
    t1 = time.perf_counter()
    step = captured.compile(fw_compiler="eager")
    t2 = time.perf_counter()
    return eager, model, captured, step, (t1 - t0, t2 - t1)


def _partitioners(captured):
    """Saved-activation bytes and predicted peak for each way of partitioning the same joint graph."""
    print(f"\n{'partitioner':<18} {'saved KiB':>10} {'predicted peak KiB':>19} {'recompute MFLOP':>16}")
    for label, opts in (("default", {}), ("min_cut", {"partitioner": "min_cut"}),
                        ("budget 0.5", {"memory_budget": 0.5}), ("budget 0.25", {"memory_budget": 0.25})):
        try:
            mem = captured.compile(**opts).memory
        except aotgrad.errors.BudgetError as e:
            print(f"{label:<18} {str(e)[:60]}")
            continue
        print(f"{label:<18} {mem.saved_bytes / 1024:>10.1f} {mem.peak_bytes / 1024:>19.1f} "
              f"{mem.recompute_flops / 1e6:>16.2f}")


def _train_step(fn, opt, args, seed):
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks on both sides
    loss = fn(*args)
    loss.backward()
    return loss


def main() -> int:
    torch.set_num_threads(1)    # steadier step times on a small, shared machine
    os.makedirs(OUT, exist_ok=True)
    with aotgrad.trace(os.path.join(OUT, "trace.json")):
        ok, step, captured = _train()
    _partitioners(captured)
    write_report(step, os.path.join(OUT, "report.html"))
    print(f"\ntrace:  {OUT}/trace.json   (open in ui.perfetto.dev or chrome://tracing)")
    print(f"report: {OUT}/report.html")
    return 0 if ok else 1


def _train():
    eager, model, captured, step, (t_capture, t_compile) = _build()
    print(f"gpt_tiny: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"dropout {DROPOUT}, tied embedding/lm_head")
    print(f"capture {t_capture * 1e3:.0f} ms, compile {t_compile * 1e3:.0f} ms\n")
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"{'step':>4}  {'loss eager':>11}  {'loss aotgrad':>12}  {'max |grad diff|':>15}  {'ms eager':>8}  {'ms aotgrad':>10}")
    ok, times = True, []
    for i in range(STEPS):
        args = _batch(i)
        t0 = time.perf_counter()
        le = _train_step(eager, opt_e, args, seed=i)
        t1 = time.perf_counter()
        lc = _train_step(step, opt_c, args, seed=i)
        t2 = time.perf_counter()
        diff = _max_grad_diff(eager, model)
        match = torch.allclose(le, lc, rtol=LOSS_RTOL, atol=0) and diff <= GRAD_ATOL
        ok &= match
        times.append((t1 - t0, t2 - t1))
        print(f"{i:>4}  {le.item():>11.6f}  {lc.item():>12.6f}  {diff:>15.2e}  "
              f"{(t1 - t0) * 1e3:>8.1f}  {(t2 - t1) * 1e3:>10.1f}{'' if match else '  MISMATCH'}")
        opt_e.step()
        opt_c.step()
    ratio = statistics.median(c / e for e, c in times[1:])
    print(f"\nstep time aotgrad / eager (median, steps 1-{STEPS - 1}): {ratio:.2f}")
    print("losses and gradients match eager" if ok else "FAILED: aotgrad differs from eager")
    return ok, step, captured


if __name__ == "__main__":
    sys.exit(main())
