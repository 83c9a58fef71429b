"""The on-disk cache's files: compiled entries a later process loads instead of capturing and
compiling again, and the indexes that find them.

An entry lives in one file named by its kind and key: ``MAGIC``, the SHA-256 of the payload, then
the payload: the length of a JSON document, the document (values as :mod:`.codec` writes them, and
a table of tensors) and the tensors' raw bytes (:mod:`.tensors`). Reading one parses JSON and builds
only what the codec names: a cache directory someone else can write may hold wrong graphs, never
code that runs (no object deserialiser, no ``eval``; a graph calls only operators the export allowlist admits).
Writes go to a temporary file renamed over the entry (atomic on POSIX and Windows), so concurrent
writers of one key each leave a whole file and readers never see half of one; a file that fails its
checksum or does not decode is reported once per process, ignored, and rewritten by the next store.

A ``jit`` compile is found in two steps (keys and fingerprints: :mod:`aotgrad.guards.cache`): the
index named by ``jit_key`` lists stored entries, each with the reads its trace made as paths and
fingerprints; :func:`load_jit` resolves those paths again in this process and loads an entry only
when every fingerprint matches and the objects reached are the same ones among themselves.

``AOTGRAD_CACHE=0`` disables the cache; ``AOTGRAD_CACHE_DIR`` moves it from ``~/.cache/aotgrad``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import uuid
import warnings
from pathlib import Path

from ..scoped import GC_PAUSED
from ..guards.cache import JitKey, Uncacheable, _difference, _failed_read, _text, digest, identities, read_fp
from . import tensors as tensor_io

log = logging.getLogger("aotgrad.cache")

MAGIC = b"AOTGRAD\x02"
_DIGEST = 32
_LENGTH = struct.Struct("<Q")
_warned: set = set()       # process-wide on purpose: warn once per store path per process


def enabled() -> bool:
    return os.environ.get("AOTGRAD_CACHE", "1") != "0"


def cache_dir() -> Path:
    return Path(os.environ.get("AOTGRAD_CACHE_DIR") or Path.home() / ".cache" / "aotgrad")


def entry_path(kind: str, key: str) -> Path:
    return cache_dir() / f"{kind}-{key}.bin"


def load(kind: str, key: str, decode=None, sha: str | None = None):
    """``decode(data, tensors)`` of the stored entry (its JSON data as read, by default), or None when
    absent, disabled, not the payload ``sha`` names (an index's entry rewritten since), or corrupt
    (warned about once): a file that does not decode, whatever the error, is a miss, never a crash."""
    if not enabled():
        return None
    path = entry_path(kind, key)
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    payload = blob[len(MAGIC) + _DIGEST:]
    checksum = hashlib.sha256(payload).digest()
    if blob[:len(MAGIC)] != MAGIC or blob[len(MAGIC):len(MAGIC) + _DIGEST] != checksum:
        _corrupt(path, "its checksum does not match (truncated, overwritten or from another aotgrad)")
        return None
    if sha is not None and checksum.hex() != sha:
        log.info("not loading %s: it is not the entry its index names (rewritten since)", path.name)
        return None
    try:
        with GC_PAUSED():       # a large document's objects would trigger full collections as they are made
            return _decoded(payload, decode)
    except Exception as e:      # data from disk: anything it makes a decoder raise is a malformed file
        _corrupt(path, f"it does not decode ({type(e).__name__}: {e})")
        return None


def _decoded(payload: bytes, decode):
    (n,) = _LENGTH.unpack_from(payload)
    doc = json.loads(payload[_LENGTH.size:_LENGTH.size + n])
    blob = payload[_LENGTH.size + n:]
    tensor_io.check_extent(doc["tensors"], len(blob))
    tensors = tensor_io.unpack(blob, doc["tensors"])
    return doc["data"] if decode is None else decode(doc["data"], tensors)


def store(kind: str, key: str, data, tensors: dict | None = None) -> str | bool:
    """Write ``data`` (JSON data: what ``codec`` encodes, or plain tuples of plain values) and
    ``tensors`` atomically: the payload's SHA-256 (hex), or False (and a log line) when it cannot be written."""
    if not enabled():
        return False
    path = entry_path(kind, key)
    try:
        with GC_PAUSED():
            blob, table = tensor_io.pack(tensors or {})
            doc = json.dumps({"data": data, "tensors": table}, separators=(",", ":"), allow_nan=False).encode()
    except (ValueError, TypeError) as e:  # some value in the entry is not data
        log.info("not caching %s on disk: %s: %s", path.name, type(e).__name__, e)
        return False
    payload = _LENGTH.pack(len(doc)) + doc + blob
    checksum = hashlib.sha256(payload).digest()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC + checksum + payload)
        os.replace(tmp, path)
        return checksum.hex()
    except OSError as e:
        log.warning("cannot write aotgrad cache entry %s: %s", path, e)
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def _corrupt(path, why) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"aotgrad: ignoring the cache entry {path} because {why}; it will be rewritten",
                      stacklevel=4)


