"""PyTorch Lightning training with aotgrad: 5 steps log eager's losses.

The module compiles its network in place in ``configure_model`` (``self.net.compile(backend="aotgrad")``):
its parameter names, and so its checkpoints, stay those of the plain module. Lightning's other way,
``trainer.fit(torch.compile(module, ...))``, compiles ``training_step`` whole, and Dynamo itself
(torch 2.13, any backend) fails inside ``self.log`` ("'method' object has no attribute '__dict__'")."""
import pytest
import torch
import torch.nn.functional as F

from tests.models import zoo

zoo.import_torchvision()        # Lightning imports torchmetrics, which imports torchvision
pl = pytest.importorskip("pytorch_lightning")


class Net(torch.nn.Module):
    """A network class of the user's own: ``Module.compile`` on a bare ``torch.nn.Sequential`` compiles
    nothing (torch 2.13's Dynamo skips torch.nn's own ``_call_impl`` frame)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                          torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.hidden(x))


class Classifier(pl.LightningModule):
    """A small classifier with dropout on, trained with SGD; logs its loss every step."""

    def __init__(self, backend=None):
        super().__init__()
        self.backend = backend
        self.net = Net()

    def configure_model(self):
        if self.backend:
            self.net.compile(backend=self.backend)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class LoggedLosses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].item())


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 16, generator=g), torch.randint(0, 4, (40,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _train(backend, root):
    pl.seed_everything(0, verbose=False)
    module = Classifier(backend)
    logged = LoggedLosses()
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[logged],
                         default_root_dir=str(root))
    trainer.fit(module, _data())
    return logged.losses


def test_lightning_with_module_compile_aotgrad(tmp_path, monkeypatch):
    from aotgrad.frontend import dynamo
    graphs, compile_graph = [], dynamo.compile_graph
    monkeypatch.setattr(dynamo, "compile_graph", lambda gm, *a, **k: graphs.append(gm) or compile_graph(gm, *a, **k))
    torch._dynamo.reset()
    eager = _train(None, tmp_path / "eager")
    compiled = _train("aotgrad", tmp_path / "aotgrad")
    torch._dynamo.reset()
    assert graphs, "Lightning never ran the network through aotgrad"
    assert len(eager) == 5 and eager[0] != eager[-1]
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
