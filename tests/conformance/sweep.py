"""Sweep a database: choose entries, run their samples, summarize the results."""
from __future__ import annotations

import re
import time
from collections import Counter, defaultdict

from tests.conformance import modules, opinfo
from tests.conformance.harness import OUTCOMES, run_samples

DATABASES = ("opinfo", "autograd_function", "modules")
_SOURCES = {"opinfo": opinfo, "autograd_function": opinfo, "modules": modules}


def entries(db):
    """``{key: entry}`` for every entry of database ``db``, in database order."""
    src = _SOURCES[db]
    return {src.key(e): e for e in src.load(db)}


def spread(items, n):
    """``n`` items evenly spaced over ``items`` (all of them if ``n >= len``)."""
    items = list(items)
    if n is None or n >= len(items):
        return items
    return [items[(i * len(items)) // n] for i in range(n)]


def choose(keys, *, ops=None, sample=None):
    """Keys named in ``ops``, else ``sample`` keys spread over the database.

    A name also selects its variants: ``norm`` selects ``norm.fro``.
    """
    if ops:
        return [k for k in keys if any(k == w or k.startswith(w + ".") for w in ops)]
    return spread(keys, sample)


def compiler(reference=False):
    """The ``compile=`` for check(): aotgrad's, or torch's aot_function as a reference."""
    if reference:
        from tests.conformance.reference import aot_function_compile
        return aot_function_compile
    from tests.eager_check import default_compile
    return default_compile


def run_entry(db, entry, compile_fn, *, max_samples=None, exclude=(), timeout=60.0,
              report=None, **opts):
    """Results of one database entry: its per-sample outcomes and time taken."""
    src = _SOURCES[db]

    def build():
        built = src.samples(entry)
        return spread(built, max_samples) if max_samples else built
    start = time.perf_counter()
    results = run_samples(build, compile_fn, exclude=exclude, timeout=timeout, report=report, **opts)
    return {"seconds": round(time.perf_counter() - start, 3), "samples": results}


def op_status(samples):
    """``pass`` if every sample passed or was skipped and one passed, else the worst outcome."""
    seen = {s["outcome"] for s in samples}
    for bad in ("crash", "mismatch", "typed_error"):
        if bad in seen:
            return bad
    return "pass" if "pass" in seen else "skip"


def summarize(ops):
    """Counts per outcome over samples, and per op status, for ``{key: result}``."""
    samples = Counter({o: 0 for o in OUTCOMES})
    status = Counter({o: 0 for o in OUTCOMES})
    for res in ops.values():
        samples.update(s["outcome"] for s in res["samples"])
        status[op_status(res["samples"])] += 1
    return {"samples": dict(samples), "sample_total": sum(samples.values()),
            "ops_total": len(ops), "ops_fully_passing": status["pass"],
            "ops_by_status": dict(status),
            "seconds": round(sum(r["seconds"] for r in ops.values()), 1)}


def _signature(s):
    """A short, number-free description that groups similar failures."""
    if s["outcome"] == "crash":
        where = s.get("aotgrad_frame") or s.get("where")
        text = f'{s.get("type")}{" at " + where if where else ""}: {s.get("message", "")[:90]}'
    elif s["outcome"] == "typed_error":
        text = f'{s.get("type")}: {s.get("message", "")[:90]}'
    else:
        text = s.get("message", "").splitlines()[0] if s.get("message") else ""
    return re.sub(r"\d+", "N", text.splitlines()[0] if text else text)


def top_failures(ops, outcome, n=10):
    """The ``n`` most common failure signatures: ``(signature, count, example ops)``."""
    count, examples = Counter(), defaultdict(list)
    for key, res in ops.items():
        for s in res["samples"]:
            if s["outcome"] == outcome:
                sig = _signature(s)
                count[sig] += 1
                if key not in examples[sig]:
                    examples[sig].append(key)
    return [(sig, c, examples[sig][:4]) for sig, c in count.most_common(n)]