# ---------------------------------------------------------------- jit entries and their index

def _sha(v) -> str:
    return hashlib.sha256(repr(v).encode()).hexdigest()


def store_jit(key: JitKey, reads, entry: tuple) -> bool:
    """Store ``entry`` (``(document, tensors)``: ``export.entry.dump_compiled``) under the index ``key``
    with the reads it assumed (kept: the 8 newest)."""
    lost = next((r for r in reads if r.path is None), None)
    if lost is not None:
        log.info("not caching on disk: the trace read `%s`, which a fresh process cannot find again "
                 "(reached through objects with no path from its roots)", lost.source)
        return False
    lossy = next((r for r in reads if _plain(r.path) != r.path), None)
    if lossy is not None:       # a key JSON cannot write (``os.environ``'s bytes): read back, it would name another
        log.info("not caching on disk: the path of `%s` holds a key the index cannot write", lossy.source)
        return False
    try:
        record = _plain(tuple((r.path, r.kind, r.source, read_fp(r)) for r in reads))
    except Uncacheable as e:
        log.info("not caching on disk: %s", e)
        return False
    same = identities(reads)
    entry_key = _entry_key(key, record, same)
    sha = store("jit", entry_key, *entry)
    if not sha:
        return False
    index = [v for v in _records(_load_plain("jitidx", key.digest), key) if v[1] != entry_key][-7:]
    store("jitname", _sha(key.name), _plain(key.parts))
    return bool(store("jitidx", key.digest, index + [(record, entry_key, same, sha)]))


def _entry_key(key: JitKey, record, same) -> str:
    """An entry's name: the digest of its index record as read back, so a record changed on disk
    (a read dropped, a value edited) names no entry and is not used."""
    return digest("jit entry", key.digest, record, same)


def _plain(v):
    """Fingerprints as nested tuples of plain values: written as JSON arrays (the C encoder's own speed)
    and read back as tuples (a sorted list in a key part compares as the tuple it is read as). A value
    JSON does not write (a dtype among a key's modes) becomes its ``repr``, in the newest-key record
    only, which explains a miss; the index's fingerprints are plain already (``read_fp``)."""
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    if v is None or isinstance(v, (bool, int, str)) or isinstance(v, float) and math.isfinite(v):
        return v
    return repr(v)


def _load_plain(kind: str, key: str):
    return load(kind, key, decode=lambda data, tensors: _plain(data))


def load_jit(key: JitKey, reresolve, why: list):
    """``((document, tensors), reads)`` of the newest stored entry whose reads, found again by
    ``reresolve([(path, kind, source), ...])``, all fingerprint as they did; else None, with
    the reason each stored entry was not used appended to ``why``. A malformed index record or entry
    is a miss (reported), never the call's failure."""
    index = _records(_load_plain("jitidx", key.digest), key)
    if not index:
        why.append(_key_miss(key))
        return None
    for record, entry_key, same, sha in reversed(index):
        try:
            reads = _holding(record, same, reresolve, why)
        except Exception as e:      # a record this process cannot follow: a miss
            log.warning("aotgrad: cannot check the stored entry jit-%s (%s: %s); compiling", entry_key[:12],
                        type(e).__name__, e)
            why.append(f"the stored entry jit-{entry_key[:12]}... cannot be checked ({type(e).__name__}: {e})")
            continue
        if reads is None:
            continue
        entry = load("jit", entry_key, decode=lambda doc, tensors: (doc, tensors), sha=sha)
        if entry is not None:
            return entry, reads
        why.append(f"the stored entry jit-{entry_key[:12]}... is missing, unreadable or not the one indexed")
    return None


