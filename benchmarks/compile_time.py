"""Time from nothing to a trained step: capture + compile of gpt_small.

Two views, medians over repeats:

* cold: a fresh ``python`` per measurement, so importing torch and the
  system's own modules counts, as it does for a user starting a job;
* warm: in this process after one warm-up, so only tracing and compiling
  count.

PyTorch's ``aot_function`` traces lazily on the first call, so for every
system the measured span is: make the step, run the first forward+backward.
The *compile* column subtracts a steady-state step (median of a few) from it.

    python -m benchmarks.compile_time
    python -m benchmarks.compile_time --depth     # the GPT depth table
    python -m benchmarks.compile_time --depth --sdpa --systems aotgrad,torch_aot
    python -m benchmarks.compile_time --depth --sdpa --cpu   # in CPU time: steadier on a loaded machine
    python -m benchmarks.compile_time --depth --llama     # the same for HF Llama
    python -m benchmarks.compile_time --depth --sdpa --stages   # and aotgrad's cost per layer by stage
    python -m benchmarks.compile_time --inductor          # Inductor: regional vs whole vs torch.compile

The depth table times capture + compile + first training step of the GPT
of ``examples.models`` (d=64) at 2, 6, 8 and 32 layers, in this process after a
warm-up, for aotgrad (repeated blocks traced once, and with ``reuse_blocks=False``),
PyTorch's ``aot_function`` and ``torch.compile(backend="aot_eager")``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

# No torch import at module level: a cold child must time it.
COMPARED = ("eager", "torch_aot", "aotgrad")
LIBRARY_IMPORTS = {
    "eager": "",
    "torch_aot": "import functorch.compile, torch._functorch.aot_autograd",
    "aotgrad": "import aotgrad",
}
STEADY_STEPS = 3
DEPTHS = (2, 6, 8, 32)
DEPTH_SYSTEMS = ("aotgrad", "aotgrad_flat", "torch_aot", "aot_eager")
DEPTH_NAMES = {"aotgrad": "aotgrad", "aotgrad_flat": "aotgrad, reuse_blocks=False",
               "torch_aot": "aot_function", "aot_eager": 'torch.compile(backend="aot_eager")'}


def _timed_step(system: str) -> dict:
    """Build gpt_small, make ``system``'s step, train a first step and then
    a few steady ones; seconds."""
    from benchmarks.common import SYSTEMS, train_once
    from examples import models

    t0 = time.perf_counter()
    model, args = models.make_gpt_small(batch=4)
    t1 = time.perf_counter()
    step = SYSTEMS[system](model, args)
    t2 = time.perf_counter()
    train_once(step, args)
    t3 = time.perf_counter()
    steady = statistics.median(_seconds(lambda: train_once(step, args)) for _ in range(STEADY_STEPS))
    return {"build": t1 - t0, "make": t2 - t1, "first": t3 - t2, "steady": steady,
            "compile": (t3 - t1) - steady}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(system: str) -> dict:
    """Run inside a fresh interpreter: time imports, then the step."""
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    exec(LIBRARY_IMPORTS[system])
    t2 = time.perf_counter()
    r = _timed_step(system)
    return {"import_torch": t1 - t0, "import_lib": t2 - t1, **r,
            "to_first_step": t2 - t0 + r["build"] + r["make"] + r["first"]}


def cold(system: str) -> dict:
    import torch

    # The child runs with this process's thread count, so cold and warm agree.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", system],
                         capture_output=True, text=True, check=False, env=env)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process": wall}


def warm(system: str) -> dict:
    return _timed_step(system)


def _median(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def run(repeats: int = 3) -> list[dict]:
    rows = []
    for system in COMPARED:
        row = {"system": system}
        try:
            row["cold"] = _median([cold(system) for _ in range(repeats)])
            warm(system)  # warm-up: first-use costs belong to the cold view
            row["warm"] = _median([warm(system) for _ in range(repeats)])
        except Exception as e:  # a broken system is a row in the report, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:160]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| system | cold: imports → first step done | cold: import lib | cold: compile "
             "| warm: make step | warm: first step | warm: compile | steady step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error']} | | | | | | |")
            continue
        c, w = r["cold"], r["warm"]
        lines.append(f"| {r['system']} | {c['to_first_step']:.2f} s | {c['import_lib']:.2f} s "
                     f"| {c['compile']:.2f} s | {w['make']:.2f} s | {w['first']:.2f} s "
                     f"| {w['compile']:.2f} s | {w['steady'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def _llama(n_layer: int, use_cache: bool = True):
    """HF Llama (d=64, grouped-query attention, rotary embeddings, random weights) with
    ``n_layer`` decoder layers, in its default config (the forward makes a KV cache, each layer
    updates it) or without a cache (``use_cache=False``)."""
    from tests.models import zoo
    return zoo._hf("LlamaConfig", "LlamaForCausalLM", ("input_ids", "labels"), zoo.batch_lm,
                   num_hidden_layers=n_layer, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=zoo.VOCAB, max_position_embeddings=16, use_cache=use_cache)


CLOCK = time.perf_counter     # --cpu: time.process_time (this process's CPU time: steadier on a shared machine)


def _depth_step(system: str, n_layer: int, sdpa: bool = False) -> float:
    """Seconds from a built GPT of ``n_layer`` blocks to its first training step done (``sdpa``:
    attention through ``F.scaled_dot_product_attention``, the benchmarks' GPT; ``"llama"``: HF
    Llama instead)."""
    from dataclasses import replace

    from benchmarks.common import SYSTEMS, train_once
    from examples import models

    if sdpa in ("llama", "llama_nocache"):
        model, args = _llama(n_layer, use_cache=sdpa == "llama")
    else:
        model, args = models.make_gpt(replace(models.GPT_SDPA if sdpa else models.GPT_TINY, n_layer=n_layer))
    gc.collect()        # the models before this one: their collection is not this measurement's
    t0, wall = CLOCK(), time.perf_counter()
    if system == "aot_eager":
        import torch

        torch._dynamo.reset()
        step = torch.compile(model, backend="aot_eager")
    elif system == "aotgrad_flat":
        import aotgrad

        step = aotgrad.capture(model, *args, reuse_blocks=False).compile(fw_compiler="eager")
    else:
        step = SYSTEMS[system](model, args)
    made = time.perf_counter()
    train_once(step, args)
    seconds = CLOCK() - t0
    if system == "aotgrad":
        done = time.perf_counter()
        stages = {st.name: st.seconds for st in step.history}
        STAGES.setdefault(n_layer, []).append({**stages, "first step": done - made,
                                               "the rest": made - wall - sum(stages.values()), "total": done - wall})
    return seconds


STAGES: dict = {}   # layers -> each aotgrad run's wall seconds per stage of its history, first step, rest, total


def stage_table(stages: dict) -> str:
    """aotgrad's wall seconds per stage (the compiled step's ``history``), as a fixed part and a cost
    per layer (the slope between the fewest and the most layers). ``the rest``: the capture and compile
    outside those stages (finding twins, resolving and building the Python-state guards, the call's
    prologue, the collector's first pass after the capture)."""
    lo, hi = min(stages), max(stages)
    med = {n: {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]} for n, runs in stages.items()}
    lines = ["| aotgrad stage | fixed | per layer |", "|---|---:|---:|"]
    for k in [k for k in med[hi] if k != "total"] + ["total"]:
        per = (med[hi].get(k, 0.0) - med[lo].get(k, 0.0)) / (hi - lo)
        lines.append(f"| {k} | {(med[lo].get(k, 0.0) - lo * per) * 1e3:.1f} ms | {per * 1e3:.2f} ms |")
    return "\n".join(lines)


