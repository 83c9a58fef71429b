"""The disk cache's files are data: JSON read through the one codec, tensors as raw bytes. A cache
directory someone else can write (a shared ``AOTGRAD_CACHE_DIR``, a restored CI cache) may hold a
file with a valid checksum and anything inside; loading it must never run code it names, and the
call still gives eager's numbers. Symbolic (dynamic) entries round-trip exactly."""
import hashlib
import json
import struct
import subprocess
from pathlib import Path

import pytest
import sympy
import torch

import aotgrad
from aotgrad.errors import ExportFormatError
from aotgrad.store import codec, disk, symbolic
from tests.eager_check import check

ROOT = Path(__file__).resolve().parents[2]
RAN: list = []      # a crafted entry that ran code would append here


def scaled(x, y):
    return (x * 2.0).sin() + y.cos() * 3


def jit_compile(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


def _read(path):
    blob = path.read_bytes()
    payload = blob[len(disk.MAGIC) + 32:]
    (n,) = struct.unpack_from("<Q", payload)
    return json.loads(payload[8:8 + n]), payload[8 + n:]


def _write(path, doc, rest):
    """Rewrite an entry, and its index's record of it with its new SHA-256 (a forged pair: an entry
    changed alone is not the one its index names, a miss before anything decodes)."""
    body = json.dumps(doc).encode()
    payload = struct.pack("<Q", len(body)) + body + rest
    path.write_bytes(disk.MAGIC + hashlib.sha256(payload).digest() + payload)
    for index in path.parent.glob("jitidx-*.bin"):
        idoc, irest = _read(index)
        for record in idoc["data"]:
            if path.name == f"jit-{record[1]}.bin":
                record[3] = hashlib.sha256(payload).hexdigest()
                body = json.dumps(idoc).encode()
                ipayload = struct.pack("<Q", len(body)) + body + irest
                index.write_bytes(disk.MAGIC + hashlib.sha256(ipayload).digest() + ipayload)


def _one_entry(cache_dir, fn=scaled, args=None):
    args = args or (torch.randn(3, requires_grad=True), torch.randn(3))
    check(fn, args, compile=jit_compile)
    (path,) = sorted(cache_dir.glob("jit-*.bin"))
    return path, args


def test_no_object_deserialiser_in_the_package():
    found = subprocess.run(["grep", "-rn", "pickle", str(ROOT / "aotgrad")], capture_output=True, text=True).stdout
    assert found == "", found


_CRAFTED = {
    "an operator outside the allowlist": lambda node: node.__setitem__(2, {"op": "aten::_print.default"}),
    "a Python function by module path": lambda node: node.__setitem__(2, {"py": "builtins.exec"}),
    "an import through the target": lambda node: node.__setitem__(2, {"py": "os.system"}),
}


@pytest.mark.parametrize("edit", sorted(_CRAFTED))
def test_a_crafted_graph_target_is_refused_and_the_call_compiles(cache_dir, edit):
    path, args = _one_entry(cache_dir)
    doc, rest = _read(path)
    node = next(n for n in doc["data"]["joint"]["nodes"] if n[0] == "call_function")
    _CRAFTED[edit](node)
    _write(path, doc, rest)
    run = check(scaled, args, compile=jit_compile)
    assert not run.compiled.entries[0].loaded
    assert "ExportFormatError" in aotgrad.explain(run.compiled)


def test_crafted_size_text_is_never_evaluated(cache_dir):
    path, args = _one_entry(cache_dir)
    doc, rest = _read(path)
    payload = "__import__('tests.guards.test_disk_format').guards.test_disk_format.RAN.append(1)"
    name = next(iter(doc["data"]["joint"]["values"]))
    doc["data"]["joint"]["values"][name] = {"@": "SymText", "expr": payload}
    doc["data"]["joint"]["symbols"] = {"s0": 3}
    _write(path, doc, rest)
    run = check(scaled, args, compile=jit_compile)
    assert not run.compiled.entries[0].loaded and RAN == []


@pytest.mark.parametrize("text, ok", [("s0", True), ("2*s0 + 1", True), ("FloorDiv(s0, 2)", True),
                                      ("Max(1, s0*s1)", True), ("s0**2", True),
                                      ("__import__('os')", False), ("s0.__class__", False), ("eval(s0)", False),
                                      ("lambda: 1", False), ("s0; 1", False), ("'s0'", False), ("exec", False)])
def test_size_text_check(text, ok):
    assert symbolic.text_ok(text) is ok


def _symbols():
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing, PythonMod
    from torch.utils._sympy.numbers import int_oo
    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, nonnegative=True)
    return [s0, 2 * s0 + 1, FloorDiv(s0, 2) * s1, ModularIndexing(s0, 1, 4), PythonMod(s0, 3), sympy.Eq(s0, 3),
            sympy.Ne(s1, 1), sympy.And(sympy.Ge(s0, 2), sympy.Le(s1, 7)), sympy.Max(s0, s1), sympy.Rational(1, 2) * s0,
            sympy.Lt(s0, int_oo), sympy.true]


@pytest.mark.parametrize("i", range(len(_symbols())))
def test_symbolic_values_round_trip_exactly(i):
    e = _symbols()[i]
    data = json.loads(json.dumps(codec.encode((e, [e]))))
    back = codec.decode(data, symbolic=True)
    assert back == (e, [e]) and back[0].free_symbols == e.free_symbols
    with pytest.raises(ExportFormatError, match="symbolic"):
        codec.decode(data)                       # an export artifact is static


@pytest.mark.parametrize("data", [{"expr": ["builtins.eval", ["1"]]}, {"expr": ["sympy.Function", []]},
                                  {"symbol": ["__class__", {}]}, {"symbol": ["s0", {"__init__": True}]},
                                  {"expr": ["sympy.Add", [{"tuple": []}]]}, {"number": "E"}])
def test_a_crafted_expression_is_refused(data):
    with pytest.raises(ExportFormatError):
        codec.decode(data, symbolic=True)


def test_a_dynamic_entry_round_trips_through_the_file(cache_dir):
    def f(x):
        return (x[: x.shape[0] // 2] * 2).sin().sum()
    first = aotgrad.jit(f, dynamic=True)
    for n in (4, 6):
        check(f, (torch.randn(n, requires_grad=True),), compile=lambda fn, a, k: first)
    again = aotgrad.jit(f, dynamic=True)
    for n in (4, 10):       # the key holds the first call's sizes; the loaded entry serves another
        check(f, (torch.randn(n, requires_grad=True),), compile=lambda fn, a, k: again)
    assert [e.loaded for e in again.entries] == [True]
    doc, _ = _read(next(cache_dir.glob("jit-*.bin")))
    assert doc["data"]["joint"]["symbols"], "the stored joint is symbolic"
