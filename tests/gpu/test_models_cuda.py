"""Real models on CUDA: one HuggingFace text model (GPT-2) and one timm model (ResNet-18), tiny
configs, trained 3 SGD steps with dropout next to eager under every entry point of tests/models and
capture with Inductor. Skipped without CUDA; tests/models runs them on CPU."""
import pytest
import torch

from tests.eager_check import check_training, default_compile
from tests.models import zoo
from tests.models.entries import ENTRIES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA_ENTRIES = {**ENTRIES, "inductor": dict(compile=default_compile, fw_compiler="inductor")}
# cuDNN and cuBLAS pick kernels per call and Triton fuses: floats within these, gradients x10.
TOL = {"inductor": 1e-3}


def _on_cuda(make, batches):
    def made():
        model, args = make()
        return model.cuda(), tuple(a.cuda() for a in args)
    return made, lambda step: tuple(a.cuda() for a in batches(step))


@pytest.mark.parametrize("entry", sorted(CUDA_ENTRIES))
@pytest.mark.parametrize("model", ["gpt2", "resnet18"])
def test_trains_like_eager_on_cuda(model, entry):
    make, batches = _on_cuda(*zoo.MODELS[model])
    tol = TOL.get(entry, 1e-4)
    losses = check_training(make, steps=3, batches=batches, rtol=tol, atol=tol, **CUDA_ENTRIES[entry])
    assert len(losses) == 3 and losses[0][0] != losses[-1][0]     # the model did train
