"""aotgrad against PyTorch's own backends on a GPU, one run, ratios to eager (lower is faster).

* **launch-bound**: a 4-layer SDPA GPT (fp32, small), one training step (forward, backward, SGD
  update in place, grads set to None) per call; systems: eager, ``torch.compile`` with
  ``backend="cudagraphs"``, Inductor and ``mode="reduce-overhead"``, and aotgrad's ``cudagraphs`` and
  ``inductor`` compilers through ``torch.compile(backend=aotgrad.backend(...))``;
* **Llama shape**: an HF Llama with Llama-3.2-1B's layer shape (2048 wide, GQA 32/8 heads, 8192 MLP),
  ``--llama-layers`` layers, bf16, batch 2 x 2048: eager, ``torch.compile`` (Inductor), aotgrad's eager
  backend and aotgrad Inductor: step time, peak memory and first call.

    python -m benchmarks.gpu [--rounds 5] [--steps 5] [--llama-layers 4] [--skip launch,llama]

Medians of interleaved rounds; compile time is the first call's wall time; peak memory is over the first
three steps, less what the systems made before it still hold (their models and CUDA graph pools, kept
for the rounds). Needs CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import aotgrad
from aotgrad.backends import cudagraphs as cg
from examples.models import GPT, GPTConfig, gpt_batch

# aotgrad's cudagraphs compiler, kept to report how many inputs its last graph copies in per replay.
CUDAGRAPHS = cg.configure()
GPT_4 = GPTConfig(n_layer=4, n_head=4, d_model=256, vocab=512, block_size=128, sdpa=True)


def _sync():
    torch.cuda.synchronize()


def _sgd_step(loss_of, model, lr: float):
    """One training step: ``loss_of(*batch)``, backward, SGD update in place, gradients set to None."""
    params = list(model.parameters())

    def step(*batch):
        loss = loss_of(*batch)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-lr)
                p.grad = None
        return loss
    return step


def _systems(build, wraps: dict, loss_of, lr: float) -> dict:
    """name -> a maker of one training step over a fresh model whose forward ``wraps[name]`` wraps."""
    def maker(wrap):
        def make():
            model = build()
            return _sgd_step(loss_of(wrap(model)), model, lr)
        return make
    return {name: maker(wrap) for name, wrap in wraps.items()}


def _compiled(**kw):
    return lambda m: torch.compile(m, **kw)


def _gpt_systems():
    def build():
        torch.manual_seed(0)
        return GPT(GPT_4).cuda().train()
    return _systems(build, {"eager": lambda m: m,
                            "torch cudagraphs": _compiled(backend="cudagraphs"),
                            "torch inductor": _compiled(),
                            "torch reduce-overhead": _compiled(mode="reduce-overhead"),
                            "aotgrad cudagraphs": _compiled(backend=aotgrad.backend(fw_compiler=CUDAGRAPHS)),
                            "aotgrad inductor": _compiled(backend=aotgrad.backend(fw_compiler="inductor"))},
                    lambda fn: fn, 1e-3)


def _llama_systems(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=4096,
                      tie_word_embeddings=True, attn_implementation="sdpa")

    def build():
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()
    return _systems(build, {"eager": lambda m: m, "torch.compile": _compiled(),
                            "aotgrad eager": _compiled(backend="aotgrad"),
                            "aotgrad inductor": _compiled(backend=aotgrad.backend(fw_compiler="inductor"))},
                    lambda fn: lambda ids: fn(input_ids=ids, labels=ids).loss, 1e-4)


def measure(systems: dict, batch, rounds: int, steps: int, log) -> dict:
    made, rows = {}, {}
    for name, make in systems.items():
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()    # the systems made before this one, kept for the rounds
        try:
            step = make()
            _sync()
            t0 = time.perf_counter()
            step(*batch)
            _sync()
            first = time.perf_counter() - t0
            for _ in range(2):
                step(*batch)
            _sync()
        except Exception as e:       # a failure is a row of the table, not the end of the run
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"{name}: {rows[name]['error']}")
            continue
        made[name] = step
        rows[name] = {"first_s": first, "peak_mib": (torch.cuda.max_memory_allocated() - held) / 2**20, "ms": []}
        log(f"{name}: first call {first:.1f} s")
    for _ in range(rounds):
        for name, step in made.items():
            _sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(*batch)
            _sync()
            rows[name]["ms"].append((time.perf_counter() - t0) / steps * 1e3)
    for name in made:
        rows[name]["ms"] = statistics.median(rows[name]["ms"])
    return rows


def table(title: str, rows: dict) -> str:
    base = rows.get("eager", {}).get("ms")
    out = [f"\n### {title} ({torch.cuda.get_device_name()}, torch {torch.__version__})\n",
           "| system | step ms | x eager | peak MiB | first call s |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if "error" in r:
            out.append(f"| {name} | {r['error']} | | | |")
        else:
            ratio = f"{r['ms'] / base:.2f}" if base else ""
            out.append(f"| {name} | {r['ms']:.2f} | {ratio} | {r['peak_mib']:.0f} | {r['first_s']:.1f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--llama-layers", type=int, default=4)
    ap.add_argument("--skip", default="")
    a = ap.parse_args()
    skip = set(a.skip.split(","))

    def log(text):
        print(text, flush=True)
    if "launch" not in skip:
        batch = [t.cuda() for t in gpt_batch(GPT_4, batch=8)]
        print(table("4-layer SDPA GPT, fp32, SGD step", measure(_gpt_systems(), batch, a.rounds, a.steps, log)))
        last = CUDAGRAPHS.last_compiled and CUDAGRAPHS.last_compiled()
        if last is not None and hasattr(last, "recordings"):     # its backward: 1 (the tangent) when it settles
            print("aotgrad cudagraphs, inputs its backward copies in per replay:",
                  [r.copied for r in last.recordings.values() if r is not None])
    if "llama" not in skip:
        ids = torch.randint(0, 128256, (2, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        print(table(f"Llama-3.2-1B layer shape x {a.llama_layers} layers, bf16, batch 2 x 2048",
                    measure(_llama_systems(a.llama_layers), [ids], a.rounds, a.steps, log)), flush=True)


if __name__ == "__main__":
    main()
