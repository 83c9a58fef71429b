"""Run by test_warm_start in fresh processes: compile programs with ``aotgrad.jit`` and
``torch.compile(backend="aotgrad")`` next to eager (``tests.eager_check``) and print, per program
and entry point, what each disk-cache lookup found and which aotgrad stages ran.

    python -m tests.guards.warm_worker gpt_tiny,cnn [--program path/to/module.py]

``--program`` adds ``module.Net()`` called on ``module.INPUTS``: a file the test rewrites between
processes (a changed line, constant or default must miss).
"""
import importlib.util
import json
import sys

import torch

import aotgrad
from examples import models
from tests.eager_check import check

MODELS = {"gpt_tiny": models.make_gpt_tiny, "gpt_small": models.make_gpt_small, "gpt_sdpa": models.make_gpt_sdpa,
          "cnn": models.make_cnn, "mlp": models.make_mlp}
COMPILERS = {"jit": lambda fn, args, kwargs: aotgrad.jit(fn),
             "dynamo": lambda fn, args, kwargs: torch.compile(fn, backend="aotgrad")}


def _program(path):
    spec = importlib.util.spec_from_file_location("warm_program", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # as an import does: the stored entry's reads name its globals by module
    spec.loader.exec_module(module)
    return lambda: (module.Net(), module.INPUTS())


def run(make, compiler) -> dict:
    torch._dynamo.reset()
    model, args = make()
    with aotgrad.trace() as sink:
        compiled = check(model, args, compile=COMPILERS[compiler]).compiled
    done = [e for e in sink.events if e["ph"] == "X"]
    out = {"stages": sorted({e["name"] for e in done}),
           "hits": [e["args"].get("hit") for e in done if e["name"] == "cache lookup"]}
    if compiler == "jit":
        out["explain"] = compiled.explain()
    return out


def main(argv):
    makes = {name: MODELS[name] for name in argv[0].split(",") if name}
    if "--program" in argv:
        makes["program"] = _program(argv[argv.index("--program") + 1])
    print(json.dumps({name: {c: run(make, c) for c in COMPILERS} for name, make in makes.items()}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
