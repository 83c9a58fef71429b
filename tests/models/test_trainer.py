"""HuggingFace ``Trainer`` with a model compiled by ``torch.compile(model, backend="aotgrad")``:
5 steps log eager's losses. The compiled wrapper's ``forward(*args, **kwargs)`` hides the model's
argument names, so the Trainer must not drop "unused" columns (``remove_unused_columns=False``)."""
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


def _train(compile_model, tmp_path):
    model = zoo.make_gpt2()[0].model
    if compile_model:
        torch._dynamo.reset()
        model = torch.compile(model, backend="aotgrad")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("aotgrad" if compile_model else "eager")), max_steps=5,
        per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", dataloader_num_workers=0, remove_unused_columns=False, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.slow
def test_trainer_with_torch_compile_aotgrad(tmp_path, monkeypatch):
    from aotgrad.frontend import dynamo
    graphs = []
    compile_graph = dynamo.compile_graph
    monkeypatch.setattr(dynamo, "compile_graph", lambda gm, *a, **k: graphs.append(gm) or compile_graph(gm, *a, **k))
    eager = _train(False, tmp_path)
    compiled = _train(True, tmp_path)
    assert graphs, "the Trainer never ran the model through aotgrad"
    assert len(eager) == 5 and eager[0] != eager[-1]
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
