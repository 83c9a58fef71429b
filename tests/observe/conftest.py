import pytest
import torch
import torch.nn as nn

import aotgrad


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h).tanh().sum()


@pytest.fixture(scope="package", autouse=True)
def no_disk_cache():
    """Every compile here really runs its stages (and nothing is written to ~/.cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AOTGRAD_CACHE", "0")
        yield


@pytest.fixture(scope="package")
def mlp():
    torch.manual_seed(0)
    return MLP()


@pytest.fixture(scope="package")
def compiled(mlp):
    return aotgrad.capture(mlp, torch.randn(3, 4)).compile()


@pytest.fixture(scope="package")
def recompiled_jit(mlp):
    j = aotgrad.jit(mlp, dynamic=False)
    j(torch.randn(3, 4))
    j(torch.randn(5, 4))
    return j
