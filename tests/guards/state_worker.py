"""Run by test_cache_state in fresh processes: jit a module that reads an imported
helper module, an underscore attribute and (optionally) a forward hook; print
whether the entry came from the disk cache and whether it matched eager."""
import json
import os
import sys

import torch
import torch.nn as nn

import aotgrad
import state_helpers        # written by the test into a directory on PYTHONPATH


class Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._scale = scale

    def forward(self, x):
        return state_helpers.act(self.lin(x)) * state_helpers.SCALE * self._scale


def main():
    torch.manual_seed(0)
    model = Scaled(float(os.environ["SCALE_ATTR"]))
    if os.environ.get("HOOK") == "1":
        model.lin.register_forward_hook(lambda m, i, o: o + 1)
    x = torch.randn(3, 4)
    out = aotgrad.jit(model)
    got = out(x)
    entry = out.entries[0]
    print(json.dumps({"loaded": entry.loaded, "match": bool(torch.allclose(got, model(x)))}))


if __name__ == "__main__":
    sys.exit(main())
