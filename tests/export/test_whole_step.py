"""A whole training step (forward, ``backward()``, ``clip_grad_norm_``, AdamW's update, ``zero_grad``)
exported to a file and trained in a fresh process that has only torch and aotgrad: losses,
parameters and the optimizer's state equal eager training from the same state, a scheduler drives
the loaded optimizer, and ``state_dict()`` / ``load_state_dict()`` resume it exactly. In-process:
what export refuses, and what a loaded step refuses."""
import copy
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import aotgrad
from aotgrad import errors
from examples import models

STEPS, SAVE_AT = 5, 2
CFG = replace(models.GPT_TINY, n_layer=1, dropout=0.1)


def _trainer(cfg=CFG):
    model, _ = models.make_gpt(cfg, batch=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    def train_step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return model, opt, train_step


def _batches():
    return [models.gpt_batch(CFG, batch=2, seed=10 + i) for i in range(STEPS)]


def _seeds():
    return [100 + i for i in range(STEPS)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The artifact (captured after one eager step), and eager's own training from that moment."""
    tmp = tmp_path_factory.mktemp("whole_step")
    model, opt, train_step = _trainer()
    train_step(*models.gpt_batch(CFG, batch=2, seed=1))      # the optimizer creates its state
    path = str(tmp / "train.aotgrad")
    aotgrad.capture(train_step, *_batches()[0]).export(path)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for batch, seed in zip(_batches(), _seeds()):
        torch.manual_seed(seed)
        losses.append(train_step(*batch).detach())
        sched.step()
    want = {"losses": torch.stack(losses), "params": {f"model.{n}": p for n, p in model.named_parameters()},
            "optimizer": opt.state_dict()}
    return tmp, path, want


@pytest.fixture(scope="module")
def trained(exported):
    tmp, path, _ = exported
    torch.save({"path": path, "batches": _batches(), "seeds": _seeds(), "save_at": SAVE_AT}, tmp / "job.pt")
    pkgs = tmp / "pkgs"     # the child sees this aotgrad and nothing else of the repository
    pkgs.mkdir()
    (pkgs / "aotgrad").symlink_to(os.path.dirname(aotgrad.__file__))
    script = os.path.join(os.path.dirname(__file__), "train_step_exported.py")
    run = subprocess.run([sys.executable, script, str(tmp / "job.pt"), str(tmp / "out.pt")], cwd=tmp,
                         env={**os.environ, "PYTHONPATH": str(pkgs)}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return torch.load(tmp / "out.pt", weights_only=True)


def test_exported_step_trains_like_eager_in_a_fresh_process(exported, trained):
    want = exported[2]
    assert torch.equal(trained["losses"], want["losses"]), (trained["losses"], want["losses"])
    assert trained["params"].keys() == want["params"].keys()
    for n, p in want["params"].items():
        assert torch.equal(trained["params"][n], p.detach()), n
    got, ref = trained["optimizer"], want["optimizer"]
    assert got["param_groups"] == ref["param_groups"]       # the scheduler's learning rates too
    for k, st in ref["state"].items():
        for key, v in st.items():
            assert torch.equal(got["state"][k][key], v), (k, key)
    assert trained["modules"] == []


def test_state_dict_round_trip_resumes_exactly(trained):
    assert torch.equal(trained["again"], trained["losses"][SAVE_AT:])


def test_eager_optimizer_state_loads_into_the_loaded_step(exported, tmp_path):
    """A checkpoint of eager training (``model.state_dict()``, ``opt.state_dict()``) resumes in the
    loaded step: its next steps equal eager's."""
    _, path, _ = exported
    model, opt, train_step = _trainer()
    for i in range(2):
        train_step(*models.gpt_batch(CFG, batch=2, seed=20 + i))
    step = aotgrad.load(path)
    assert set(step.state_dict()) == {"model", "optimizers"}     # named as the step names its module
    # (deep-copied: torch's optimizer load_state_dict keeps the very state tensors it is given)
    step.load_state_dict(copy.deepcopy({"model": model.state_dict(), "optimizers": {"AdamW0": opt.state_dict()}}))
    for batch, seed in zip(_batches()[:3], _seeds()):
        torch.manual_seed(seed)
        got = step(*batch)
        torch.manual_seed(seed)
        want = train_step(*batch)
        assert torch.equal(got, want)
    for (n, p), (m, q) in zip(model.named_parameters(), step.named_parameters()):
        assert f"model.{n}" == m and torch.equal(p, q), n


def test_loaded_step_refuses_a_changed_hyperparameter(exported):
    step = aotgrad.load(exported[1])
    step.optimizers["AdamW0"].param_groups[0]["weight_decay"] = 0.5
    before = [p.detach().clone() for p in step.parameters()]
    with pytest.raises(errors.InputMismatchError, match=r"hyperparameter changed .*\['weight_decay'\]"):
        step(*_batches()[0])
    assert all(torch.equal(a, b) for a, b in zip(before, step.parameters()))


def test_export_refuses_a_step_whose_state_changes_structure(tmp_path):
    """Captured before the optimizer's first step, the graph creates the state: a loaded step could
    not take it back as it gave it."""
    _, _, train_step = _trainer()
    captured = aotgrad.capture(train_step, *_batches()[0])
    with pytest.raises(errors.UnsupportedError, match="another structure than it takes"):
        captured.export(str(tmp_path / "s.aotgrad"))
    train_step(*_batches()[0])
    with pytest.raises(errors.UnsupportedError, match="values=True"):
        aotgrad.capture(train_step, *_batches()[0]).export(str(tmp_path / "s.aotgrad"), values=False)
    assert not (tmp_path / "s.aotgrad").exists()


def test_loaded_step_keeps_grad_and_output_rules(exported):
    """The loss the loaded step returns requires grad as eager's did and refuses a second backward."""
    step = aotgrad.load(exported[1])
    loss = step(*_batches()[0])
    assert loss.requires_grad
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert all(p.grad is None for p in step.parameters())       # zero_grad(set_to_none=True) ran inside
    assert copy.deepcopy(step.state_dict())["optimizers"]["AdamW0"]["state"]
