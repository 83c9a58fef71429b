"""HuggingFace ``Trainer`` training with aotgrad: 5 steps log eager's losses.

The working way is ``model.compile(backend="aotgrad")`` before ``Trainer(model=model)``: the module
compiles itself in place, so it keeps its class and ``forward``'s argument names, and the Trainer
keeps the dataset columns the model takes. ``TrainingArguments(torch_compile_backend="aotgrad")``
cannot work: accelerate checks the name against its fixed ``DynamoBackend`` list before anything
is compiled. A ``torch.compile(model, ...)`` wrapper also trains, but its ``forward(*args, **kwargs)``
hides the argument names, so the Trainer must be told to keep every column."""
import pytest
import torch

from tests.models import zoo

transformers = pytest.importorskip("transformers")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        ids = zoo._tokens(i)[0]
        return {"input_ids": ids, "labels": ids.clone()}


def _compile_in_place(model):
    model.compile(backend="aotgrad")
    return model


def _wrap(model):
    return torch.compile(model, backend="aotgrad")


def _train(model, out, **extra):
    """The losses the Trainer logs over 5 steps of ``model`` (GPT-2, dropout on)."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=5, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0, seed=0,
        disable_tqdm=True, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.fixture
def graphs(monkeypatch):
    """Every graph Dynamo hands aotgrad: proof the Trainer ran the model through it."""
    from aotgrad.frontend import dynamo
    seen, compile_graph = [], dynamo.compile_graph
    monkeypatch.setattr(dynamo, "compile_graph", lambda gm, *a, **k: seen.append(gm) or compile_graph(gm, *a, **k))
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


def _check(compile_model, graphs, tmp_path, **extra):
    eager = _train(zoo.make_gpt2()[0].model, tmp_path / "eager", **extra)
    compiled = _train(compile_model(zoo.make_gpt2()[0].model), tmp_path / "aotgrad", **extra)
    assert graphs, "the Trainer never ran the model through aotgrad"
    assert len(eager) == 5 and eager[0] != eager[-1]
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)


def test_trainer_with_model_compile_aotgrad(graphs, tmp_path):
    _check(_compile_in_place, graphs, tmp_path)


@pytest.mark.slow
def test_trainer_with_torch_compile_wrapper(graphs, tmp_path):
    _check(_wrap, graphs, tmp_path, remove_unused_columns=False)


def test_trainer_torch_compile_backend_is_refused_by_accelerate(tmp_path):
    """Documents why the README does not offer ``torch_compile_backend="aotgrad"``: accelerate
    refuses any name outside its list. Should it ever accept it, this fails and the README changes."""
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="aotgrad",
                                              use_cpu=True, report_to=[])
        transformers.Trainer(model=zoo.make_gpt2()[0].model, args=args, train_dataset=Tokens())
