"""Fuzzing the loader: a file anyone can hand you must not touch the file system, the network or
the process (docs/export-format.md, "Loading is safe by construction").

Two real artifacts (a small MLP; a model with BatchNorm and dropout) are mutated, seeded and
bounded: manifest fields (types, values, missing and extra keys), operator names (real aten ops,
among them ``from_file``, ``_local_scalar_dense``, ``set_``, ``resize_``, ``save``, ``_print``,
profiler ops), node arguments, shapes/strides/dtypes, tensor bytes (truncated, extended, flipped)
and zip members (missing, duplicated, extra, ``../x`` names, links). Each mutated file, loaded in
a temporary working directory with pickle disabled, is either refused with a typed
``ExportFormatError`` or trains 3 SGD steps exactly like eager with the parameters it loaded
(``tests/eager_check.check_training``); a mutation of what a graph computes (an argument value, an
operator swapped together with the operator table) may also make a well-formed other program,
which must then run without an untyped error. No file in the test's directories is created or
changed, whatever the outcome. ``make test`` runs a fast subset; the sweep is marked slow.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import pickle
import random
import stat
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad.errors import AotgradError, ExportFormatError
from tests.eager_check import check_training


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class BNDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.drop, self.out = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.25), nn.Linear(6, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(self.drop(self.bn(self.lin(x)).relu())), y)


MODELS = {"mlp": (MLP, lambda g: (torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))),
          "bn": (BNDrop, lambda g: (torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)))}
# Ops a crafted graph may try; each must be refused at load (ops.refusal says why).
DANGEROUS = ["aten::from_file.default", "aten::set_.source_Storage", "aten::resize_.default", "aten::save.default",
             "aten::_print.default", "aten::copy_.default", "aten::_assert_async.msg", "aten::grad.default",
             "aten::_unsafe_index.Tensor", "aten::_unsafe_index_put.default", "aten::add_.Tensor",
             "aten::_functional_assert_async.msg", "profiler::_record_function_enter_new.default",
             "aotgrad::block_fw.default", "aotgrad::block_bw.default", "aotgrad::tensor_hook.default"]
HARMLESS = ["aten::_local_scalar_dense.default", "aten::sigmoid.default", "aten::neg.default", "aten::clone.default"]
SEMANTIC = ("arg", "op_table")   # mutations of what a graph computes: may make another well-formed program
KINDS = ("manifest", "manifest", "op", "op_table", "attack", "arg", "meta", "consistent_shape", "blob", "zip")
VALUES = [None, -1, 0, 1, 10 ** 12, 1.5, "x", "../x", [], {}, {"tuple": [1]}, {"@": "Desc"}, True, False,
          {"device": "cpu"}, {"dtype": "float64"}, {"node": "t"}, [1, 2], {"tuple": []}]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = {}
    for name, (cls, batch) in MODELS.items():
        torch.manual_seed(0)
        model, args = cls(), batch(torch.Generator().manual_seed(1))
        path = str(tmp_path_factory.mktemp("fuzz") / f"{name}.aotgrad")
        aotgrad.capture(model, *args).export(path)
        with zipfile.ZipFile(path) as z:
            out[name] = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    return out


def _all_ops() -> list:
    if not hasattr(_all_ops, "cache"):
        _all_ops.cache = sorted({f"{s.name}.{s.overload_name or 'default'}" for s in torch._C._jit_get_all_schemas()
                                 if s.name.startswith("aten::")})
    return _all_ops.cache


def _schema(name: str):
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    op = getattr(getattr(getattr(torch.ops, ns, None), base, None), overload, None)
    return str(op._schema) if op is not None else None


def _json_members(members):
    return {n: json.loads(d) for n, d in members if n.endswith(".json")}


def _with_json(members, docs):
    return [(n, json.dumps(docs[n]).encode() if n in docs else d, None) for n, d in members]


def _paths(obj, path=()):
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, path + (k,))


def _at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _calls(docs, rng):
    graph = rng.choice([n for n in docs if n.startswith("graphs/")])
    return graph, [n for n in docs[graph]["nodes"] if n[0] == "call_function"]


# --- mutations: each returns (label, members as (name, bytes, zip attr or None)) -----------------

def _manifest(members, rng):
    docs = _json_members(members)
    m = docs["manifest.json"]
    where = rng.choice([p for p in _paths(m) if p])
    parent, key = _at(m, where[:-1]), where[-1]
    action = rng.choice(["set", "set", "delete", "extra"])
    if action == "set":
        parent[key] = rng.choice(VALUES)
    elif action == "delete":
        parent.pop(key) if isinstance(parent, dict) else parent.pop(key)
    elif isinstance(parent, dict):
        parent["extra_key"] = rng.choice(VALUES)
    else:
        parent.append(rng.choice(VALUES))
    return f"manifest {action} {where}", _with_json(members, docs)


def _swap_op(members, rng, table: bool, pool=None):
    docs = _json_members(members)
    graph, calls = _calls(docs, rng)
    node = rng.choice(calls)
    op = rng.choice(pool or (DANGEROUS + HARMLESS + rng.sample(_all_ops(), 4)))
    old = node[2]
    node[2] = {"op": op}
    if table and _schema(op) is not None:
        ops = docs["manifest.json"]["ops"]
        ops[op] = _schema(op)
        if "op" in old and not any(n[2] == old for g in docs if g.startswith("graphs/")
                                   for n in docs[g]["nodes"] if n[0] == "call_function"):
            ops.pop(old["op"], None)
    return f"{graph} {node[1]}: {old} -> {op}{' (table too)' if table else ''}", _with_json(members, docs), op


def _attack(members, rng, victim):
    """A graph that maps a file (``from_file(shared=True)``) and copies a stored constant into it, or
    calls another refused op, with the operator table made to agree."""
    docs = _json_members(members)
    graph = rng.choice([n for n in docs if n.startswith("graphs/")])
    nodes = docs[graph]["nodes"]
    target = str(victim / rng.choice(["pwned", "existing.txt"]))
    ff = ["call_function", "ff", {"op": "aten::from_file.default"}, {"tuple": [target, True, 16]},
          {"dict": {"dtype": {"dtype": "float32"}}}]
    src = next((n[1] for n in nodes if n[0] == "placeholder"), None)
    extra = {"copy": [ff, ["call_function", "cp", {"op": "aten::copy_.default"},
                           {"tuple": [{"node": "ff"}, {"node": "ff"}]}, {"dict": {}}]],
             "from_file": [ff],
             "print": [["call_function", "pr", {"op": "aten::_print.default"}, {"tuple": [target]}, {"dict": {}}]],
             "save": [["call_function", "sv", {"op": "aten::save.default"}, {"tuple": [{"node": src}, target]},
                       {"dict": {}}]],
             "set_": [["call_function", "st", {"op": "aten::set_.source_Tensor"},
                       {"tuple": [{"node": src}, {"node": src}]}, {"dict": {}}]],
             "resize_": [["call_function", "rs", {"op": "aten::resize_.default"},
                          {"tuple": [{"node": src}, [1000]]}, {"dict": {}}]],
             "item": [["call_function", "it", {"op": "aten::_local_scalar_dense.default"}, {"tuple": [{"node": src}]},
                       {"dict": {}}]]}
    kind = rng.choice(sorted(extra))
    nodes[-1:-1] = extra[kind]
    if rng.random() < 0.8:
        for n in extra[kind]:
            if _schema(n[2]["op"]):
                docs["manifest.json"]["ops"][n[2]["op"]] = _schema(n[2]["op"])
    return f"{graph}: inserted {kind} of {target}", _with_json(members, docs)


def _arg(members, rng):
    docs = _json_members(members)
    graph, calls = _calls(docs, rng)
    node = rng.choice(calls)
    args = node[3]["tuple"]
    if not args:
        return f"{graph} {node[1]}: no argument", _with_json(members, docs)
    i = rng.randrange(len(args))
    names = [n[1] for n in docs[graph]["nodes"]]
    choices = [0, -1, 1, 2, 10 ** 9, -10 ** 9, 0.5, 1.5, -0.5, {"float": "nan"}, True, None, [],
               [1, 2], {"node": rng.choice(names)}, "x"]
    if isinstance(args[i], list):
        choices += [args[i][:-1], args[i] + [1]]
    args[i] = rng.choice(choices)
    return f"{graph} {node[1]} arg {i} -> {args[i]!r:.40}", _with_json(members, docs)


def _meta(members, rng):
    docs = _json_members(members)
    m = docs["manifest.json"]
    where = rng.choice(["tensors", "state", "guards", "values"])
    new = rng.choice([[], [1], [2, 2], [10 ** 6], [-1], [0], [3, 4, 5]])
    if where == "tensors":
        e = m["tensors"][rng.choice(sorted(m["tensors"]))]
        field = rng.choice(["shape", "stride", "dtype", "device"])
        e[field] = rng.choice(["float64", "int8", "bool", "complex64"]) if field == "dtype" else \
            rng.choice(["cuda:0", "meta", "cpu:1", "disk"]) if field == "device" else new
    elif where == "state":
        e = rng.choice(m["state"])
        field = rng.choice(["shape", "dtype", "requires_grad"])
        e[field] = {"shape": new, "dtype": "float64", "requires_grad": not e["requires_grad"]}[field]
    elif where == "guards":
        e = rng.choice(m["guards"])
        field = rng.choice(["size", "layout", "dtype", "requires_grad"])
        e[field] = {"size": {"tuple": new}, "layout": {"tuple": new + [0]}, "dtype": {"dtype": "float16"},
                    "requires_grad": not e["requires_grad"]}[field]
    else:
        graph = rng.choice([n for n in docs if n.startswith("graphs/")])
        values = docs[graph]["values"]
        name = rng.choice(sorted(values))
        v = values[name] if values[name].get("@") else None
        if v is None:
            return f"{graph} {name}: not a tensor", _with_json(members, docs)
        field = rng.choice(["shape", "stride", "offset", "dtype"])
        v[field] = {"shape": {"tuple": new}, "stride": {"tuple": new}, "offset": 1,
                    "dtype": {"dtype": "float64"}}[field]
    return f"{where} {field} -> changed", _with_json(members, docs)


def _consistent_shape(members, rng):
    """One parameter one row larger everywhere the manifest, tensor table, bytes and its graph input say it."""
    docs, blob = _json_members(members), dict(members)["tensors.bin"]
    m = docs["manifest.json"]
    i = rng.randrange(len(m["state"]))
    e, g = m["state"][i], m["guards"][i]
    t = m["tensors"][f"state/{e['name']}"]
    shape = [t["shape"][0] + 1, *t["shape"][1:]] if t["shape"] else [2]
    stride = [math_prod(shape[k + 1:]) for k in range(len(shape))]
    grow = math_prod(shape) * t["nbytes"] // max(math_prod(t["shape"]), 1) - t["nbytes"]
    for other in m["tensors"].values():
        if other["start"] > t["start"]:
            other["start"] += grow
    end = t["start"] + t["nbytes"]
    blob = blob[:end] + bytes(grow) + blob[end:]
    m["tensors_sha256"] = hashlib.sha256(blob).hexdigest()
    t.update(shape=shape, stride=stride, nbytes=t["nbytes"] + grow)
    e["shape"] = shape
    g["size"], g["layout"] = {"tuple": shape}, {"tuple": stride + [0]}
    placeholder = [n[1] for n in docs["graphs/joint.json"]["nodes"] if n[0] == "placeholder"][i]
    for name, doc in docs.items():
        if name.startswith("graphs/") and placeholder in doc["values"]:
            doc["values"][placeholder].update(shape={"tuple": shape}, stride={"tuple": stride})
    out = [(n, blob if n == "tensors.bin" else d, a) for n, d, a in _with_json(members, docs)]
    return f"{e['name']} shape -> {shape} everywhere", out


def math_prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def _blob(members, rng):
    blob = dict(members)["tensors.bin"]
    action = rng.choice(["truncate", "extend", "flip", "flip"])
    if action == "truncate":
        blob = blob[:rng.randrange(len(blob))]
    elif action == "extend":
        blob = blob + bytes(rng.randrange(1, 64))
    else:
        at = rng.randrange(len(blob))
        blob = blob[:at] + bytes([blob[at] ^ (1 << rng.randrange(8))]) + blob[at + 1:]
    return f"tensors.bin {action}", [(n, blob if n == "tensors.bin" else d, None) for n, d in members]


def _zip(members, rng, victim):
    out = [(n, d, None) for n, d in members]
    action = rng.choice(["missing", "duplicate", "duplicate_other", "extra", "traversal", "symlink", "dir"])
    k = rng.randrange(len(out))
    name = out[k][0]
    if action == "missing":
        out.pop(k)
    elif action == "duplicate":
        out.append(out[k])
    elif action == "duplicate_other":
        out.append((name, b"{}" if name.endswith(".json") else b"\0" * 8, None))
    elif action == "extra":
        out.append((rng.choice(["extra.txt", "graphs/other.json", "manifest.json.bak"]), b"{}", None))
    elif action == "traversal":
        out.append((rng.choice(["../x", "../../pwned", "/tmp/pwned", "graphs/../../x"]), b"pwned", None))
    elif action == "symlink":
        link = rng.choice([name, "extra"])
        out = [o for o in out if o[0] != link] + [(link, str(victim / "existing.txt").encode(),
                                                    (stat.S_IFLNK | 0o777) << 16)]
    else:
        out.append(("graphs/", b"", (stat.S_IFDIR | 0o755) << 16 | 0x10))
    return f"zip {action} {name}", out


def mutate(members, rng, kind, victim):
    if kind == "manifest":
        return _manifest(members, rng)
    if kind in ("op", "op_table"):
        return _swap_op(members, rng, table=kind == "op_table")[:2]
    if kind == "attack":
        return _attack(members, rng, victim)
    return {"arg": _arg, "meta": _meta, "consistent_shape": _consistent_shape, "blob": _blob}[kind](members, rng) \
        if kind != "zip" else _zip(members, rng, victim)


def _write(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data, attr in members:
            info = zipfile.ZipInfo(name)
            if attr is not None:
                info.external_attr = attr
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)     # a duplicated member is the point
                z.writestr(info, data)


# --- running one -------------------------------------------------------------------------------

def _files(root) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for f in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            data = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else os.readlink(p).encode()
            out[p] = hashlib.sha256(data).hexdigest()
    return out


@contextlib.contextmanager
def _no_unpickling(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the loader unpickled something")
    with monkeypatch.context() as mp:
        for name in ("load", "loads", "Unpickler"):
            mp.setattr(pickle, name, refuse)
        mp.setattr(torch, "load", refuse)
        yield


def _train_like_eager(step, cls, batch):
    """3 SGD steps of the loaded step next to eager with the parameters it loaded (by position)."""
    args = batch(torch.Generator().manual_seed(2))
    models = []

    def make():
        if not models:
            model = cls()
            with torch.no_grad():
                mine = [*step.parameters(), *step.buffers()]
                theirs = [*model.parameters(), *model.buffers()]
                assert len(mine) == len(theirs), "the loaded step has other parameters than eager"
                for a, b in zip(theirs, mine):
                    assert a.shape == b.shape and a.dtype == b.dtype, "a loaded parameter has another shape"
                    a.copy_(b)
            models.append(model)
            return model, args
        return step, args
    check_training(make, steps=3, compile=lambda fn, args, kwargs: fn)


def run_one(kind, label, path, cls, batch, monkeypatch, roots):
    """'refused', 'eager' or 'other program'; fails on an untyped error or a side effect."""
    before = {r: _files(r) for r in roots}
    try:
        with _no_unpickling(monkeypatch):
            try:
                step = aotgrad.load(path)
            except ExportFormatError:
                return "refused"
            try:
                _train_like_eager(step, cls, batch)
                return "eager"
            except AssertionError as e:
                if kind not in SEMANTIC or "unpickled" in str(e):
                    raise AssertionError(f"{label}: loaded and then differs from eager: {e}") from None
                return "other program"
            except AotgradError:
                if kind not in SEMANTIC:
                    raise
                return "other program"
    except (AssertionError, AotgradError):
        raise
    except Exception as e:      # an untyped error anywhere: a loader bug
        raise AssertionError(f"{label}: untyped {type(e).__name__}: {e}") from e
    finally:
        for r in roots:
            assert _files(r) == before[r], f"{label}: files changed under {r}"


def sweep(artifacts, name, count, tmp_path, monkeypatch, seed=0):
    cls, batch = MODELS[name]
    cwd, victim, work = tmp_path / "cwd", tmp_path / "victim", tmp_path / "work"
    for d in (cwd, victim, work):
        d.mkdir(exist_ok=True)
    (victim / "existing.txt").write_bytes(b"keep me")
    monkeypatch.chdir(cwd)
    counts = collections.Counter()
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        rng = random.Random(f"{seed}-{name}-{i}")
        label, members = mutate(artifacts[name], rng, kind, victim)
        path = str(work / "m.aotgrad")
        _write(path, members)
        outcome = run_one(kind, f"#{i} {kind}: {label}", path, cls, batch, monkeypatch, (cwd, victim, work))
        if kind == "attack" and "item" not in label or kind == "op" or (
                kind == "op_table" and any(op in label for op in DANGEROUS)) or kind == "consistent_shape":
            assert outcome == "refused", f"#{i} {kind}: {label} was not refused"
        counts[kind, outcome] += 1
        counts[outcome] += 1
    assert not os.listdir(cwd) and os.listdir(victim) == ["existing.txt"]
    return counts


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unmutated_artifact_trains_like_eager(artifacts, name, tmp_path):
    path = str(tmp_path / "a.aotgrad")
    _write(path, [(n, d, None) for n, d in artifacts[name]])
    _train_like_eager(aotgrad.load(path), *MODELS[name])


def test_value_an_operator_refuses_is_typed_when_it_runs(artifacts, tmp_path):
    """dropout's ``bernoulli(p=1e9)``: only the real kernel checks p, so the running step raises an
    ExportFormatError chained to ATen's error, and leaves the BatchNorm statistics as they were."""
    docs = _json_members(artifacts["bn"])
    node = next(n for n in docs["graphs/forward.json"]["nodes"] if n[2] == {"op": "aten::bernoulli.p"})
    node[3]["tuple"][1] = 1e9
    path = str(tmp_path / "p.aotgrad")
    _write(path, _with_json(artifacts["bn"], docs))
    step = aotgrad.load(path)
    before = {k: v.clone() for k, v in step.state_dict().items()}
    with pytest.raises(ExportFormatError, match="forward graph failed as it ran.*bernoulli") as info:
        step(*MODELS["bn"][1](torch.Generator().manual_seed(2)))
    assert isinstance(info.value.__cause__, RuntimeError)
    for k, v in step.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_input_guard_flipping_requires_grad_is_refused_at_load(artifacts, name, tmp_path):
    """The graphs differentiate the inputs the analysis says require grad: a guard saying otherwise
    (found by the sweep: it loaded, then refused every call) is an inconsistent artifact."""
    why = []
    for i, guard in enumerate(_json_members(artifacts[name])["manifest.json"]["guards"]):
        docs = _json_members(artifacts[name])
        docs["manifest.json"]["guards"][i]["requires_grad"] = not guard["requires_grad"]
        path = str(tmp_path / f"g{i}.aotgrad")
        _write(path, _with_json(artifacts[name], docs))
        with pytest.raises(ExportFormatError) as info:      # (a parameter's entry, an int input: refused before)
            aotgrad.load(path)
        why.append(str(info.value))
    assert any("disagree on which inputs require grad" in w for w in why), why


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fuzz_fast(artifacts, name, tmp_path, monkeypatch):
    counts = sweep(artifacts, name, 40, tmp_path, monkeypatch)
    print(f"\n{name}: {dict(counts)}")
    assert counts["refused"] > 0 and counts["eager"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fuzz_sweep(artifacts, name, tmp_path, monkeypatch):
    counts = sweep(artifacts, name, 400, tmp_path, monkeypatch, seed=1)
    print(f"\n{name}: {dict(counts)}")
    assert counts["refused"] > 0 and counts["eager"] > 0
