"""Child process of the export tests: load artifacts and train them, with no model code importable.

    python train_exported.py job.pt result.pt [REPO]

``job.pt`` (``torch.load(weights_only=True)``) holds, per artifact, its path, batches and seeds;
``result.pt`` gets the losses, final parameters and buffers, the last gradients, and the
names of any model module of the repository ``REPO`` that got imported or is importable.
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


def _from(repo, module) -> bool:
    """Whether ``module`` is (in) this repository's checkout: a package of the same name installed
    elsewhere on the machine (an unrelated ``examples``) is not the model code."""
    if module is None or repo is None:
        return module is not None
    places = [getattr(module, "origin", None), *(getattr(module, "submodule_search_locations", None) or ()),
              getattr(module, "__file__", None), *(getattr(module, "__path__", None) or ())]
    return any(p and os.path.realpath(p).startswith(repo + os.sep) for p in places)


def main(job_path, out_path, repo=None):
    job = torch.load(job_path, weights_only=True)
    repo = repo and os.path.realpath(repo)
    results = {name: train(**spec) for name, spec in job.items()}
    results["imported"] = [m for m, mod in list(sys.modules.items())
                           if m.split(".")[0] in ("models", "examples", "tests") and _from(repo, mod)]
    results["importable"] = [m for m in ("examples", "models", "tests") if _from(repo, importlib.util.find_spec(m))]
    results["aotgrad"] = os.path.realpath(os.path.dirname(aotgrad.__file__))
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
