"""torch.utils.checkpoint regions inside the user's model are honoured: the
joint graph recomputes them in the backward, and random ops in them replay the
forward's values."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from aotgrad.analysis.ops import is_random
from tests.eager_check import check


def block(x, w, p=0.0):
    return F.dropout((x @ w).relu(), p).sin()


def args():
    return (torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True),
            torch.randn(16, 4, requires_grad=True))


def test_checkpoint_region_saves_less():
    plain = check(lambda x, w1, w2: (block(x, w1) @ w2).sum(), args())
    ckpt = check(lambda x, w1, w2: (checkpoint(block, x, w1, use_reentrant=False) @ w2).sum(), args())
    assert len(ckpt.compiled.saved) < len(plain.compiled.saved)


def test_dropout_inside_checkpoint_uses_forward_mask():
    f = lambda x, w1, w2: (checkpoint(block, x, w1, 0.3, use_reentrant=False) @ w2).sum()
    run = check(f, args())
    assert not any(is_random(n) for n in run.compiled.backward_graph.graph.nodes)
