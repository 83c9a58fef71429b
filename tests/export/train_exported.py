"""Child process of the export tests: load artifacts and train them, with no model code importable.

    python train_exported.py job.pt result.pt

``job.pt`` (``torch.load(weights_only=True)``) holds, per artifact, its path, batches and seeds;
``result.pt`` gets the losses, final parameters and buffers, the last gradients, and the
names of any model module that got imported.
"""
import importlib.util
import os
import sys

import torch

import aotgrad


def train(path, batches, seeds, lr):
    step = aotgrad.load(path)
    opt = torch.optim.SGD(step.parameters(), lr=lr, momentum=0.9)
    losses = []
    for batch, seed in zip(batches, seeds):
        torch.manual_seed(int(seed))
        loss = step(*batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in step.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": {n: p.detach() for n, p in step.named_parameters()},
            "buffers": dict(step.named_buffers()), "grads": grads, "rng": torch.get_rng_state(),
            "state_names": list(step.state_dict())}


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _ours(name: str) -> bool:
    """Whether ``name`` imports this repository's code (a package of that name installed on the
    machine, an unrelated ``examples`` say, is not the model code)."""
    spec = importlib.util.find_spec(name)
    places = [*(spec.submodule_search_locations or []), spec.origin or ""] if spec is not None else []
    return any(p and os.path.realpath(p).startswith(REPO + os.sep) for p in places)


def main(job_path, out_path):
    job = torch.load(job_path, weights_only=True)
    results = {name: train(**spec) for name, spec in job.items()}
    results["imported"] = [m for m in sys.modules if m in ("models", "examples.models") or m.startswith("tests")]
    results["importable"] = [m for m in ("examples", "models", "tests") if _ours(m)]
    results["aotgrad"] = os.path.realpath(os.path.dirname(aotgrad.__file__))
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
