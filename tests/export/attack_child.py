"""Run in a child process by tests/export/test_attacks.py: load each crafted artifact (and, with
``run``, call it and its backward) and print one JSON line per file: how it ended. A crash of this
process (an out-of-bounds write) is what the parent detects."""
import json
import sys

import torch

import aotgrad
from aotgrad.errors import ExportFormatError


def main(jobs_path: str) -> None:
    for job in json.load(open(jobs_path)):
        print(json.dumps({"label": job["label"], "outcome": "started"}), flush=True)
        try:
            step = aotgrad.load(job["path"])
            if job.get("run"):
                torch.manual_seed(0)
                step(*[torch.randn(s) for s in job["run"]]).sum().backward()
            outcome = "loaded"
        except ExportFormatError as e:
            outcome = f"refused: {str(e)[:300]}"
        except Exception as e:      # noqa: BLE001  (an untyped error is reported, not hidden)
            outcome = f"untyped {type(e).__name__}: {str(e)[:200]}"
        print(json.dumps({"label": job["label"], "outcome": outcome}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
