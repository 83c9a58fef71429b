"""The disk cache keys entries by what the trace read: a second process with a
changed helper function, helper constant, underscore attribute or hook does not
load the first process's graph; an unchanged one does."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cache_dir, helpers_dir, act="torch.relu", scale=2.0, attr=1.0, hook=False):
    (helpers_dir / "state_helpers.py").write_text(f"import torch\nSCALE = {scale!r}\nact = {act}\n")
    env = {**os.environ, "AOTGRAD_CACHE_DIR": str(cache_dir), "PYTHONPATH": f"{ROOT}{os.pathsep}{helpers_dir}",
           "SCALE_ATTR": str(attr), "HOOK": "1" if hook else "0", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.guards.state_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _misses_then_hits(cache_dir, helpers_dir, changes):
    assert _run(cache_dir, helpers_dir) == {"loaded": False, "match": True}
    for change in changes:
        assert _run(cache_dir, helpers_dir, **change) == {"loaded": False, "match": True}, change
    assert _run(cache_dir, helpers_dir) == {"loaded": True, "match": True}


def test_changed_helper_function_or_hook_is_a_miss_in_a_new_process(cache_dir, tmp_path):
    _misses_then_hits(cache_dir, tmp_path, [{"act": "torch.sigmoid"}, {"hook": True}])


@pytest.mark.slow
def test_changed_constants_are_misses_in_a_new_process(cache_dir, tmp_path):
    _misses_then_hits(cache_dir, tmp_path, [{"scale": 3.0}, {"scale": 2}, {"attr": 0.5}])
