"""Export a training step here, load and train it in another process next to eager.

One child process (``train_exported.py``) loads both artifacts — a GPT with dropout and tied
embedding/head weights, a CNN with BatchNorm and dropout — and trains each 5 SGD steps; this
process trains fresh eager copies with the same batches and seeds and compares losses,
parameters, buffers (running statistics), the last gradients and the RNG state.
"""
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import aotgrad
from examples import models

STEPS = 5
LR = 0.05


def _gpt():
    return models.make_gpt(replace(models.GPT_TINY, n_layer=1, dropout=0.1), batch=2)


def _gpt_batches():
    cfg = replace(models.GPT_TINY, n_layer=1)
    return [models.gpt_batch(cfg, batch=2, seed=10 + i) for i in range(STEPS)]


def _cnn():
    return models.make_cnn(batch=4)


def _cnn_batches():
    return [models.cnn_batch(batch=4, seed=10 + i) for i in range(STEPS)]


CASES = {"gpt": (_gpt, _gpt_batches), "cnn": (_cnn, _cnn_batches)}


def _eager(make, batches):
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for i, batch in enumerate(batches):
        torch.manual_seed(100 + i)
        loss = model(*batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": dict(model.named_parameters()),
            "buffers": dict(model.named_buffers()), "grads": grads, "rng": torch.get_rng_state(),
            "state_names": list(model.state_dict())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    job = {}
    for name, (make, batches) in CASES.items():
        model, args = make()
        path = str(tmp / f"{name}.aotgrad")
        aotgrad.capture(model, *args).export(path)
        job[name] = {"path": path, "batches": batches(), "seeds": [100 + i for i in range(STEPS)], "lr": LR}
    torch.save(job, tmp / "job.pt")
    # The child sees this aotgrad (through a link) and nothing else of this repository: the model
    # code in examples/ is not importable there.
    pkgs = tmp / "pkgs"
    pkgs.mkdir()
    (pkgs / "aotgrad").symlink_to(os.path.dirname(aotgrad.__file__))
    env = {**os.environ, "PYTHONPATH": str(pkgs)}
    script = os.path.join(os.path.dirname(__file__), "train_exported.py")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, script, str(tmp / "job.pt"), str(tmp / "out.pt"), repo], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return torch.load(tmp / "out.pt", weights_only=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_loaded_step_trains_like_eager(trained, name):
    make, batches = CASES[name]
    got, want = trained[name], _eager(make, batches())
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-5)
    assert got["params"].keys() == want["params"].keys()       # tied weights: one parameter, as eager
    for kind in ("params", "buffers", "grads"):
        for n, t in want[kind].items():
            torch.testing.assert_close(got[kind][n], t.detach(), rtol=1e-4, atol=1e-5, msg=f"{kind} {n}")
    assert torch.equal(got["rng"], want["rng"])                # dropout drew from the global generator
    assert sorted(got["state_names"]) == sorted(want["state_names"])   # lm_head.weight listed, as in eager


def test_no_model_code_imported(trained):
    assert trained["imported"] == [] and not trained["importable"]
    assert trained["aotgrad"] == os.path.realpath(os.path.dirname(aotgrad.__file__))


def test_gpt_keeps_tied_weights(trained):
    params = trained["gpt"]["params"]
    assert "tok_emb.weight" in params and "lm_head.weight" not in params
