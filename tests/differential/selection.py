"""The fast slice ``make test`` runs: a fixed, spread-out share of (program, entry) cases
(about a minute on two busy cores for the eager-backend entries; programs run in a child process
are left out).

Chosen by a stable hash so the slice covers every class and every entry point without a
hand-kept list, and never changes between runs (a case is in or out for good). Entries that
compile with Inductor (C++ per program on CPU: seconds each, a recompile per jit variant) and the
export entry (one loading process per run) take a smaller share, to keep their part of ``make test``
under two minutes; ``make test-differential`` runs every case.
"""
import zlib

FAST_PERCENT = 8
PERCENT_OF = {"inductor": 3, "jit_inductor": 1, "dynamo_inductor": 1, "export": 6}
# Families of a hundred twins (each mutation x aliasing x requires_grad x what follows) take a quarter share:
# their cases are alike, and make test's slice stays the size it was before them.
SHARE_OF_TAG = {"storage": 4, "input_flags": 4}


def is_fast(program: str, entry: str, device: str = "cpu") -> bool:
    """On CUDA the same slice runs (tests/gpu); make test's CPU run takes only the CPU cases."""
    from .programs import PROGRAMS
    if "isolate" in PROGRAMS[program].tags:
        return False
    share = max((SHARE_OF_TAG[t] for t in PROGRAMS[program].tags if t in SHARE_OF_TAG), default=1)
    return zlib.crc32(f"{program}/{entry}".encode()) % (100 * share) < PERCENT_OF.get(entry, FAST_PERCENT)
