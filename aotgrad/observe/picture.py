"""The joint graph as a picture, coloured by partition, laid out by networkx and drawn by matplotlib."""
from __future__ import annotations

import io

import networkx as nx

COLOURS = {"input": "#9e9e9e", "tangent": "#ce93d8", "forward": "#64b5f6", "saved": "#ffb74d",
           "recomputed": "#81c784", "backward": "#e57373", "output": "#616161"}
LEGEND = {"input": "primal input", "tangent": "tangent input", "forward": "forward",
          "saved": "saved for backward", "recomputed": "recomputed in backward",
          "backward": "backward", "output": "output"}


def roles(compiled) -> dict:
    """``joint node name -> role`` (a key of :data:`COLOURS`)."""
    joint = compiled.captured.joint.graph
    n_primals = compiled.captured.layout.n_primals
    fw = {n.name for n in compiled.forward_graph.graph.nodes}
    part = compiled.partition
    saved = set(part.saved) if part else set()
    recomputed = set(getattr(part, "recomputed", ())) if part else set()
    out, k = {}, 0
    for n in joint.nodes:
        if n.op == "placeholder":
            out[n.name] = "input" if k < n_primals else "tangent"
            k += 1
        elif n.op == "output":
            out[n.name] = "output"
        elif n.name in saved:
            out[n.name] = "saved"
        elif n.name in recomputed:
            out[n.name] = "recomputed"
        elif n.name in fw or part is None:
            out[n.name] = "forward"
        else:
            out[n.name] = "backward"
    return out


def joint_svg(compiled, max_labels: int = 160) -> str:
    """An SVG drawing of the joint graph: layers by topological depth, top to bottom."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the report's graph picture needs matplotlib: pip install 'aotgrad[report]'") from None
    from matplotlib.figure import Figure        # no pyplot: leaves the user's backend and figures alone
    from matplotlib.patches import Patch

    role = roles(compiled)
    g = nx.DiGraph()
    for n in compiled.captured.joint.graph.nodes:
        g.add_node(n.name)
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name)
    _assign_layers(g)
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal")
    pos = {k: (x, -y) for k, (x, y) in pos.items()}          # inputs at the top
    layers = nx.get_node_attributes(g, "layer")
    depth = max(layers.values(), default=0) + 1
    width = max(list(layers.values()).count(d) for d in range(depth))
    fig = Figure(figsize=(min(4 + width * 1.1, 30), min(3 + depth * 0.45, 60)))
    ax = fig.subplots()
    colours = [COLOURS[role[n]] for n in g.nodes]
    nx.draw_networkx_edges(g, pos, ax=ax, arrows=True, arrowsize=6, width=0.5, edge_color="#b0b0b0",
                           node_size=220)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colours, node_size=220, linewidths=0.5,
                           edgecolors="#333333")
    if g.number_of_nodes() <= max_labels:
        lift = 0.35 / max(depth - 1, 1)       # a third of a layer: the name sits above its dot
        nx.draw_networkx_labels(g, {k: (x, y + lift) for k, (x, y) in pos.items()}, ax=ax, font_size=6,
                                verticalalignment="bottom")
    used = [r for r in COLOURS if r in set(role.values())]
    ax.legend(handles=[Patch(color=COLOURS[r], label=LEGEND[r]) for r in used], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_axis_off()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


def _assign_layers(g) -> None:
    """Layer = topological depth, except that inputs and what is computed from inputs
    alone (a weight's transpose) sit just above their first user; otherwise every
    parameter crowds into the first rows."""
    for depth, layer in enumerate(nx.topological_generations(g)):
        for name in layer:
            g.nodes[name]["layer"] = depth
    input_only = set()
    for name in nx.topological_sort(g):
        if all(p in input_only for p in g.predecessors(name)) and g.out_degree(name):
            input_only.add(name)
    for name in reversed(list(nx.topological_sort(g))):
        if name in input_only:
            g.nodes[name]["layer"] = min(g.nodes[u]["layer"] for u in g.successors(name)) - 1