def _holding(record, same, reresolve, why):
    """The reads of ``record`` found again in this process when all of them hold as stored, else None
    (and why)."""
    stored = [(p, k, s) for p, k, s, _ in record]
    reads = reresolve(stored)
    if reads is None:
        gone = next((s for p, k, s in stored if reresolve([(p, k, s)]) is None), "a read")
        why.append(f"`{gone}`, which the stored entry read, is not found in this process")
        return None
    failed = _failed_read(reads, record)
    if failed is None and identities(reads) != same:
        failed = ("the objects the trace read are not the same ones as when stored (`x is y` between "
                  "them differs), though each looks the same")
    if failed is not None:
        why.append(failed)
        return None
    return reads


# ---------------------------------------------------------------- what a well-formed index holds

_HEX = re.compile(r"[0-9a-f]{64}")
_STEPS = frozenset(("attr", "item", "cell", "class", "own"))     # the steps ``guards.resolve`` writes in a path (``guards.places``)


def _records(index, key: JitKey) -> list:
    """The well-formed records of a jit index as read (``_plain``); a malformed one is reported once
    and skipped: its paths and keys are data a fresh process follows, so their shapes are checked first."""
    if index is None:
        return []
    good = [r for r in index if _record_ok(r) and _entry_key(key, r[0], r[2]) == r[1]] \
        if isinstance(index, tuple) else []
    if not isinstance(index, tuple) or len(good) < len(index):
        _corrupt(entry_path("jitidx", key.digest), "some of its records are malformed")
    return good


def _record_ok(r) -> bool:
    if not isinstance(r, tuple) or len(r) != 4:
        return False
    record, entry_key, same, sha = r
    return all(isinstance(h, str) and _HEX.fullmatch(h) for h in (entry_key, sha)) \
        and isinstance(same, tuple) and all(type(i) is int and i >= 0 for i in same) \
        and isinstance(record, tuple) and all(_read_ok(x) for x in record)


def _read_ok(x) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and _path_ok(x[0]) and isinstance(x[1], str) and isinstance(x[2], str)


def _path_ok(path) -> bool:
    """``(root, arg, *steps)``: the function (``fn``, None), an input (``arg``, its index), a name
    (``G``, a module's) or ``Module.__call__`` (``module call``, None), and ``(kind, key)`` steps whose
    keys are plain values."""
    if not isinstance(path, tuple) or len(path) < 2 or not isinstance(path[0], str):
        return False
    root, arg, *steps = path
    if not (type(arg) is int and arg >= 0 if root == "arg" else arg is None if root in ("fn", "module call")
            else type(arg) is str):
        return False
    return all(isinstance(s, tuple) and len(s) == 2 and s[0] in _STEPS and _key_ok(s[1]) for s in steps)


def _key_ok(k) -> bool:
    return k is None or type(k) in (bool, int, float, str) or isinstance(k, tuple) and all(map(_key_ok, k))


def _key_miss(key: JitKey) -> str:
    """Why no entry is stored under ``key``: the parts that differ from the newest stored for its program."""
    newest = _load_plain("jitname", _sha(key.name))
    if newest is None:
        return f"nothing is stored for {key.name}"
    if not isinstance(newest, tuple) or any(not isinstance(p, tuple) or len(p) != 2 for p in newest):
        return f"no entry is stored under this key (the record of the newest one stored for {key.name} is malformed)"
    differ = []
    for (label, now), (_, was) in zip(_plain(key.parts), newest):
        if now != was:
            where, a, b = _difference(was, now)
            differ.append(f"{label} ({_text(a)} when stored, now {_text(b)}{f' at {where}' if where else ''})")
    return (f"no entry is stored under this key: {'; '.join(differ) or 'its key'} differ"
            f"{'s' if len(differ) == 1 else ''} from the newest entry stored for {key.name}")
