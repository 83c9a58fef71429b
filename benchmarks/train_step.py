"""Step time of a whole training step (forward, backward, AdamW update, zero_grad), side by side:

* ``eager``: the model and ``torch.optim.AdamW`` as they are;
* ``torch.compile(model)``: the model compiled by ``torch.compile`` (Inductor), the optimizer eager;
* ``torch.compile(model) + opt.step``: ``opt.step`` compiled by ``torch.compile`` too;
* ``aotgrad model``: ``aotgrad.jit(model)`` (eager backend), the optimizer eager;
* ``aotgrad step``: ``aotgrad.jit(train_step)``, the whole step as one graph, eager backend;
* ``aotgrad step inductor``: the same with ``fw_compiler="inductor"``.

For the GPT of ``examples/`` and a 12-layer GPT, on CPU (and CUDA where there is one). Medians of
interleaved rounds, as ratios to eager (lower is faster); compile time is left out (warm-up steps).

    python -m benchmarks.train_step [--rounds 7] [--steps 5] [--device cpu|cuda]
    python -m benchmarks.train_step --memory      # peak memory of one step: eager vs the whole step

``--memory``: the peak of the storages one step's ATen ops create (``aotgrad.partition.measure_peak``;
parameters, optimizer state and the batch excluded) for eager and for the whole step captured
(``aotgrad.capture`` after one eager step, eager backend), with AdamW's for-loop and foreach code.
``torch.compile`` is not in this table: Dynamo runs eagerly under the meter's dispatch mode.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import aotgrad  # noqa: E402
from examples.models import GPT, GPT_TINY, GPTConfig, gpt_batch  # noqa: E402

GPT_12 = GPTConfig(n_layer=12, n_head=4, d_model=128, vocab=256, block_size=64)
MODELS = {"gpt_tiny (2 layers)": GPT_TINY, "gpt 12 layers": GPT_12}


def _build(cfg, device):
    torch.manual_seed(0)
    model = GPT(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, opt


def _step_of(forward, opt, compiled_step=None):
    def step(idx, targets):
        loss = forward(idx, targets)
        loss.backward()
        (compiled_step or opt.step)()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def systems(cfg, device):
    """name -> a step function over a fresh model (each its own copy: steps change the weights)."""
    def eager():
        model, opt = _build(cfg, device)
        return _step_of(model, opt)

    def compiled_model():
        model, opt = _build(cfg, device)
        return _step_of(torch.compile(model), opt)

    def compiled_both():
        model, opt = _build(cfg, device)
        return _step_of(torch.compile(model), opt, torch.compile(opt.step))

    def aotgrad_model():
        model, opt = _build(cfg, device)
        return _step_of(aotgrad.jit(model), opt)

    def aotgrad_step(**options):
        def make():
            model, opt = _build(cfg, device)
            return aotgrad.jit(_step_of(model, opt), **options)
        return make
    return {"eager": eager, "torch.compile(model)": compiled_model,
            "torch.compile(model) + opt.step": compiled_both, "aotgrad model": aotgrad_model,
            "aotgrad step": aotgrad_step(), "aotgrad step inductor": aotgrad_step(fw_compiler="inductor")}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(cfg, device, rounds: int, steps: int) -> dict:
    batch = [t.to(device) for t in gpt_batch(cfg, batch=4)]
    made = {}
    for name, make in systems(cfg, device).items():
        torch._dynamo.reset() if "torch.compile" in name else None
        step = make()
        for _ in range(3):      # compiles (and the optimizer's first step) happen here
            step(*batch)
        made[name] = step
    times: dict = {name: [] for name in made}
    for _ in range(rounds):
        for name, step in made.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(*batch)
            _sync(device)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory(cfg, foreach: bool) -> dict:
    """``{"eager": bytes, "aotgrad step": bytes}``: the peak of one step after two warm-up steps."""
    from aotgrad.partition import measure_peak
    batch = gpt_batch(cfg, batch=4)
    out = {}
    for name in ("eager", "aotgrad step"):
        torch.manual_seed(0)
        model = GPT(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
        step = _step_of(model, opt)
        step(*batch)
        if name != "eager":
            step = aotgrad.capture(step, *batch).compile()
        step(*batch)
        out[name] = measure_peak(lambda: step(*batch))
    out["parameters"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--memory", action="store_true", help="peak memory of one step instead of step time")
    args = ap.parse_args()
    if args.memory:
        print("| model | AdamW | parameters MB | eager peak MB | aotgrad step peak MB | × eager |")
        print("|---|---|---:|---:|---:|---:|")
        for model, cfg in MODELS.items():
            for foreach in (False, True):
                m = memory(cfg, foreach)
                print(f"| {model} | {'foreach' if foreach else 'for-loop'} | {m['parameters'] / 1e6:.2f} | "
                      f"{m['eager'] / 1e6:.2f} | {m['aotgrad step'] / 1e6:.2f} | {m['aotgrad step'] / m['eager']:.2f} |")
        return
    for model, cfg in MODELS.items():
        ms = measure(cfg, args.device, args.rounds, args.steps)
        print(f"\n### {model}, AdamW, {args.device} (torch {torch.__version__})\n")
        print("| system | ms / step | × eager |")
        print("|---|---:|---:|")
        for name, t in ms.items():
            print(f"| {name} | {t:.2f} | {t / ms['eager']:.2f} |")


if __name__ == "__main__":
    main()
