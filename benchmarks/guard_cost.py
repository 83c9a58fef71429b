"""Per-call guard time of a 24-layer GPT under ``aotgrad.jit``, next to Dynamo's.

Every call of a jitted function checks, before it runs a graph, the modes, the
Python state the trace read (module structure, hooks, attributes, globals:
:mod:`aotgrad.guards.state`) and the arguments (pytree, constants, tensor
metadata). This times those checks alone on a model with hundreds of modules,
and Dynamo's guard check for the same model compiled by ``torch.compile``: with its
defaults, and with the two skips its config documents as unsafe turned off (hooks
added after compiling; parameters taken as unchanged while their module's dict is).

    python -m benchmarks.guard_cost [--layers 24]
"""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import replace

import torch

from examples import models


def _per_call_us(fn, iters=2000, repeats=7, clock=time.perf_counter) -> float:
    """The median over ``repeats`` rounds of ``iters`` calls."""
    for _ in range(50):
        fn()
    best = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(iters):
            fn()
        best.append((clock() - t0) / iters * 1e6)
    return sorted(best)[len(best) // 2]


def _timed(fn) -> tuple:
    """``(wall µs, CPU µs)`` per call: the wall-clock median, and the fastest round of this thread's CPU
    time (on a machine other processes load, wall time includes their share of the cores)."""
    cpu = min(_per_call_us(fn, repeats=3, clock=time.thread_time) for _ in range(3))
    return _per_call_us(fn), cpu


def aotgrad_guards(model, args) -> dict:
    import aotgrad
    from aotgrad.runtime.modes import traced as _modes
    step = aotgrad.jit(model)
    step(*args)
    for _ in range(5):      # the C++ state check is built after a few calls
        step(*args)
    entry = step.entries[0]
    match, state = entry.match, entry.state

    def all_checks():
        assert entry.modes == _modes() and state.check() is None and match(args, {})[1] is None
    out = {"modes": _per_call_us(_modes), "state": _per_call_us(state.check),
           "arguments": _per_call_us(lambda: match(args, {})), "total": _timed(all_checks),
           "reads": len(state.reads), "inputs": len(entry.compiled.captured.guards.specs)}
    out["per call"] = state.per_call() if hasattr(state, "per_call") else {}
    return out


# Dynamo's defaults skip two kinds of checks, each documented as unsafe in torch/_dynamo/config.py:
# hooks added to or removed from a module after compiling, and parameters whose module dict is
# unchanged (taken as unchanged tensors). aotgrad checks both; "every check" turns them on.
_EVERY_CHECK = {"skip_nnmodule_hook_guards": False, "skip_tensor_guards_with_matching_dict_tags": False}


def dynamo_guards(model, args, every_check=False) -> dict | None:
    """Dynamo's guard check of the compiled ``forward`` frame, called on that frame's locals."""
    import torch._dynamo
    get_entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if get_entries is None:
        return None
    torch._dynamo.reset()
    flags = {k: v for k, v in _EVERY_CHECK.items() if hasattr(torch._dynamo.config, k)} if every_check else {}
    graphs = []
    with torch._dynamo.config.patch(**flags):
        torch.compile(model, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)(*args)
    entries = get_entries(type(model).forward.__code__)
    if len(graphs) != 1 or not entries:
        # No graph, or a graph break: the entry found may not guard the whole forward. (A 0.9 us
        # figure came up twice in one session, cause not found; not reproduced since.)
        return None
    manager = getattr(entries[0], "guard_manager", None)
    frame_locals = {"self": model, "idx": args[0], "targets": args[1]}
    if manager is None or not manager.check(frame_locals):
        return None
    return {"total": _timed(lambda: manager.check(frame_locals))}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--no-dynamo", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = replace(models.GPT_TINY, n_layer=a.layers, d_model=32, n_head=2, vocab=64, block_size=16)
    model, args = models.make_gpt(cfg, batch=2)
    n_modules = len(list(model.modules()))
    # Dynamo's twin, copied before aotgrad captures the model: a capture leaves per-thread views as the
    # module's parameter dicts, at which Dynamo stops (tests/core/test_threads.py, a known gap).
    twin = copy.deepcopy(model)
    ours = aotgrad_guards(model, args)
    print(f"GPT {a.layers} layers, {n_modules} modules, {sum(1 for _ in model.parameters())} parameters")
    print("| system | guard µs / call (wall) | CPU µs / call | checks / call | detail |\n|---|---:|---:|---:|---|")
    pc = ours["per call"]
    looked = (f"looked at per call: {pc['tags']} module dict tags, {pc['types']} module types, "
              f"{pc['lengths']} held parameter/buffer dicts' {'tags' if pc['in C'] else 'lengths'} and "
              f"{pc['empty']} held empty hook/parameter dicts{' (one C loop)' if pc['in C'] else ''}, "
              f"{pc['others']} other reads") if "tags" in pc else ""
    checks = pc.get("checks", ours["reads"]) + ours["inputs"] + 1
    print(f"| aotgrad.jit | {ours['total'][0]:.1f} | {ours['total'][1]:.1f} | {checks} | modes {ours['modes']:.1f}, "
          f"Python state {ours['state']:.1f} ({ours['reads']} reads guarded; {looked}), arguments "
          f"{ours['arguments']:.1f} ({ours['inputs']} tensors: metadata of each, one C++ call) |")
    if a.no_dynamo:
        return
    for every_check in (False, True):
        theirs = dynamo_guards(twin, args, every_check)
        what = "hook and dict-tag skips off" if every_check else "defaults"
        if theirs is None:
            print(f"| torch.compile (Dynamo, {what}) | n/a | | | no one graph of the forward, or no guard "
                  "manager exposed by this torch |")
        else:
            print(f"| torch.compile (Dynamo, {what}) | {theirs['total'][0]:.1f} | {theirs['total'][1]:.1f} | | "
                  "guard_manager.check on the forward frame |")

if __name__ == "__main__":
    main()
