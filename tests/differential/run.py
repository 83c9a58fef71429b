"""``python -m tests.differential.run``: every program through every entry point; prints a table of
counts (entries x pass / typed / fail / skip) and writes per-case results to JSON.

    python -m tests.differential.run [--json results.json] [--programs SUBSTR,...] [--entries a,b]
                                     [--fast] [--failures notes.md]
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

from .harness import ENTRIES, PROGRAMS, run_case
from .selection import is_fast

OUTCOMES = ("pass", "typed", "fail", "skip")


def _select(args):
    progs = [p for p in PROGRAMS if not args.programs or any(s in p for s in args.programs.split(","))]
    entries = args.entries.split(",") if args.entries else list(ENTRIES)
    return [(p, e) for p in progs for e in entries if not args.fast or is_fast(p, e)]


def table(results) -> str:
    counts = collections.defaultdict(collections.Counter)
    for r in results:
        counts[r["entry"]][r["outcome"]] += 1
        counts["all"][r["outcome"]] += 1
    programs = len({r["program"] for r in results})
    lines = [f"{programs} programs x {len(counts) - 1} entry points = {len(results)} cases",
             f"{'entry':20}" + "".join(f"{o:>7}" for o in OUTCOMES)]
    for entry, c in counts.items():
        lines.append(f"{entry:20}" + "".join(f"{c[o]:7d}" for o in OUTCOMES))
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
        groups[(r["program"], r["detail"][:width])].append(r["entry"])
    return [f"- `{p}` × {', '.join(entries)}: {detail}" for (p, detail), entries in groups.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="differential-results.json")
    ap.add_argument("--programs", default="")
    ap.add_argument("--entries", default="")
    ap.add_argument("--fast", action="store_true", help="only the slice make test runs")
    ap.add_argument("--failures", default="", help="also write the failing cases as markdown here")
    args = ap.parse_args(argv)
    os.environ.setdefault("AOTGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="aotgrad-diff-cache-"))
    warnings.simplefilter("ignore")
    results, start = [], time.time()
    for i, (p, e) in enumerate(_select(args)):
        t = time.time()
        r = asdict(run_case(PROGRAMS[p], ENTRIES[e]))
        r["seconds"] = round(time.time() - t, 2)
        results.append(r)
        print(f"[{i + 1}] {r['outcome']:5} {p} x {e} ({r['seconds']} s) {r['detail'][:160]}", flush=True)
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
