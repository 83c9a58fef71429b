"""``python -m tests.differential.run``: every program through every entry point on every device here;
prints a table of counts (entry x backend x device: pass / typed / fail / skip) and writes per-case
results to JSON. The export cases of a device run first, in one loading process.

    python -m tests.differential.run [--json results.json] [--programs SUBSTR,...] [--entries a,b]
                                     [--devices cpu,cuda] [--fast] [--failures notes.md]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict

from . import exported
from .harness import ENTRIES, PROGRAMS, devices, run_case
from .selection import is_fast

OUTCOMES = ("pass", "typed", "fail", "skip")


def _select(args):
    progs = [p for p in PROGRAMS if not args.programs or any(s in p for s in args.programs.split(","))]
    entries = args.entries.split(",") if args.entries else list(ENTRIES)
    devs = args.devices.split(",") if args.devices else devices()
    return [(p, e, d) for d in devs for p in progs for e in entries if not args.fast or is_fast(p, e, d)]


def table(results) -> str:
    counts = collections.defaultdict(collections.Counter)
    for r in results:
        counts[r["entry"], ENTRIES[r["entry"]].backend, r.get("device", "cpu")][r["outcome"]] += 1
        counts["all", "", ""][r["outcome"]] += 1
    programs = len({r["program"] for r in results})
    rows = len({k[0] for k in counts}) - 1
    lines = [f"{programs} programs x {rows} entry points x backends x devices = {len(results)} cases",
             f"{'entry':20}{'backend':12}{'device':8}" + "".join(f"{o:>7}" for o in OUTCOMES)]
    for (entry, backend, device), c in counts.items():
        lines.append(f"{entry:20}{backend:12}{device:8}" + "".join(f"{c[o]:7d}" for o in OUTCOMES))
    return "\n".join(lines)


def failures_markdown(results) -> str:
    fails = [r for r in results if r["outcome"] == "fail"]
    silent = [r for r in results if r["outcome"] == "typed" and not r["user_line"]]
    out = ["# Differential suite: failing cases", "",
           "Written by `python -m tests.differential.run --failures` (overwritten on every run).",
           "Rerun one program: `python -m tests.differential.run --programs NAME`.", "", "```", table(results), "```",
           "", f"## Failures ({len(fails)})", ""]
    out += _grouped(fails, 300)
    out += ["", f"## Typed refusals that name no user line ({len(silent)})", ""]
    out += _grouped(silent, 200)
    return "\n".join(out) + "\n"


def _grouped(results, width):
    """One line per program and symptom, naming every entry point that shows it."""
    groups = collections.defaultdict(list)
    for r in results:
        where = r["entry"] if r.get("device", "cpu") == "cpu" else f"{r['entry']} ({r['device']})"
        groups[(r["program"], r["detail"][:width])].append(where)
    return [f"- `{p}` × {', '.join(entries)}: {detail}" for (p, detail), entries in groups.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="differential-results.json")
    ap.add_argument("--programs", default="")
    ap.add_argument("--entries", default="")
    ap.add_argument("--devices", default="", help="cpu,cuda (default: cpu, and cuda where available)")
    ap.add_argument("--fast", action="store_true", help="only the slice make test runs")
    ap.add_argument("--failures", default="", help="also write the failing cases as markdown here")
    args = ap.parse_args(argv)
    os.environ.setdefault("AOTGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="aotgrad-diff-cache-"))
    warnings.simplefilter("ignore")
    results, start, selected = [], time.time(), _select(args)
    for d in {d for _, e, d in selected if e == "export"}:
        exported.run([PROGRAMS[p] for p, e, dev in selected if (e, dev) == ("export", d)
                      and "isolate" not in PROGRAMS[p].tags], d)
    for i, (p, e, d) in enumerate(selected):
        t = time.time()
        r = asdict(run_case(PROGRAMS[p], ENTRIES[e], device=d))
        r["seconds"] = round(time.time() - t, 2)
        results.append(r)
        print(f"[{i + 1}] {r['outcome']:5} {p} x {e} on {d} ({r['seconds']} s) {r['detail'][:160]}", flush=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))
    print(f"{time.time() - start:.0f} s")
    if args.failures:
        with open(args.failures, "w") as f:
            f.write(failures_markdown(results))
    return 1 if any(r["outcome"] == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
