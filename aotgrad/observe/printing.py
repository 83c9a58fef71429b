"""Readable text for stage objects: graphs with their inputs and outputs named."""
from __future__ import annotations


def _io_table(title: str, descs, nodes) -> list[str]:
    lines = [f"  {title}:"]
    for d, n in zip(descs, nodes):
        val = n.meta.get("val") if hasattr(n, "meta") else None
        shape = f" {str(val.dtype).removeprefix('torch.')}{list(val.shape)}" if hasattr(val, "shape") else ""
        name = n.name if hasattr(n, "name") else repr(n)
        lines.append(f"    {name:<28} {d}{shape}")
    return lines


def format_graph(gm) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)


def format_captured(c) -> str:
    from ..export.values import with_values
    with_values(c.joint)        # a joint loaded from the disk cache: its shapes are printed
    ph = [n for n in c.joint.graph.nodes if n.op == "placeholder"]
    outs = list(c.joint.graph.output_node().args[0])
    kind = "inference graph" if c.is_inference else "joint forward+backward graph"
    lines = [f"Captured {c.setup.flat_fn.__name__}: {kind}, {len(c.joint.graph.nodes)} nodes"]
    lines += _io_table("inputs", c.input_descs, ph)
    lines += _io_table("outputs", c.output_descs, outs)
    mutated = [str(c.input_descs[i]) for i in c.analysis.mutated()]
    if mutated:
        lines.append("  mutates: " + ", ".join(mutated))
    aliases = [f"output {j} is {o.kind} {o.index}" for j, o in enumerate(c.analysis.outputs)
               if o.kind not in ("plain", "constant")]
    if aliases:
        lines.append("  aliases: " + "; ".join(aliases))
    return "\n".join(lines) + "\n" + format_graph(c.joint)


def format_compiled(c) -> str:
    parts = [f"Compiled {c.captured.setup.flat_fn.__name__}",
             "  history:", *(f"    {s}" for s in c.history)]
    if c.partition is not None:
        parts.append("  saved for backward: " + ", ".join(c.partition.saved))
    parts.append("forward:\n" + format_graph(c.forward_graph))
    if c.backward_graph is not None:
        parts.append("backward:\n" + format_graph(c.backward_graph))
    return "\n".join(parts)
