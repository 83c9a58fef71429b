"""Training memory per partitioner: saved activations and peak, predicted
against measured, next to eager and PyTorch's own torch.compile partitions.

Measured numbers come from one training step (forward + backward) after a
warm-up step, with no caching allocator in the way:

* peak: ``aotgrad.partition.measure_peak`` counts every storage an ATen op
  creates from its creation to its release (inputs and parameters excluded);
* saved: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor a
  step saves for its backward; each storage counted once, inputs excluded.

PyTorch's own AOT autograd runs in the same process with no-op compilers
(what ``torch.compile(backend="aot_eager")`` does after Dynamo), once with its
default partitioner and once with its min-cut partitioner. It is called
through ``aot_function`` rather than through Dynamo because Dynamo falls back
to eager while a dispatch mode (our peak meter) is active.

    python -m benchmarks.memory [--models mlp,gpt,cnn]
    python -m benchmarks.memory --budgets [--models gpt2,mlp,cnn]

``--budgets``: per memory budget (fractions of the default's saved bytes; peaks in bytes, as
fractions of the unbudgeted min cut's predicted peak) the saved bytes and the predicted and
measured peak of aotgrad's min cut, each peak beside the unbudgeted one's.
    python -m benchmarks.memory --inductor [--models gpt_tiny,gpt_small,mlp,cnn]

``--inductor``: peak of one step (the CPU allocator's profiler events, which see Inductor's own
buffers) for eager, ``torch.compile()`` and aotgrad's inductor backend with each partitioner,
with the saved bytes of each (the models of ``benchmarks.matrix``).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

import aotgrad
from aotgrad.partition import estimate, measure_peak, min_cut
from examples import models

MODELS = {
    "mlp": lambda: models.make_mlp(batch=64, width=256, depth=8),
    "gpt": lambda: models.make_gpt_small(batch=4),
    "cnn": lambda: models.make_cnn(batch=32, dropout=0.25),
    "gpt2": lambda: models.make_gpt(replace(models.GPT_TINY, block_size=64), batch=4),   # issue #61's GPT
}
FRACTIONS = (1.0, 0.5, 0.25, 0.1, 0.0)
PEAK_SHARES = (0.9, 0.75, 0.6)      # peak budgets, as shares of the unbudgeted predicted peak
AOTGRAD = {"default": "default", "min_cut": "min_cut",
           **{f"budget {b}": min_cut(budget=b) for b in (1.0, 0.5, 0.25, 0.1)}}
TORCH = {"torch aot_eager (default partition)": "default_partition",
         "torch aot_eager min-cut": "min_cut_rematerialization_partition"}


def torch_aot(model: torch.nn.Module, partition_fn: str):
    """PyTorch's AOT autograd with no-op compilers and the named partitioner."""
    from functorch.compile import nop
    from torch._functorch import partitioners
    from torch._functorch.aot_autograd import aot_function

    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    state = [*model.parameters(), *model.buffers()]

    def flat_step(state, *args):
        return torch.func.functional_call(model, dict(zip(names, state)), args)

    compiled = aot_function(flat_step, fw_compiler=nop, bw_compiler=nop,
                            partition_fn=getattr(partitioners, partition_fn))
    return lambda *args: compiled(state, *args)


def _external(model, args) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *args]
            if isinstance(t, torch.Tensor)}


def measured_saved(step, external) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in external:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def _measure(model, args, step) -> tuple[int, int]:
    def once():
        torch.manual_seed(0)
        step(*args).backward()
        for p in model.parameters():
            p.grad = None
    once()                                   # warm-up: compile, first-call allocations
    return measured_saved(once, _external(model, args)), measure_peak(once)


def rows_for(name: str) -> list[dict]:
    model, args = MODELS[name]()
    rows = []
    saved, peak = _measure(model, args, model)
    rows.append(dict(model=name, system="eager", saved=saved, peak=peak))
    captured = aotgrad.capture(model, *args)
    for label, part in AOTGRAD.items():
        try:
            compiled = captured.compile(partitioner=part)
        except aotgrad.errors.BudgetError as e:
            rows.append(dict(model=name, system=f"aotgrad {label}", note=str(e)))
            continue
        est = estimate(compiled.partition)
        saved, peak = _measure(model, args, compiled)
        rows.append(dict(model=name, system=f"aotgrad {label}", predicted_saved=est.saved_bytes,
                         saved=saved, predicted_peak=est.peak_bytes, peak=peak,
                         recompute=est.recompute_flops))
    for label, partition_fn in TORCH.items():
        saved, peak = _measure(model, args, torch_aot(model, partition_fn))
        rows.append(dict(model=name, system=label, saved=saved, peak=peak))
    return rows


