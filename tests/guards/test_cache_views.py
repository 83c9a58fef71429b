"""Views a stored entry regenerates: a loaded entry has no replay of the view ops, so it sizes each
returned view from the analysis alone. A size recorded over a symbol that a later guard settled
(``x.split(2)`` of 7 rows: the last view's ``s0 - 6`` before the guard pinned ``s0``) is stored
settled; one over a symbol no input guard binds keeps the entry in process. Each call of a second
``jit`` (a second process's, served from the disk cache) is compared with eager."""
import pytest
import torch

import aotgrad
from tests.eager_check import check

PROGRAMS = {
    "split": lambda x: x.split(2),
    "split_sizes": lambda x: x.split([1, x.shape[0] - 1]),
    "chunk": lambda x: x.chunk(3),
    "tensor_split": lambda x: x.tensor_split(3),
    "narrow": lambda x: x.narrow(0, 1, x.shape[0] - 2),
    "tail_slice": lambda x: x[x.shape[0] // 2:],
    "unbind_then_view": lambda x: [t.view(3, 1) for t in x.unbind(0)][-1],
    "unflatten": lambda x: x.flatten().unflatten(0, (x.shape[0], 3))[1:],
}
# Layouts in the order that settles a symbol after its view was recorded: a static first entry, a
# transposed call that makes the next capture dynamic, then row counts that split unevenly.
CALLS = [(4, False), (4, True), (6, False), (7, False), (9, False)]


def _input(n, transposed):
    x = torch.randn(3, n).t() if transposed else torch.randn(n, 3)
    return x.detach().requires_grad_()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_loaded_entry_sizes_its_views_as_eager(name):
    fn, hits = PROGRAMS[name], []
    for _ in range(2):      # the second jit loads what the first stored
        jitted = aotgrad.jit(fn)
        with aotgrad.trace() as sink:
            for n, transposed in CALLS:
                check(fn, (_input(n, transposed),), compile=lambda f, a, k: jitted)
        hits.append([e["args"].get("hit") for e in sink.events if e["ph"] == "X" and e["name"] == "cache lookup"])
    assert not any(hits[0]) and any(hits[1]), hits     # the second served from the disk
