"""A set of strings iterates in an order the process's string hash seed decides (random per process
unless PYTHONHASHSEED is set): a graph that unrolled a loop over one holds this process's order. A
process with another seed compiles again (the set a read holds, the code building one: keyed by the
seed); a process with the same seed loads. What ``hash()`` or ``id()`` answered the code is this
process's alone: never stored. Each result is eager's, bit for bit."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("held_set", "literal_set", "built_set", "tuples_in_a_frozenset")


def _run(cache_dir, seed):
    env = {**os.environ, "AOTGRAD_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": str(seed),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.guards.seed_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROCESS_LOCAL = ("hashed", "addressed")    # ``hash()``, ``id()`` in the code: this process's answers


def test_a_loop_over_a_set_of_strings_is_loaded_only_under_the_same_hash_seed(cache_dir):
    """(Stale before: the second process loaded the first's order, hash and address.)"""
    everything = (*PROGRAMS, *PROCESS_LOCAL)
    assert _run(cache_dir, 1) == {p: [False, True] for p in everything}
    assert _run(cache_dir, 2) == {p: [False, True] for p in everything}
    assert _run(cache_dir, 1) == {**{p: [True, True] for p in PROGRAMS}, **{p: [False, True] for p in PROCESS_LOCAL}}
