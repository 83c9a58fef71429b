"""``aotgrad.explain``: a plain-text account of what a compile did.

Stages with durations, graph sizes, saved activations (name, shape, dtype,
bytes, the user's line), guards, and for ``aotgrad.jit`` every entry and why
it was recompiled.
"""
from __future__ import annotations

from .facts import fmt_bytes, graph_sizes, guard_lines, name_of, saved_rows


def explain(obj) -> str:
    """Explain anything with an ``explain()`` method (a ``Jit``, ``Compiled``, ``Captured``, ``Exported``, a
    ``compiled_autograd`` block): each object says what it is, nothing here guesses it from its fields."""
    method = getattr(type(obj), "explain", None)
    if method is None:
        raise TypeError(f"aotgrad.explain takes an aotgrad.jit function, a Compiled or a Captured, "
                        f"not {type(obj).__name__}; wrap a plain function with aotgrad.jit and call it first")
    return method(obj)


def explain_jit(j) -> str:
    parts = [j.summary()]
    for k, e in enumerate(j.entries):
        why = "first call" if e.reason is None else f"recompiled because {e.reason}"
        parts.append(f"\n=== entry {k} ({why}) ===\n" + explain_compiled(e.compiled))
        parts.append(_state(e.state))
    handoff = getattr(j, "handoff", None)     # calls handed to torch.compile at a value read
    for k, c in enumerate(handoff.graphs if handoff is not None else ()):
        parts.append(f"\n=== torch.compile graph {k} (Dynamo guards it) ===\n" + explain_compiled(c))
    if not j.entries and handoff is None:
        parts.append("  (not called yet: it compiles on its first call)")
    return "\n".join(parts)


def _state(state, limit: int = 40) -> str:
    """The Python state an entry's trace read, as checked on every call (hooks and child dicts that
    must stay empty are counted, not listed)."""
    lines = [line for line, r in zip(state.lines(), state.reads) if r.kind != "empty"]
    empty = len(state.reads) - len(lines)
    head = f"Python state read: {len(state.reads)} reads" + (f" ({empty} dicts that must stay empty)" if empty else "")
    more = [f"  ... {len(lines) - limit} more"] if len(lines) > limit else []
    return "\n".join([head, *(f"  {line}" for line in lines[:limit]), *more])


def explain_compiled(c) -> str:
    sizes = graph_sizes(c)
    lines = [f"Compiled {name_of(c)}"]
    lines += _stages(c.history)
    lines.append("graphs:")
    for kind, s in sizes.items():
        if s is not None:
            lines.append(f"  {kind:<9} {s['nodes']:>5} nodes {s['ops']:>5} ops  {s['inputs']} in, {s['outputs']} out")
    lines += _saved(c)
    lines += ["guards:", *(f"  {g}" for g in guard_lines(c.captured))]
    return "\n".join(lines)


def explain_captured(c) -> str:
    lines = [f"Captured {name_of(c)} ({'inference' if c.is_inference else 'joint forward+backward'})"]
    lines += _stages(c.history)
    lines.append(f"graphs:\n  joint     {len(c.joint.graph.nodes):>5} nodes")
    lines += ["guards:", *(f"  {g}" for g in guard_lines(c))]
    return "\n".join(lines)


def _stages(history) -> list[str]:
    total = sum(s.seconds for s in history)
    return ["stages:", *(f"  {s}" for s in history), f"  {'total':<22} {total * 1e3:9.1f} ms"]


def _saved(c) -> list[str]:
    rows = saved_rows(c)
    if c.partition is None:
        return ["saved for backward: nothing (inference graph)"]
    known = [r.nbytes for r in rows if r.nbytes is not None]
    head = f"saved for backward: {len(c.partition.saved)} values, {fmt_bytes(sum(known))}"
    if len(rows) < len(c.partition.saved):
        head += f" (+{len(c.partition.saved) - len(rows)} symbolic sizes)"
    lines = [head]
    if rows:
        w = max(len(r.name) for r in rows)
        lines.append(f"  {'name':<{w}}  {'shape':<16} {'dtype':<9} {'bytes':>10}  source")
        for r in rows:
            shape = "[" + ", ".join(map(str, r.shape)) + "]"
            lines.append(f"  {r.name:<{w}}  {shape:<16} {r.dtype:<9} {fmt_bytes(r.nbytes):>10}  {r.source or '-'}")
    return lines
