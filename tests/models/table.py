"""The model x entry-point table: ``python -m tests.models.table [model ...]`` trains each model 3
steps next to eager under each entry point and prints pass / typed error / fail with the wall
time of the whole run (compile, first call and backward dominate it; steady steps take ms)."""
from __future__ import annotations

import json
import sys
import time

import aotgrad
from tests.eager_check import check_training
from tests.models import zoo
from tests.models.entries import ENTRIES


def run_case(model, entry):
    make, batches = zoo.MODELS[model]
    start = time.perf_counter()
    try:
        check_training(make, steps=3, batches=batches, **ENTRIES[entry])
        outcome = "pass"
    except aotgrad.errors.AotgradError as e:
        outcome = f"typed error {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    except AssertionError as e:
        outcome = f"FAIL mismatch: {str(e).splitlines()[0][:160]}"
    except Exception as e:          # an untyped failure is a defect: report it, keep going
        outcome = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return {"model": model, "entry": entry, "outcome": outcome, "seconds": round(time.perf_counter() - start, 1)}


def main(models):
    for model in models or zoo.MODELS:
        for entry in ENTRIES:
            print(json.dumps(run_case(model, entry)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
