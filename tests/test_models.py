"""Whole training programs, compiled vs eager: the end-to-end bar every
stage of the pipeline has to clear together."""
import torch

from examples import models
from tests.eager_check import check, check_training


def test_gpt_tiny_tied_weights_and_dropout():
    # Dropout draws random masks inside the graph; reseeding before each call
    # must give the compiled step the same masks as eager.
    model, args = models.make_gpt_tiny(batch=2, dropout=0.1)
    run = check(model, args, calls=3)
    # The tied weight's grad (compared by check under its first name) sums
    # both uses; the tie itself must survive compiling.
    assert run.fn.lm_head.weight is run.fn.tok_emb.weight


def test_cnn_batchnorm_running_stats_and_dropout():
    # Train-mode BatchNorm writes running_mean/var/num_batches_tracked in place;
    # three calls check that each call's update starts from the last one's.
    model, args = models.make_cnn(batch=4)
    check(model, args, calls=3)


def test_mlp():
    model, args = models.make_mlp()
    check(model, args, calls=3)


def _gpt_batches(step):
    return models.gpt_batch(models.GPT_TINY, batch=2, seed=100 + step)


def test_gpt_tiny_trains_like_eager_with_adamw():
    losses = check_training(lambda: models.make_gpt_tiny(batch=2, dropout=0.1), steps=3,
                            batches=_gpt_batches,
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert len(losses) == 3


def test_cnn_trains_like_eager_with_sgd():
    losses = check_training(lambda: models.make_cnn(batch=4), steps=3,
                            batches=lambda step: models.cnn_batch(batch=4, seed=100 + step),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert len(losses) == 3
