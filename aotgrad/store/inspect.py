"""``python -m aotgrad inspect step.aotgrad``: an exported step's manifest and graphs, inputs named."""
from __future__ import annotations


def format_exported(ex) -> str:
    from ..observe.printing import format_captured, format_compiled
    m = ex.manifest
    lines = [f"Exported {m['name']} ({m['kind']}) from {ex.path}",
             f"  format {m['format']} version {m['version']}, torch {m['torch']}, aotgrad {m['aotgrad']}"]
    for e in m["state"]:
        t = ex.state.get_parameter(e["name"]) if e["kind"] == "param" else ex.state.get_buffer(e["name"])
        tied = f" (tied: {', '.join(e['aliases'])})" if e["aliases"] else ""
        lines.append(f"  {e['kind']:<6} {e['name']:<32} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                     f"{' requires_grad' if t.requires_grad else ''}{tied}")
    return "\n".join(lines + [format_captured(ex.compiled.captured), format_compiled(ex.compiled)])