def run_depths(repeats: int = 3, depths=DEPTHS, systems=DEPTH_SYSTEMS, sdpa: bool = False) -> dict:
    """``{system: {layers: median seconds}}``; each system warmed up once first, then the systems and
    depths interleaved in every repeat (a machine's load drifts: run one after the other, a slow minute
    would land on one system's column alone and skew the ratios)."""
    for system in systems:
        _depth_step(system, depths[0], sdpa)
    STAGES.clear()      # (the warm-up's)
    samples: dict = {s: {n: [] for n in depths} for s in systems}
    for _ in range(repeats):
        for n in depths:
            for system in systems:
                samples[system][n].append(_depth_step(system, n, sdpa))
    return {s: {n: statistics.median(v) for n, v in per.items()} for s, per in samples.items()}


def depth_table(times: dict) -> str:
    systems = list(times)
    depths = list(times[systems[0]])
    ratio = {"aotgrad", "torch_aot"} <= set(times)      # aot_function cannot trace HF Llama (item() in its mask)
    lines = ["| layers | " + " | ".join(DEPTH_NAMES.get(s, s) for s in systems)
             + " |" + " aotgrad / aot_function |" * ratio, "|---:|" + "---:|" * (len(systems) + ratio)]
    for n in depths:
        lines.append(f"| {n} | " + " | ".join(f"{times[s][n]:.2f} s" for s in systems) + " |"
                     + (f" {times['aotgrad'][n] / times['torch_aot'][n]:.2f}× |" if ratio else ""))
    lo, hi = depths[0], depths[-1]
    lines.append(f"| {hi} / {lo} layers | " + " | ".join(f"{times[s][hi] / times[s][lo]:.1f}×" for s in systems)
                 + " |" + " |" * ratio)
    return "\n".join(lines)


INDUCTOR_DEPTHS = (2, 6, 12)
INDUCTOR_SYSTEMS = ("aotgrad", "aotgrad_whole", "torch_compile", "eager")
INDUCTOR_NAMES = {"aotgrad": 'aotgrad fw_compiler="inductor" (each block compiled once)',
                  "aotgrad_whole": "aotgrad, whole graphs (no regions)", "torch_compile": "torch.compile()",
                  "eager": "eager"}


