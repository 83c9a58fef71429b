"""Train a tiny GPT with aotgrad next to eager PyTorch and show they agree.

    python -m examples.demo

Captures the training step's forward and backward once, compiles it, then
runs a few AdamW steps on identical batches in both worlds, printing the
losses and the largest gradient difference per step. Exits with status 1 if
any step differs beyond float tolerance.
"""
from __future__ import annotations

import sys
import time

import torch

import aotgrad
from examples import models

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
    return eager, model, step, (t1 - t0, t2 - t1)


def _train_step(fn, opt, args, seed):
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks on both sides
    loss = fn(*args)
    loss.backward()
    return loss


def main() -> int:
    eager, model, step, (t_capture, t_compile) = _build()
    print(f"gpt_tiny: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"dropout {DROPOUT}, tied embedding/lm_head")
    print(f"capture {t_capture * 1e3:.0f} ms, compile {t_compile * 1e3:.0f} ms\n")
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"{'step':>4}  {'loss eager':>11}  {'loss aotgrad':>12}  {'max |grad diff|':>15}  {'ms eager':>8}  {'ms aotgrad':>10}")
    ok = True
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
        print(f"{i:>4}  {le.item():>11.6f}  {lc.item():>12.6f}  {diff:>15.2e}  "
              f"{(t1 - t0) * 1e3:>8.1f}  {(t2 - t1) * 1e3:>10.1f}{'' if match else '  MISMATCH'}")
        opt_e.step()
        opt_c.step()
    print("\nlosses and gradients match eager" if ok else "\nFAILED: aotgrad differs from eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
