"""Child process of ``test_whole_step.py``: load a whole training step and train it, with no model
or step code importable (only ``aotgrad`` and torch).

    python train_step_exported.py job.pt result.pt

``job.pt`` holds the artifact's path, batches and seeds; ``result.pt`` gets the losses, the final
parameters and optimizer state, and the losses of the same steps run again from a ``state_dict()``
saved midway and loaded back with ``load_state_dict()``.
"""
import copy
import sys

import torch

import aotgrad


def main(job_path, out_path):
    job = torch.load(job_path, weights_only=True)
    step = aotgrad.load(job["path"])
    opt = step.optimizers["AdamW0"]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)    # drives the loaded optimizer
    losses, midway = [], None
    for i, (batch, seed) in enumerate(zip(job["batches"], job["seeds"])):
        if i == job["save_at"]:
            midway = copy.deepcopy((step.state_dict(), sched.state_dict()))     # (they share the live tensors)
        torch.manual_seed(int(seed))
        losses.append(step(*batch).detach())
        sched.step()
    final = {"losses": torch.stack(losses), "params": {n: p.detach().clone() for n, p in step.named_parameters()},
             "optimizer": step.state_dict()["optimizers"]["AdamW0"]}
    sd, sched_sd = midway
    step.load_state_dict(sd)
    sched.load_state_dict(sched_sd)
    again = []
    for batch, seed in list(zip(job["batches"], job["seeds"]))[job["save_at"]:]:
        torch.manual_seed(int(seed))
        again.append(step(*batch).detach())
        sched.step()
    final["again"] = torch.stack(again)
    final["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("examples", "tests"))
    torch.save(final, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