def inductor_child(system: str, n_layer: int) -> dict:
    """Seconds from a built SDPA GPT of ``n_layer`` blocks to its first training step done under
    Inductor (``first``), and a steady step after it (``steady``, median of 5), in a process of its
    own with an empty Inductor cache (the caller's job)."""
    from dataclasses import replace

    import torch

    from benchmarks.common import train_once
    from examples import models

    model, args = models.make_gpt(replace(models.GPT_SDPA, n_layer=n_layer))
    t0 = time.perf_counter()
    if system == "torch_compile":
        step = torch.compile(model)
    elif system == "eager":
        step = model
    else:
        import aotgrad
        from aotgrad.runtime import regions

        regions.ENABLED = system == "aotgrad"
        step = aotgrad.capture(model, *args).compile(fw_compiler="inductor")
    train_once(step, args)
    first = time.perf_counter() - t0
    return {"first": first, "steady": statistics.median(_seconds(lambda: train_once(step, args)) for _ in range(5))}


def run_inductor(repeats: int, threads: int, depths=INDUCTOR_DEPTHS, systems=INDUCTOR_SYSTEMS) -> dict:
    """``{system: {layers: {first, steady}}}`` (medians), each measurement a fresh process and cache."""
    import tempfile

    out: dict = {s: {} for s in systems}
    for n in depths:
        for system in systems:
            samples = []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
                    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--threads", str(threads),
                           "--inductor-child", system, str(n)]
                    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    samples.append(json.loads(res.stdout.strip().splitlines()[-1]))
            out[system][n] = {k: statistics.median(x[k] for x in samples) for k in ("first", "steady")}
    return out


def inductor_table(times: dict) -> str:
    systems = list(times)
    depths = list(times[systems[0]])
    head = " | ".join(f"{INDUCTOR_NAMES[s]}: first / steady" for s in systems)
    lines = [f"| layers | {head} | aotgrad / torch.compile: first, steady |", "|---:|" + "---:|" * (len(systems) + 1)]
    for n in depths:
        cells = " | ".join(f"{times[s][n]['first']:.1f} s / {times[s][n]['steady'] * 1e3:.1f} ms" for s in systems)
        a, t = times["aotgrad"][n], times["torch_compile"][n]
        lines.append(f"| {n} | {cells} | {a['first'] / t['first']:.2f}×, {a['steady'] / t['steady']:.2f}× |")
    lo, hi = depths[0], depths[-1]
    lines.append(f"| {hi} / {lo} layers, first step | "
                 + " | ".join(f"{times[s][hi]['first'] / times[s][lo]['first']:.1f}×" for s in systems) + " | |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads; one keeps timings steady on a shared machine")
    p.add_argument("--depth", action="store_true", help="the GPT depth table instead of cold/warm gpt_small")
    p.add_argument("--sdpa", action="store_true", help="the depth table's GPT with F.scaled_dot_product_attention")
    p.add_argument("--llama", action="store_true",
                   help="the depth table for HF Llama (default config: a KV cache each layer updates)")
    p.add_argument("--no-cache", action="store_true", help="with --llama: use_cache=False")
    p.add_argument("--systems", default=",".join(DEPTH_SYSTEMS), help="depth table: systems to time")
    p.add_argument("--cpu", action="store_true", help="depth table: this process's CPU time, not wall time")
    p.add_argument("--stages", action="store_true", help="depth table: also aotgrad's fixed and per-layer cost by stage")
    p.add_argument("--inductor", action="store_true",
                   help="first training step under Inductor at 2/6/12 layers (a fresh process and cache each)")
    p.add_argument("--child", choices=COMPARED, help=argparse.SUPPRESS)
    p.add_argument("--inductor-child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    import torch

    torch.set_num_threads(a.threads)
    if a.inductor_child:
        print(json.dumps(inductor_child(a.inductor_child[0], int(a.inductor_child[1]))))
        return
    if a.inductor:
        print(f"SDPA GPT (d=64) capture + compile + first step under Inductor, then a steady step, {a.threads} "
              f"thread(s), median of {a.repeats}, a fresh process and Inductor cache each")
        print(inductor_table(run_inductor(a.repeats, a.threads)))
        return
    if a.depth:
        global CLOCK
        CLOCK = time.process_time if a.cpu else CLOCK
        llama = "llama_nocache" if a.no_cache else "llama"
        model = f"HF Llama (d=64, use_cache={not a.no_cache})" if a.llama else f"GPT (d=64{', SDPA' if a.sdpa else ''})"
        print(f"{model} capture + compile + first step, {a.threads} thread(s), median of {a.repeats}"
              + (", CPU time" if a.cpu else ""))
        print(depth_table(run_depths(a.repeats, systems=tuple(a.systems.split(",")),
                                     sdpa=llama if a.llama else a.sdpa)))
        if a.stages and STAGES:
            print("\naotgrad by stage, wall time (median of each)")
            print(stage_table(STAGES))
        return
    print(f"gpt_small training step, {a.threads} thread(s), median of {a.repeats}")
    print(table(run(a.repeats)))


if __name__ == "__main__":
    main()
