"""The disk cache's readers take whatever the directory holds: an index record or entry with a valid
checksum and a malformed body (wrong types, other values, paths outside the cache directory or of
another shape, truncated JSON, a missing file) is a miss, reported, and the call compiles afresh and
trains like eager; never a crash, never a stale graph."""
import hashlib
import json
import struct
import warnings

import pytest
import torch

import aotgrad
from aotgrad.store import disk
from tests.eager_check import check

SCALE = 2.0
BAD = (None, -1, 7, 1.5, True, "x", "../../../etc/passwd", "/tmp", [], [[]], {"a": 1}, "0" * 64)


def scaled(x, y):
    return (x * SCALE).sin() + y.cos() * 3


def jit_compile(fn, args, kwargs, **opts):
    return aotgrad.jit(fn, **opts)


def _read(path):
    payload = path.read_bytes()[len(disk.MAGIC) + 32:]
    (n,) = struct.unpack_from("<Q", payload)
    return json.loads(payload[8:8 + n]), payload[8 + n:]


def _write(path, doc, rest=b"", body=None):
    body = json.dumps(doc).encode() if body is None else body
    payload = struct.pack("<Q", len(body)) + body + rest
    path.write_bytes(disk.MAGIC + hashlib.sha256(payload).digest() + payload)
    return hashlib.sha256(payload).hexdigest()


@pytest.fixture
def stored(cache_dir, monkeypatch):
    """One stored entry, the key and re-resolver its lookup used, and the index and entry files."""
    args = (torch.randn(3, requires_grad=True), torch.randn(3))
    check(scaled, args, compile=jit_compile)
    seen = []
    real = disk.load_jit
    monkeypatch.setattr(disk, "load_jit", lambda key, rr, why: seen.append((key, rr)) or real(key, rr, why))
    assert check(scaled, args, compile=jit_compile).compiled.entries[0].loaded
    key, reresolve = seen[0]
    index = disk.entry_path("jitidx", key.digest)
    doc, _ = _read(index)
    (record,) = doc["data"]
    return args, key, reresolve, index, doc, disk.entry_path("jit", record[1])


def _places(v, at=(), depth=6):
    """Every position in a JSON value, up to ``depth`` deep."""
    yield at
    if depth and isinstance(v, list):
        for i, x in enumerate(v):
            yield from _places(x, at + (i,), depth - 1)


def _get(v, at):
    for i in at:
        v = v[i]
    return v


def _mutations(data):
    """``(position, how, data)``: each position replaced by each bad value, or dropped, or doubled."""
    for at in _places(data):
        for bad in BAD:
            if at:
                new = json.loads(json.dumps(data))
                _get(new, at[:-1])[at[-1]] = bad
                if json.dumps(new) != json.dumps(data):
                    yield at, repr(bad), new
        if at:
            for how in ("drop", "double"):
                new = json.loads(json.dumps(data))
                parent = _get(new, at[:-1])
                parent.insert(at[-1], parent[at[-1]]) if how == "double" else parent.pop(at[-1])
                yield at, how, new


def test_every_mutated_index_record_is_a_miss(stored):
    _, key, reresolve, index, doc, _ = stored
    n = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # reported once per file; counted below instead
        for at, how, data in _mutations(doc["data"]):
            _write(index, {**doc, "data": data})
            why: list = []
            found = disk.load_jit(key, reresolve, why)
            if found is None:
                assert why, (at, how)
                n += 1
            else:       # a record stored twice is the same record
                assert at == (0,) and how == "double", (at, how)
    assert n > 300, n


def test_a_mutated_entry_body_is_a_miss_even_with_a_valid_checksum(stored):
    _, key, reresolve, _, _, entry = stored
    doc, rest = _read(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for field in [*doc["data"], "tensors"]:
            for bad in BAD:
                _write(entry, {**doc, "data": {**doc["data"], field: bad}} if field != "tensors"
                       else {**doc, "tensors": bad}, rest)
                why: list = []
                assert disk.load_jit(key, reresolve, why) is None, (field, bad)
                assert "not the one indexed" in why[-1]


@pytest.mark.parametrize("field", ["setup_descs", "session", "joint", "partition", "analysis", "layout", "guards",
                                   "out_spec", "descs"])
def test_an_entry_its_index_names_with_wrong_types_is_a_miss_not_a_crash(stored, field):
    """A body and index rewritten together (a forged pair): whatever the field holds, the call does not
    fail and returns eager's numbers (the entry does not rebuild and the call compiles, or, where the
    value still means something, such as no stored partition, it loads)."""
    args, _, _, index, idoc, entry = stored
    doc, rest = _read(entry)
    loaded = []
    for bad in (None, 7, "x", [[]], {"a": 1}):
        sha = _write(entry, {**doc, "data": {**doc["data"], field: bad}}, rest)
        idoc["data"][0][3] = sha
        _write(index, idoc)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded.append(check(scaled, args, compile=jit_compile).compiled.entries[0].loaded)
    assert loaded.count(True) <= (field == "partition"), loaded


def _truncated_index(index, idoc, entry):
    _write(index, None, body=json.dumps(idoc).encode()[:-7])


def _entry_gone(index, idoc, entry):
    entry.unlink()


def _entry_key_outside(index, idoc, entry):
    idoc["data"][0][1] = "../" * 6 + "tmp/" + entry.name
    _write(index, idoc)


def _path_outside(index, idoc, entry):
    idoc["data"][0][0][0][0] = ["G", "os", ["attr", "../../etc"]]
    _write(index, idoc)


def _index_of_strings(index, idoc, entry):
    _write(index, {**idoc, "data": "a string"})


def _record_of_a_dict(index, idoc, entry):
    _write(index, {**idoc, "data": [{"path": 1}]})


def _negative_argument(index, idoc, entry):
    idoc["data"][0][0][0][0] = ["arg", -1, ["attr", "x"]]
    _write(index, idoc)


def _newest_key_malformed(index, idoc, entry):
    name = next(index.parent.glob("jitname-*.bin"))
    _write(name, {"data": [1, [2]], "tensors": {}})
    index.unlink()


@pytest.mark.parametrize("damage", [_truncated_index, _entry_gone, _entry_key_outside, _path_outside,
                                    _index_of_strings, _record_of_a_dict, _negative_argument,
                                    _newest_key_malformed])
def test_a_damaged_cache_compiles_afresh_then_serves_again(stored, damage):
    args, _, _, index, idoc, entry = stored
    damage(index, idoc, entry)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        run = check(scaled, args, compile=jit_compile)
    assert not run.compiled.entries[0].loaded and run.compiled.entries[0].disk
    assert check(scaled, args, compile=jit_compile).compiled.entries[0].loaded      # rewritten whole
