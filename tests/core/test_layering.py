"""aotgrad's import graph follows the layer order of docs/design.md: no cycle between parts, and
no part imports one of a higher layer. Imports inside functions count as much as module-level ones
(only ``if TYPE_CHECKING:`` blocks, which never run, are left out)."""
from pathlib import Path

import aotgrad
from benchmarks import code_shape

ROOT = Path(aotgrad.__file__).resolve().parent

# Parts, lowest layer first (docs/design.md, "Layers"). A module belongs to the part that is the
# longest prefix of its dotted name; "" is the package's own __init__ (the public API).
LAYERS = (
    ("errors", "_torch", "_native", "scoped", "options"),
    ("tracing",),
    ("ir",),
    ("passes", "partition", "runtime"),
    ("backends",),
    ("observe",),
    ("compiled_autograd",),
    ("guards",),
    ("store",),
    ("compile",),
    ("stages",),
    ("inputs",),
    ("capture",),
    ("export",),
    ("frontend",),
    ("cli", "__main__", ""),
)

# Known upward imports, each with the change that removes it. The test fails on any other, and
# on one of these once it is gone (so the list only shrinks).
KNOWN: dict = {}


def module_name(path: Path) -> str:
    return code_shape.module_name(path, ROOT)


def imports(path: Path, modules: set) -> set:
    """The aotgrad modules ``path`` imports, at module level or inside functions."""
    return code_shape.imports(path, module_name(path), modules)


def part_of(module: str) -> str:
    names = [p for layer in LAYERS for p in layer]
    pieces = module.split(".")
    for k in range(len(pieces), 0, -1):
        if ".".join(pieces[:k]) in names:
            return ".".join(pieces[:k])
    assert module == "", f"module aotgrad.{module} belongs to no part of LAYERS (add it, and to docs/design.md)"
    return ""


def layer_of(part: str) -> int:
    return next(k for k, layer in enumerate(LAYERS) if part in layer)


def graph() -> dict:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: imports(p, set(paths)) for m, p in paths.items()}


def upward(edges: dict) -> dict:
    """``{(module, imported module): (part, imported part)}`` for every import of a higher layer."""
    out = {}
    for a, targets in edges.items():
        for b in targets:
            pa, pb = part_of(a), part_of(b)
            if pa != pb and layer_of(pb) > layer_of(pa):
                out[(a, b)] = (pa, pb)
    return out


def part_cycles(edges: dict, skip=()) -> list:
    """Cycles between parts (strongly connected components of more than one part)."""
    nxt: dict = {}
    for a, targets in edges.items():
        for b in targets:
            pa, pb = part_of(a), part_of(b)
            if pa != pb and (a, b) not in skip:
                nxt.setdefault(pa, set()).add(pb)
    return code_shape.cycles(nxt)


def test_every_module_belongs_to_a_part():
    for m in graph():
        part_of(m)


def test_every_part_is_a_whole_folder_or_a_top_level_module():
    # Folders are the layers: no part is cut out of another folder's modules.
    assert all("." not in part for layer in LAYERS for part in layer)


def test_no_lower_layer_imports_a_higher_one():
    found = upward(graph())
    new = {f"aotgrad.{a} imports aotgrad.{b} ({pa} -> {pb})" for (a, b), (pa, pb) in found.items()
           if (a, b) not in KNOWN}
    assert not new, "imports against the layer order:\n" + "\n".join(sorted(new))
    gone = set(KNOWN) - set(found)
    assert not gone, f"these known exceptions are fixed: remove them from KNOWN: {sorted(gone)}"


def test_no_cycle_between_parts():
    assert part_cycles(graph(), skip=set(KNOWN)) == []


def test_the_checker_sees_in_function_imports_and_cycles(tmp_path):
    src = tmp_path / "aotgrad"
    src.mkdir()
    (src / "__init__.py").write_text("")
    (src / "low.py").write_text("def f():\n    from .high import g\n    return g\n")
    (src / "high.py").write_text("from . import low\n")
    global ROOT
    saved, ROOT = ROOT, src
    try:
        edges = graph()
    finally:
        ROOT = saved
    assert edges["low"] == {"high"} and edges["high"] == {"low"}
    assert part_cycles({"stages": {"compile"}, "compile": {"stages"}}) == [["compile", "stages"]]
    assert upward({"compile": {"stages"}}) == {("compile", "stages"): ("compile", "stages")}


# Features a two-layer MLP does not use, whose code must not run when it is captured, compiled,
# called and differentiated (each is entered only where its fact is present).
OFF_THE_PATH = ("runtime/double_backward.py", "inputs/step", "capture/blocks.py", "capture/block_graph.py",
                "partition/blocks.py", "partition/min_cut.py", "compiled_autograd/", "export/", "store/",
                "backends/inductor.py", "backends/cudagraphs/", "frontend/", "ir/values.py")


def test_features_a_plain_module_does_not_use_stay_off_its_capture_path():
    ran = set().union(*code_shape.pipeline_files(ROOT.parent).values())
    assert ran, "the pipeline tracer saw no aotgrad code"
    assert "capture/capture.py" in ran and "runtime/call.py" in ran
    assert not [f for f in ran if f.startswith(OFF_THE_PATH)], sorted(ran)
