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
    from ..ir.values import with_values
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


def _name(setup) -> str:
    return getattr(setup.flat_fn, "__name__", type(setup.fn).__name__)


def _nodes(gm) -> int:
    return len(gm.graph.nodes) if gm is not None else 0


def repr_setup(s) -> str:
    return f"<Setup {_name(s)}: {len(s.input_descs)} flat inputs>"


def repr_captured(c) -> str:
    kind = "inference" if c.is_inference else "joint"
    return (f"<Captured {_name(c.setup)}: {kind} graph of {_nodes(c.joint)} nodes, "
            f"{len(c.input_descs)} inputs, {len(c.output_descs)} outputs>")


def repr_compiled(c) -> str:
    graphs = f"forward {_nodes(c.forward_graph)} nodes"
    if c.backward_graph is not None:
        graphs += f", backward {_nodes(c.backward_graph)} nodes, {len(c.saved)} saved"
    return f"<Compiled {_name(c.captured.setup)}: {graphs}>"


def repr_jit(j) -> str:
    n = len(j.entries)
    return f"<aotgrad.jit {j.name or type(j.fn).__name__}: {n} compiled entr{'y' if n == 1 else 'ies'}>"


def format_compiled(c) -> str:
    parts = [f"Compiled {c.captured.setup.flat_fn.__name__}",
             "  history:", *(f"    {s}" for s in c.history)]
    if c.partition is not None:
        parts.append("  saved for backward: " + ", ".join(c.partition.saved))
    parts.append("forward:\n" + format_graph(c.forward_graph))
    if c.backward_graph is not None:
        parts.append("backward:\n" + format_graph(c.backward_graph))
    return "\n".join(parts)


def format_program(c, modes=None, state=None) -> str:
    """A compiled step as the program a call runs, in order: the prologue (modes, the Python state the
    trace read, the arguments and their input guards), the forward graph, the epilogue (input writes,
    outputs rebuilt as views), and the backward graph that ``backward()`` runs. ``modes`` (names,
    values) and ``state``: a ``jit`` entry's, which its frontend checks before the step's own prologue."""
    from ..runtime.codegen import source_of
    from ..runtime.modes import BAKED_NAMES
    setup, guards = c.captured.setup, c.captured.guards
    state = state if state is not None else c.captured.state
    name = setup.flat_fn.__name__
    out = [f"# program of {name}: prologue, forward, epilogue; backward on loss.backward()", "",
           "# --- prologue: modes (a call under others raises InputMismatchError)"]
    if modes is None and setup.session.baked is not None:
        modes = (BAKED_NAMES, setup.session.baked)
    out += [f"#   {n}: {v}" for n, v in zip(*modes)] if modes else ["#   not checked"]
    out.append("# --- prologue: Python state the trace read" + ("" if state else ": none"))
    if state:
        out += [f"#   {line}" for line in state.lines()]
    out += ["# --- prologue: arguments", source_of(c.path.match) or "", "# input guards (check)", guards.source, "",
            "# --- forward", _named(c.forward_graph, "forward"), ""]
    epilogue = source_of(c.path.epilogue) if c.path.epilogue is not None else None
    out += ["# --- epilogue", epilogue or "# outputs are the forward's values, as they are", ""]
    if c.backward_graph is not None:
        out += ["# --- backward", _named(c.backward_graph, "backward"), ""]
    return "\n".join(out)


def _named(gm, name: str) -> str:
    """A graph's Python code as a plain function named ``name`` (fx writes ``def forward(self, ...)``)."""
    return gm.code.strip().replace("def forward(self, ", f"def {name}(", 1).replace("def forward(self)", f"def {name}()", 1)
