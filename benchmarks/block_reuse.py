"""How many block calls of real models a template stands for (``reused blocks``), how many of those
are calls of the template's halves (its joint partitioned once, ``partition/blocks.py``; the others
are copies of its nodes: a block whose draws replay or rewind the stream, or with no backward), and how many calls the repeated blocks make: HF GPT-2, Llama, BERT, T5 and timm ViT from ``tests.models.zoo``
(tiny configs, random weights), in training (dropout on) and in eval (dropout off).

    python -m benchmarks.block_reuse
"""
from __future__ import annotations

import torch

import aotgrad
from aotgrad.capture import block_groups
from tests.models import zoo

MODELS = ("gpt2", "llama", "bert", "t5", "vit_tiny")


def _counted(model, args):
    """``(reused blocks, outermost of them, called as halves, calls of outermost repeated blocks, groups)``
    of one capture: a block inside a repeated block is reused when the outer one runs flat."""
    calls = [0]
    members = block_groups.find_groups(model)
    hooks = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
             for m in model.modules() if id(m) in members and not members[id(m)].inner]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in hooks:
            h.remove()
    captured = aotgrad.capture(model, *args)
    info = next(s.info for s in captured.history if s.name == "trace joint")
    return (info["reused blocks"], info["reused whole blocks"], info.get("blocks called as halves", 0), calls[0],
            len({m.group for m in members.values() if not m.inner}))


def main():
    rows = []
    for name in MODELS:
        make, batch = zoo.MODELS[name]
        for mode in ("train", "eval", "train, use_cache=False"):
            model, _ = make()
            model.train(mode.startswith("train"))
            if "use_cache" in mode:
                if not getattr(getattr(model.model, "config", None), "use_cache", False):
                    continue
                # HF decoders make a KV cache even in training unless told not to; the layers update
                # it by layer_idx, which a template takes per call (capture/per_call.py).
                model.model.config.use_cache = False
            used, whole, halves, calls, groups = _counted(model, batch(0))
            rows.append((name, mode, groups, calls, whole, used, halves))
    print("| model | mode | groups of twins | calls of repeated blocks | of them reused whole | "
          "reused block calls (inner ones included) | called as halves |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
