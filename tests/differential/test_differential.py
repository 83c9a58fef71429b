"""Every program x every entry point, compared with eager (see ``harness`` for the outcome rules).

The few known failures are listed in ``KNOWN`` with their cause, as strict xfails: fixing one
turns its case into an error until it is taken off the list. Nothing else may fail
(``python -m tests.differential.run --failures FILE`` lists the failing cases).
``make test`` runs the ``fast`` slice (``selection.is_fast``); ``make test-differential`` runs all.
"""
import pytest

from .harness import ENTRIES, PROGRAMS, cases, run_case
from .selection import is_fast

KNOWN = {
    ("index_add_scatter_", "jit"):
        "strides only: an output computed from an input written in place with non-contiguous strides is laid "
        "out by the functional op (functionalization reports those strides too); values are eager's",
    ("checkpoint_deterministic", "compiled_autograd"):
        "an eager forward's checkpoint under compiled autograd needs saved-tensor hooks, refused with a typed "
        "error; compiling the forward works",
    ("aotd_dispatch_input_metadata_mutation", "dynamo"):
        "Dynamo itself applies t_()/unsqueeze_() to the real inputs while it traces, before any backend runs: "
        "aotgrad's typed refusal of the TwoTensor input (a backend that only raises does the same) leaves "
        "them changed",
    ("checkpoint_selective_policy", "dynamo"):
        "Dynamo itself raises NotImplementedError for a lambda context_fn before any backend runs "
        "(torch.compile with aot_eager fails the same way)",
}

# A warm entry is its cold one served from the disk cache: the same programs fail the same way.
KNOWN.update({(p, f"{e}_warm"): why for (p, e), why in list(KNOWN.items()) if e in ("jit", "dynamo")})


def _param(program, entry):
    # The rest is "slow": make test (-m "not slow") leaves it to make test-differential.
    marks = [pytest.mark.fast] if is_fast(program, entry) else [pytest.mark.slow]
    if (program, entry) in KNOWN:
        marks.append(pytest.mark.xfail(reason=KNOWN[program, entry], strict=True))
    return pytest.param(program, entry, marks=marks, id=f"{program}-{entry}")


@pytest.mark.parametrize("program,entry", [_param(p, e) for p, e in cases()])
def test_matches_eager_or_refuses_cleanly(program, entry):
    result = run_case(PROGRAMS[program], ENTRIES[entry])
    if result.outcome == "skip":
        pytest.skip(result.detail)
    assert result.outcome != "fail", result.detail
