"""{DDP, FSDP2} x {torch.compile(backend="aotgrad"), aotgrad.jit, eager + aotgrad.compiled_autograd,
aotgrad.capture (FSDP2 only; DDP refused)} on a 3-layer MLP in 2 gloo processes: 3 SGD steps next to eager DDP/FSDP2, each
rank on its own data, with the reduced gradients and the parameters compared every step
(``cases.py`` says what each variant exercises). A combination is either exact or refused with a
typed error before the first step. ``make test`` runs a fast slice; ``make test-distributed`` all.
"""
import inspect

import pytest
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import harness

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

ENTRIES = ("compile", "jit", "ca")
DDP = [f"ddp-{e}-{v}" for v in ("plain", "nosync", "unused", "static", "bn") for e in ENTRIES] + ["ddp-ca-mixed"]
FSDP = [f"fsdp-{e}-{v}" for v in ("plain", "bf16", "ckpt") for e in (*ENTRIES, "capture")] + [
    "fsdp-jit-single", "fsdp-capture-single"]
# A compiled forward with compiled autograd's backward (what compiled autograd suggests for checkpoint).
BOTH = ["ddp-jitca-plain", "ddp-jitca-nosync", "ddp-jitca-bn", "ddp-compileca-plain", "ddp-ca-buckets",
        "fsdp-jitca-plain", "fsdp-jitca-ckpt", "fsdp-compileca-plain"]
if dist.is_available() and "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel).parameters:
    BOTH.append("ddp-ca-bucketlist")       # per-bucket caps (torch 2.13 on): the reducer's buckets are DDP's

# Refused combinations, with a phrase of the refusal and why it cannot be exact.
REFUSED = {
    # A Captured is one graph: DDP's per-call reducer bookkeeping has no place in it (FSDP2's
    # all-gathers and reduce-scatters do: inputs/fsdp_graph.py).
    "ddp-capture-plain": "aotgrad.capture of a DistributedDataParallel",
    # checkpoint's recomputation would run the unit's eager forward against the compiled one's saved tensors.
    "fsdp-jit-ckptout": "checkpoint inside the unit",
    # An eager forward's checkpoint leaves saved-tensor hooks that compiled autograd does not capture
    # (aotgrad.compiled_autograd's own refusal); jit and torch.compile checkpoint inside the graph instead.
    "fsdp-ca-ckpt": "saved-tensor hooks",
    # DDP runs a communication hook on its C++ reducer's bucket objects, which a compiled backward cannot call.
    "ddp-ca-commhook": "communication hook",
    # The block switches the DDP modules alive when it starts; one built inside still has its C++ reducer.
    "ddp-cainside-plain": "create the model before entering the block",
}

FAST = ["ddp-jit-plain", "ddp-ca-plain", "fsdp-jit-plain", "ddp-capture-plain", "fsdp-capture-plain"]
SLOW = [c for c in DDP + FSDP + BOTH + list(REFUSED) if c not in FAST]


def _check(results, names):
    failures = []
    for name in names:
        for rank, per_rank in enumerate(results):
            got = per_rank.get(name)
            if name in REFUSED:
                ok = got and got.get("refused") and REFUSED[name] in got.get("message", "")
            else:
                ok = got and got.get("grads") == [True] * 3 and got.get("params") and got.get("compiled", 0) > 0 \
                    and got.get("buckets", True)
            if not ok:
                failures.append(f"{name} rank {rank}: {got}")
    assert not failures, "\n".join(failures)


def test_fast_slice(tmp_path):
    _check(harness.run(FAST, tmp_path, timeout=300), FAST)


@pytest.mark.slow
@pytest.mark.parametrize("group", ["ddp", "fsdp"])
def test_full_matrix(tmp_path, group):
    names = [c for c in SLOW if c.startswith(group)]
    _check(harness.run(names, tmp_path, timeout=1200), names)
