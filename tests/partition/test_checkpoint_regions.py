"""torch.utils.checkpoint regions inside the user's model are honoured: the
joint graph recomputes them in the backward, and random ops in them replay the
forward's values."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from aotgrad.ir.ops import is_random
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


def _draws(gm):
    return sum(map(is_random, gm.graph.nodes))


def test_regions_recomputed_in_reverse_replay_their_own_masks():
    """Same-shaped regions: the backward recomputes region 2 before region 1; each must
    get its own forward mask (pairing by draw position, not by order or shape)."""
    f = lambda x, w1, w2: (checkpoint(block, checkpoint(block, x, w1, 0.5, use_reentrant=False), w1, 0.5,
                                      use_reentrant=False) @ w2).sum()
    for partitioner in ("default", "min_cut"):
        run = check(f, args(), partitioner=partitioner)
        assert _draws(run.compiled.forward_graph) == 2 and _draws(run.compiled.backward_graph) == 0


def test_recompute_without_preserved_rng_draws_in_the_backward():
    """preserve_rng_state=False: eager's recomputation draws a fresh mask when backward() runs,
    so the compiled backward draws it too, and the forward draws only its own."""
    f = lambda x, w1, w2: (checkpoint(block, x, w1, 0.3, use_reentrant=False, preserve_rng_state=False) @ w2).sum()
    for partitioner in ("default", "min_cut"):
        run = check(f, args(), partitioner=partitioner)
        assert _draws(run.compiled.forward_graph) == 1 and _draws(run.compiled.backward_graph) == 1
