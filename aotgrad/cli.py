"""``python -m aotgrad explain|report|export path/to/script.py:name`` and ``python -m aotgrad inspect step.aotgrad``.

The script runs as a module named ``__aotgrad_script__`` (its ``if __name__ ==
"__main__"`` block does not run); ``name`` is a ``Compiled``, an
``aotgrad.jit`` function that has been called, or a callable with no
arguments that returns one of those. For ``export``, ``name`` is a ``Captured``
or a callable with no arguments returning a ``Captured`` or a tuple
``(model_or_fn, example_args)`` / ``(model_or_fn, example_args, example_kwargs)``,
which is captured.
"""
from __future__ import annotations

import argparse
import inspect
import os
import runpy
import sys


def load(spec: str, resolver=None):
    """The object ``script.py:name`` names, called first when it is a plain callable."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path:
        raise SystemExit(f"aotgrad: expected path/to/script.py:name, got {spec!r}")
    if not os.path.exists(path):
        raise SystemExit(f"aotgrad: no such script {path!r}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    namespace = runpy.run_path(path, run_name="__aotgrad_script__")
    if name not in namespace:
        raise SystemExit(f"aotgrad: {path} defines no {name!r}")
    return (resolver or resolve)(namespace[name])


def resolve_capture(obj):
    """What ``export`` writes: a ``Captured``, or what a callable with no arguments returns, captured."""
    from .capture.capture import capture
    from .stages import Captured
    made = obj() if callable(obj) and not isinstance(obj, Captured) and _takes_no_arguments(obj) else obj
    if isinstance(made, Captured):
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0]) and isinstance(made[1], (tuple, list)):
        return capture(made[0], *made[1], **(made[2] if len(made) == 3 else {}))
    raise SystemExit(f"aotgrad: export needs a Captured, or a callable with no arguments returning a Captured or "
                     f"(model_or_fn, example_args[, example_kwargs]); got a {type(made).__name__}")


def resolve(obj):
    from .frontend.jit import Jit
    from .stages import Captured, Compiled
    if isinstance(obj, (Jit, Compiled, Captured)):
        return obj
    if callable(obj) and _takes_no_arguments(obj):
        made = obj()
        if isinstance(made, (Jit, Compiled, Captured)):
            return made
        raise SystemExit(f"aotgrad: calling it returned a {type(made).__name__}, "
                         "not a Compiled, Captured or aotgrad.jit function")
    raise SystemExit(f"aotgrad: a {type(obj).__name__} is not a Compiled, Captured, aotgrad.jit "
                     "function (called at least once) or a callable with no arguments returning one")


def _takes_no_arguments(fn) -> bool:
    import torch
    if isinstance(fn, torch.nn.Module):
        return False        # a module needs inputs; name a function that compiles it instead
    try:
        inspect.signature(fn).bind()
        return True
    except (TypeError, ValueError):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotgrad", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print stages, graph sizes, saved activations, guards, recompiles")
    ex.add_argument("target", help="path/to/script.py:name")
    rp = sub.add_parser("report", help="write one self-contained HTML page about the compile")
    rp.add_argument("target", help="path/to/script.py:name")
    rp.add_argument("-o", "--output", default="report.html", help="where to write it (default report.html)")
    xp = sub.add_parser("export", help="capture a training step and write it as an artifact aotgrad.load reads")
    xp.add_argument("target", help="path/to/script.py:name")
    xp.add_argument("-o", "--output", default="step.aotgrad", help="where to write it (default step.aotgrad)")
    xp.add_argument("--no-values", action="store_true", help="leave parameter and buffer values out")
    xp.add_argument("--partitioner", default="default", help="default or min_cut")
    ip = sub.add_parser("inspect", help="print an exported artifact's parameters and graphs with descriptors")
    ip.add_argument("artifact", help="path/to/step.aotgrad")
    args = parser.parse_args(argv)
    if args.command in ("export", "inspect"):
        return _export_commands(args)
    obj = load(args.target)
    if args.command == "explain":
        from .observe.explain import explain
        print(explain(obj))
    else:
        from .stages import Captured
        if isinstance(obj, Captured):
            raise SystemExit("aotgrad: report needs a compiled function; call .compile() on the Captured")
        from .observe.report import write_report
        write_report(obj, args.output)
        print(f"wrote {os.path.abspath(args.output)}")
    return 0


def _export_commands(args) -> int:
    from . import errors
    from .export.loader import load as load_artifact
    try:
        if args.command == "inspect":
            print(load_artifact(args.artifact, placeholders=True))     # values=False artifacts too
            return 0
        captured = load(args.target, resolve_capture)
        captured.export(args.output, values=not args.no_values, partitioner=args.partitioner)
    except errors.AotgradError as e:
        raise SystemExit(f"aotgrad: {e}") from None
    print(f"wrote {os.path.abspath(args.output)}")
    return 0