def budget_rows(name: str) -> list[dict]:
    """Saved bytes, predicted and measured peak of the min cut under each budget."""
    model, args = MODELS[name]()
    captured = aotgrad.capture(model, *args)
    rows, base = [], None
    for budget in (None, *FRACTIONS, *PEAK_SHARES):
        given = budget
        if budget in PEAK_SHARES and not isinstance(budget, int):
            given = int(budget * base["predicted_peak"])
        label = "none" if budget is None else f"{budget}" if budget in FRACTIONS else f"peak {_kb(given)} KiB"
        try:
            compiled = captured.compile(partitioner=min_cut(budget=given))
        except aotgrad.errors.BudgetError as e:
            rows.append(dict(model=name, budget=label, note=str(e).split(". ")[0]))
            continue
        est = estimate(compiled.partition)
        saved, peak = _measure(model, args, compiled)
        row = dict(model=name, budget=label, predicted_saved=est.saved_bytes, saved=saved,
                   predicted_peak=est.peak_bytes, peak=peak, recompute=est.recompute_flops)
        base = base or row
        row["within"] = row["predicted_peak"] <= base["predicted_peak"] and row["peak"] <= base["peak"]
        rows.append(row)
    return rows


def budget_table(rows: list[dict]) -> str:
    lines = ["| model | budget | saved KiB (pred / meas) | peak KiB (pred / meas) | pred/meas | "
             "≤ unbudgeted | recompute MFLOP |", "|---|---|---:|---:|---:|:-:|---:|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['model']} | {r['budget']} | {r['note']} |||||")
            continue
        lines.append(f"| {r['model']} | {r['budget']} | {_kb(r['predicted_saved'])} / {_kb(r['saved'])} | "
                     f"{_kb(r['predicted_peak'])} / {_kb(r['peak'])} | {r['predicted_peak'] / r['peak']:.3f} | "
                     f"{'yes' if r['within'] else 'NO'} | {r['recompute'] / 1e6:.2f} |")
    return "\n".join(lines)


# aotgrad's "auto" partitioner is the min cut for Inductor; the default partition is shown beside it.
INDUCTOR = {"eager": None, "torch.compile inductor": None, "aotgrad inductor": {},
            "aotgrad inductor, default partition": {"partitioner": "default"}}


def _inductor_step(system: str, model, args):
    if system == "eager":
        return model
    if system == "torch.compile inductor":
        return torch.compile(model)
    return aotgrad.capture(model, *args).compile(fw_compiler="inductor", **INDUCTOR[system])


def inductor_rows(name: str) -> list[dict]:
    """Peak and saved bytes of one warmed-up step per system, with ratios to eager's."""
    from benchmarks import matrix
    rows = []
    for system in INDUCTOR:
        model, args = matrix.MODELS[name]()
        step = _inductor_step(system, model, args)
        once = matrix._fwd_bwd(step, args)
        for _ in range(2):          # compile, then any first-use allocation
            once()
        saved = measured_saved(once, _external(model, args))
        rows.append(dict(model=name, system=system, saved=saved, peak=matrix.peak_bytes(model, once)))
    for r in rows:
        r["peak_ratio"] = r["peak"] / rows[0]["peak"]
    return rows


def inductor_table(rows: list[dict]) -> str:
    lines = ["| model | system | saved KiB | peak KiB | peak ×eager |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['system']} | {_kb(r['saved'])} | {_kb(r['peak'])} | {r['peak_ratio']:.2f} |"
              for r in rows]
    return "\n".join(lines)


def _kb(v) -> str:
    return "" if v is None else f"{v / 1024:,.1f}"


def table(rows: list[dict]) -> str:
    head = ("| model | system | saved KiB (pred) | saved KiB (meas) | peak KiB (pred) | "
            "peak KiB (meas) | pred/meas | recompute MFLOP |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['model']} | {r['system']} | {r['note']} ||||||")
            continue
        ratio = f"{r['predicted_peak'] / r['peak']:.3f}" if r.get("predicted_peak") and r["peak"] else ""
        flop = f"{r['recompute'] / 1e6:.2f}" if "recompute" in r else ""
        lines.append(f"| {r['model']} | {r['system']} | {_kb(r.get('predicted_saved'))} | {_kb(r['saved'])} | "
                     f"{_kb(r.get('predicted_peak'))} | {_kb(r['peak'])} | {ratio} | {flop} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None)
    ap.add_argument("--inductor", action="store_true", help="the Inductor peak table instead")
    ap.add_argument("--budgets", action="store_true", help="the memory-budget table instead")
    opts = ap.parse_args(argv)
    if opts.budgets:
        names = (opts.models or "gpt2,mlp,cnn").split(",")
        print(budget_table([r for name in names for r in budget_rows(name)]))
        return
    if opts.inductor:
        from benchmarks import matrix
        torch.set_num_threads(1)
        names = (opts.models or ",".join(matrix.MODELS)).split(",")
        print(inductor_table([r for name in names for r in inductor_rows(name)]))
        return
    opts.models = opts.models or ",".join(MODELS)
    rows = [r for name in opts.models.split(",") for r in rows_for(name)]
    print(table(rows))


if __name__ == "__main__":
    main()
