"""The facts ``explain`` and ``report`` show, gathered from stage objects as plain rows."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class SavedRow:
    name: str
    shape: tuple
    dtype: str
    nbytes: int | None          # None when a size is symbolic
    source: str | None          # the user's line that produced it


def graph_size(gm: fx.GraphModule | None) -> dict | None:
    if gm is None:
        return None
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    ins = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outs = gm.graph.output_node().args[0]
    return {"nodes": len(gm.graph.nodes), "ops": len(ops), "inputs": len(ins),
            "outputs": len(outs) if isinstance(outs, (tuple, list)) else 1}


def graph_sizes(compiled) -> dict:
    return {"joint": graph_size(compiled.captured.joint), "forward": graph_size(compiled.forward_graph),
            "backward": graph_size(compiled.backward_graph)}


def saved_rows(compiled) -> list[SavedRow]:
    """One row per saved activation: from ``partition.memory.estimate`` when it can, else from node metadata."""
    if compiled.partition is None:
        return []
    try:
        return [SavedRow(s.name, tuple(s.shape), _dtype(s.dtype), _int(s.nbytes), _short(s.source))
                for s in compiled.memory.saved]
    except Exception:       # symbolic sizes, or an estimator that does not exist in this version
        return _rows_from_meta(compiled)


def _rows_from_meta(compiled) -> list[SavedRow]:
    out = compiled.forward_graph.graph.output_node().args[0]
    n = len(compiled.partition.saved)
    rows = []
    for node in list(out)[len(out) - n:]:
        v = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(v, torch.Tensor):
            nbytes = _int(v.numel() * v.element_size())
            rows.append(SavedRow(node.name, tuple(v.shape), _dtype(v.dtype), nbytes, _short(_source(node))))
        else:
            rows.append(SavedRow(getattr(node, "name", str(node)), (), type(v).__name__, None, None))
    return rows


def _source(node) -> str | None:
    try:
        from ..partition.memory import user_line
        return user_line(node)
    except Exception:
        return None


def _short(source: str | None) -> str | None:
    """A source line with its path relative to the working directory when it is under it."""
    if source is None:
        return None
    cwd = os.getcwd() + os.sep
    return source[len(cwd):] if source.startswith(cwd) else source


def _int(x) -> int | None:
    try:
        return int(x)
    except Exception:       # a SymInt with no hint
        return None


def _dtype(d) -> str:
    return str(d).removeprefix("torch.")


def guard_lines(captured) -> list[str]:
    """Each input's dtype/device/sizes/requires_grad, then the symbolic-shape assumptions."""
    g = captured.guards
    lines = []
    for desc, spec in zip(g.descs, g.specs):
        if spec is None:
            lines.append(f"{desc}: a number, guarded by its frontend")
            continue
        size = ", ".join(str(s) for s in spec.size)
        grad = ", requires_grad" if spec.requires_grad else ""
        lines.append(f"{desc}: {_dtype(spec.dtype)}[{size}] on {spec.device}{grad}")
    lines += [f"assumes {c}" for c in g.conditions]
    return lines


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def name_of(stage) -> str:
    fn = stage.captured.setup.flat_fn if hasattr(stage, "captured") else stage.setup.flat_fn
    return getattr(fn, "__name__", type(fn).__name__)
