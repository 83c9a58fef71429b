"""What a graph compiler is told about the graph it compiles, beyond the graph.

Attached as ``gm.meta["aotgrad"]`` so that any ``(gm, example_inputs)``
compiler can read it and plain ones can ignore it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphInfo:
    kind: str                   # "forward", "backward" or "inference"
    input_names: tuple          # descriptor text per placeholder
    static_inputs: tuple        # placeholder indices holding parameters/buffers (same storage every call)
    mutated_inputs: tuple       # placeholder indices whose new value the graph returns for write-back
    saved_outputs: tuple        # output indices the forward saves for the backward
    function_id: int            # shared by the forward and backward of one compiled function


def graph_info(captured, kind: str, part=None, function_id: int = 0) -> GraphInfo:
    lay, descs = captured.layout, captured.input_descs
    if kind == "backward":
        names = tuple(f"saved {n}" for n in part.saved) + tuple(str(descs[lay.n_primals + k])
                                                               for k in range(len(lay.tangent_of)))
        return GraphInfo(kind, names, (), (), (), function_id)
    primals = descs[:lay.n_primals]
    static = tuple(i for i, d in enumerate(primals) if d.kind in ("param", "buffer"))
    saved = tuple(range(lay.n_fw, lay.n_fw + len(part.saved))) if part is not None else ()
    return GraphInfo(kind, tuple(map(str, primals)), static, tuple(captured.analysis.mutated()),
                     saved, function_id)
