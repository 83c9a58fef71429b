"""The shape of the code, measured the same way for any checkout (this one, or an old commit's
worktree): files and lines, the folders (parts) and the import cycles between them, the
process-wide patches (assignments to an attribute of torch), module-level mutable state, and the
package files a two-layer MLP's capture, compile, first call and backward run through.

    python -m benchmarks.code_shape                 # this checkout
    python -m benchmarks.code_shape /tmp/old        # another one (a git worktree), side by side
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_MUTABLE_CALLS = ("dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary",
                  "WeakSet", "Counter", "deque", "Stack", "ContextVar", "local", "count", "Shared")


def module_name(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str, pkg: Path) -> str:
    """A module's part: its top-level folder, or the top-level module itself."""
    head = module.split(".")[0] if module else ""
    return head


def runs(tree):
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks (which never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def imports(path: Path, name: str, modules: set) -> set:
    """The aotgrad modules the module ``name`` at ``path`` imports, at module level or inside functions."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in runs(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if name else []
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("aotgrad"):
                target = node.module.removeprefix("aotgrad").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}".lstrip(".")
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("aotgrad").lstrip(".") for a in node.names
                      if a.name.split(".")[0] == "aotgrad"}
    return found - {name}


def cycles(edges: dict) -> list:
    """Strongly connected components of more than one part."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))
    for v in list(edges):
        if v not in index:
            visit(v)
    return comps


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_writes(tree) -> list:
    """``line: target`` of each assignment, ``del`` or ``setattr``/``delattr`` of an attribute of
    torch (or of a name taken from it: ``from torch... import``, ``from .._torch import``,
    ``T = torch.Tensor``) in one module's syntax tree."""
    names = {"torch"}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name.split(".")[0] == "torch"}
        elif isinstance(n, ast.ImportFrom) and ((n.module or "").split(".")[0] == "torch"
                                                or (n.module or "").endswith("_torch")):
            names |= {a.asname or a.name for a in n.names}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and _root(n.value) in names:
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
            targets = [t for x in targets for t in (x.elts if isinstance(x, ast.Tuple) else [x])]
            found += [f"{t.lineno}: {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and _root(t) in names]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr") \
                and n.args and _root(n.args[0]) in names:
            found.append(f"{n.lineno}: {ast.unparse(n)}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def _mutable_state(tree) -> int:
    """Module-level names bound to a mutable container or per-thread/shared state object."""
    count = 0
    for n in tree.body:
        value = n.value if isinstance(n, (ast.Assign, ast.AnnAssign)) else None
        if value is None:
            continue
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            count += 1
        elif isinstance(value, ast.Call):
            f = value.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            count += name in _MUTABLE_CALLS
    return count


def static(root: Path) -> dict:
    pkg = root / "aotgrad"
    paths = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
    edges: dict = {}
    lines = patches = state = 0
    patch_files = set()
    for name, p in paths.items():
        text = p.read_text()
        tree = ast.parse(text)
        lines += len(text.splitlines())
        w = len(torch_writes(tree))
        patches += w
        if w:
            patch_files.add(str(p.relative_to(pkg)))
        state += _mutable_state(tree)
        for b in imports(p, name, set(paths)):
            pa, pb = _part(name, pkg), _part(b, pkg)
            if pa != pb and pa and pb:
                edges.setdefault(pa, set()).add(pb)
    parts = {_part(m, pkg) for m in paths if m}
    return {"files": len(paths), "lines": lines, "parts": len(parts), "part cycles": cycles(edges),
            "torch attribute writes": patches, "files writing torch attributes": sorted(patch_files),
            "module-level mutable state": state}


_PIPELINE = r"""
import json, sys, threading
sys.path.insert(0, ROOT)
import torch, aotgrad
files = {}
phase = ["import"]
pkg = ROOT + "/aotgrad/"

def tracer(frame, event, arg):
    f = frame.f_code.co_filename
    if f.startswith(pkg):
        files.setdefault(phase[0], set()).add(f[len(pkg):])
    return None

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(4, 8)
aotgrad.capture(mlp, x).compile()(x).sum().backward()      # warm: lazy imports happen here
sys.settrace(tracer); threading.settrace(tracer)
phase[0] = "capture"; captured = aotgrad.capture(mlp, x)
phase[0] = "compile"; step = captured.compile()
phase[0] = "call"; loss = step(x).sum()
phase[0] = "backward"; loss.backward()
sys.settrace(None)
print(json.dumps({k: sorted(v) for k, v in files.items()}))
"""


def pipeline_files(root: Path) -> dict:
    """``{phase: [file under aotgrad/]}``: the files whose code runs in each phase of a two-layer MLP's
    capture, compile, call and backward."""
    code = _PIPELINE.replace("ROOT", repr(str(root)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def pipeline(root: Path) -> dict:
    per = pipeline_files(root)
    every = set().union(*per.values()) if per else set()
    return {"pipeline files": len(every), **{f"pipeline files, {k}": len(v) for k, v in per.items()}}


def measure(root: Path) -> dict:
    return {**static(root), **pipeline(root)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*", type=Path, help="checkouts to measure (default: this one)")
    roots = ap.parse_args().roots or [HERE]
    results = [measure(r.resolve()) for r in roots]
    keys = [k for k in results[0] if not isinstance(results[0][k], list)]
    print("| measure | " + " | ".join(str(r) for r in roots) + " |")
    print("|---|" + "---:|" * len(roots))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(r.get(k, "")) for r in results) + " |")
    for k in ("part cycles", "files writing torch attributes"):
        for r, res in zip(roots, results):
            print(f"{k} in {r}: {res[k]}")


if __name__ == "__main__":
    main()
