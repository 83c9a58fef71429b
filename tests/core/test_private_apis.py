"""Every use of PyTorch's private APIs goes through ``aotgrad/_torch.py``, so a torch upgrade is
audited in that one file. Private: a ``torch`` dotted name with a component that starts with an
underscore (``torch._C``, ``torch.utils._pytree``, ``torch.nn.Module._call_impl``), whether it is
imported, read as an attribute, or named as a string to ``getattr``/``hasattr``/``setattr``.
Public ``torch.*`` APIs are fine anywhere."""
import ast
from pathlib import Path

import aotgrad

ROOT = Path(aotgrad.__file__).resolve().parent

# Uses allowed outside _torch.py, each with the reason it cannot move: {(module path, dotted name): reason}.
EXCEPTIONS: dict = {}


def private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
                                       for p in parts[1:])


def _dotted(node) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
        return ".".join(reversed(names))
    return None


def _aliases(tree) -> dict:
    """Local names bound to torch objects by imports (``Variable`` -> ``torch.autograd.variable.Variable``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("torch.")})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return names


def _named(node, aliases: dict) -> list:
    """Dotted names one node uses, with imported names spelled out."""
    def full(dotted):
        head, _, rest = (dotted or "").partition(".")
        return ".".join(filter(None, (aliases.get(head, head), rest)))
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Attribute):
        return [full(_dotted(node))]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return [f"{full(_dotted(node.args[0]))}.{node.args[1].value}"]
    return []


def private_uses(source: str) -> set:
    """``(line, dotted name)`` of every private torch API ``source`` uses."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    return {(node.lineno, name) for node in ast.walk(tree) for name in _named(node, aliases) if private(name)}


def test_private_torch_apis_only_in_torch_module():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "_torch.py":
            continue
        for line, name in private_uses(path.read_text()):
            if (rel, name) not in EXCEPTIONS:
                found.setdefault((rel, name), line)
    assert not found, "private torch APIs used outside aotgrad/_torch.py (add them there):\n" + "\n".join(
        f"  aotgrad/{rel}:{line}: {name}" for (rel, name), line in sorted(found.items()))


def test_every_exception_is_still_used():
    used = {(str(p.relative_to(ROOT)), name) for p in ROOT.rglob("*.py")
            for _, name in private_uses(p.read_text())}
    assert not set(EXCEPTIONS) - used, f"remove fixed exceptions: {sorted(set(EXCEPTIONS) - used)}"


def test_the_scan_sees_each_form():
    source = ("import torch._dynamo\nfrom torch._subclasses import FakeTensor\nfrom torch import _C\n"
              "import torch.utils._pytree as pytree\nx = torch._C._autograd\ny = torch.nn.Module._call_impl\n"
              "z = getattr(torch.compiler, '_is_compiling_flag', False)\n"
              "from torch.autograd.variable import Variable\nVariable._execution_engine.queue_callback(f)\n"
              "ok = torch.ops.aten.add.Tensor, torch.__version__, torch.fx.experimental.proxy_tensor.make_fx\n")
    assert {line for line, _ in private_uses(source)} == {1, 2, 3, 4, 5, 6, 7, 9}


# Private names ``_torch.py`` reads with a fallback (``getattr(..., None)``, ``try``): on a torch where one
# is gone the fallback runs silently (a slower guard check, a Python copy of a torch helper), or, where the
# fallback itself is stale, fails only there. On the torches CI runs (2.13 on), each must resolve, so a
# rename fails here first; ``ONE_OF`` pairs are a name and the one a later torch replaced it with.
FALLBACKS = ("torch._C._dynamo.guards.dict_version", "torch._C._functionalization",
             "torch._functionalize_was_storage_changed", "torch._prims_common.suggest_memory_format",
             "torch._prims_common.are_strides_like_channels_last_or_false",
             "torch.fx._lazy_graph_module._make_graph_module", "torch.fx._lazy_graph_module._use_lazy_graph_module",
             "torch._C._functorch", "torch.nn.Module._wrapped_call_impl", "torch.utils.checkpoint.CheckpointFunction",
             "torch.utils.checkpoint._is_compiling", "torch._dynamo.guards.GuardManagerType")
ONE_OF = (("torch.fx._symbolic_trace._is_fx_tracing_flag", "torch.fx._symbolic_trace._is_fx_tracing_context"),)


def _resolves(name: str) -> bool:
    import importlib
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return False
        return True
    return False


def test_fallback_names_resolve_on_this_torch():
    import pytest
    import torch
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        pytest.skip("checked on the torches CI runs (2.13 on)")
    missing = [n for n in FALLBACKS if not _resolves(n)]
    missing += [" or ".join(pair) for pair in ONE_OF if not any(map(_resolves, pair))]
    assert not missing, f"private torch names gone on {torch.__version__} (update _torch.py's fallbacks): {missing}"
