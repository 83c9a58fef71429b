"""CLI: sweep PyTorch's test databases through aotgrad (or, with
``--reference``, through torch's own aot_function) and report.

    python -m tests.conformance.run_opinfo [--all | --sample N] [--ops a,b]
        [--db opinfo,autograd_function,modules] [--json out.json] [--reference]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from tests.conformance import sweep
from tests.conformance.isolate import Worker


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tests.conformance.run_opinfo", description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every entry of each database")
    which.add_argument("--sample", type=int, default=40, help="N entries spread over each database (default 40)")
    p.add_argument("--ops", help="comma-separated entry names (a name selects its variants)")
    p.add_argument("--db", default="all", help="all, or a comma list of: " + ", ".join(sweep.DATABASES))
    p.add_argument("--max-samples", type=int, help="at most K samples per entry, spread over its samples")
    p.add_argument("--json", help="write per-entry, per-sample results here")
    p.add_argument("--reference", action="store_true", help="use torch's aot_function instead of aotgrad")
    p.add_argument("--dynamic", action="store_true", help="capture with dynamic=True")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per sample (default 60)")
    p.add_argument("--in-process", action="store_true",
                   help="run samples in this process (a hard crash then ends the sweep)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-entry progress lines")
    args = p.parse_args(argv)
    args.dbs = sweep.DATABASES if args.db == "all" else tuple(args.db.split(","))
    for db in args.dbs:
        if db not in sweep.DATABASES:
            p.error(f"unknown database {db!r}")
    return args


def _progress(i, n, key, res):
    counts = {}
    for s in res["samples"]:
        counts[s["outcome"]] = counts.get(s["outcome"], 0) + 1
    text = " ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    print(f"  [{i}/{n}] {key}: {text} ({res['seconds']:.1f}s)", file=sys.stderr, flush=True)


def run_db(db, args, runner, report):
    """Run the chosen entries of ``db`` into ``report[db]``, saving as it goes."""
    names = args.ops.split(",") if args.ops else None
    keys = sweep.choose(list(sweep.entries(db)), ops=names,
                        sample=None if args.all else args.sample)
    if names and len(args.dbs) == 1:
        unknown = [n for n in names if not sweep.choose(keys, ops=[n])]
        if unknown:
            print(f"warning: not in {db}: {', '.join(unknown)}", file=sys.stderr)
    ops = report["databases"].setdefault(db, {"ops": {}})["ops"]
    for i, key in enumerate(keys, 1):
        ops[key] = runner(db, key)
        if not args.quiet:
            _progress(i, len(keys), key, ops[key])
        if args.json and i % 20 == 0:
            _write(args.json, report)  # a killed long sweep still leaves its results
    report["databases"][db]["summary"] = sweep.summarize(ops)


def _runner(args):
    """``(run(db, key) -> result, close())``: in a worker process unless --in-process."""
    opts = {"dynamic": True} if args.dynamic else {}
    if args.in_process:
        compile_fn, tables = sweep.compiler(args.reference), {}

        def run(db, key):
            table = tables.setdefault(db, sweep.entries(db))
            return sweep.run_entry(db, table[key], compile_fn, max_samples=args.max_samples,
                                   timeout=args.timeout, **opts)
        return run, lambda: None
    worker = Worker(args.reference, **opts)
    return (lambda db, key: worker.run_entry(db, key, max_samples=args.max_samples,
                                             timeout=args.timeout)), worker.close


def _write(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def print_report(db, ops):
    s = sweep.summarize(ops)
    counts = ", ".join(f"{v} {k}" for k, v in s["samples"].items())
    print(f"== {db}: {s['sample_total']} samples: {counts}")
    print(f"   {s['ops_fully_passing']} of {s['ops_total']} entries fully passing "
          f"(by worst outcome: {s['ops_by_status']}); {s['seconds']}s")
    for outcome in ("crash", "mismatch", "typed_error"):
        for sig, count, examples in sweep.top_failures(ops, outcome, n=8):
            print(f"   {outcome:11s} x{count:<5d} {sig[:150]}  e.g. {', '.join(examples)}")


def main(argv=None):
    args = _parse(argv)
    # Every sample must be captured and compiled from scratch: a disk-cache hit
    # would skip the very stages under test (and a sweep would fill ~/.cache).
    os.environ.setdefault("AOTGRAD_CACHE", "0")
    runner, close = _runner(args)
    report = {"meta": {"compiler": "torch aot_function" if args.reference else "aotgrad",
                       "torch": torch.__version__, "argv": sys.argv[1:],
                       "started": time.strftime("%Y-%m-%d %H:%M:%S")}, "databases": {}}
    try:
        for db in args.dbs:
            run_db(db, args, runner, report)
            if args.json:
                _write(args.json, report)
    finally:
        close()
    for db in args.dbs:
        print_report(db, report["databases"][db]["ops"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
