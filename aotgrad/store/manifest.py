"""The artifact's manifest: which format and version it is, and what a loader checks first."""
from __future__ import annotations

import json as json_module
import stat
import zipfile

import torch

from ..errors import ExportFormatError

FORMAT = "aotgrad-export"
VERSION = 3       # 2: descriptors are typed and nested ({"@": "ParamDesc", "name": ...}); 3: "modes", tensors_sha256
REQUIRED = ("name", "kind", "grad_enabled", "modes", "values", "state", "signature", "out_spec", "input_descs",
            "output_descs", "analysis", "layout", "guards", "partition", "graphs", "ops", "tensors", "tensors_sha256")


MEMBERS = ("manifest.json", "tensors.bin", "graphs/joint.json", "graphs/forward.json", "graphs/backward.json")


def check_members(z: zipfile.ZipFile, graphs=None) -> None:
    """Each member once, a plain file among :data:`MEMBERS` (no other name, no ``../x``, no link or
    folder); with ``graphs`` (the manifest's list), exactly the members the manifest names."""
    infos = z.infolist()
    names = [i.filename for i in infos]
    odd = [n for n in names if n not in MEMBERS] + sorted({n for n in names if names.count(n) > 1})
    odd += [i.filename for i in infos if i.is_dir() or stat.S_IFMT(i.external_attr >> 16) not in (0, stat.S_IFREG)]
    if odd:
        raise ExportFormatError(f"the artifact has members the format does not define, twice, or not as plain "
                                f"files: {sorted(set(odd))[:5]}")
    if graphs is not None and set(names) != {"manifest.json", "tensors.bin", *(f"graphs/{g}.json" for g in graphs)}:
        raise ExportFormatError(f"the artifact's members {sorted(names)} are not the ones its manifest names")


# The most a JSON member may inflate to: a graph of a large model is a few MiB (gpt_small's joint: 2 MiB).
JSON_LIMIT = 64 << 20


def read_entry(z: zipfile.ZipFile, name: str, json: bool = False, limit: int | None = None):
    """One member's bytes (its CRC checked by ``zipfile``), or its JSON. A member that inflates to more
    than ``limit`` bytes is refused before it is inflated (its header's size) and while it is (a
    header that lies: no more than ``limit + 1`` bytes are ever inflated)."""
    limit = JSON_LIMIT if limit is None else limit
    try:
        info = z.getinfo(name)
    except KeyError:
        raise ExportFormatError(f"the artifact has no {name} (it is truncated or not an aotgrad artifact)") from None
    if info.file_size > limit:
        raise ExportFormatError(f"the artifact's {name} inflates to {info.file_size} bytes, more than the "
                                f"{limit} its manifest allows (a zip bomb, or a corrupted file)")
    with z.open(info) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ExportFormatError(f"the artifact's {name} inflates to more than the {limit} bytes its header says")
    if not json:
        return data
    try:
        return json_module.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ExportFormatError(f"the artifact's {name} is not valid JSON ({e})") from None


def _minor(version: str) -> tuple:
    return tuple(version.split("+")[0].split(".")[:2])


def check_manifest(m) -> dict:
    """``m`` if this aotgrad and torch can load it; the reason otherwise, as an ``ExportFormatError``."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ExportFormatError("the file is not an aotgrad export artifact (its manifest names no "
                                f"format {FORMAT!r})")
    if m.get("version") != VERSION:
        raise ExportFormatError(f"the artifact uses export format version {m.get('version')!r}; this aotgrad "
                                f"reads version {VERSION}: export it again with this aotgrad")
    if not isinstance(m.get("torch"), str) or _minor(m["torch"]) != _minor(torch.__version__):
        raise ExportFormatError(f"the artifact was exported with torch {m.get('torch')}, this is torch "
                                f"{torch.__version__}: operator schemas differ between torch versions; export "
                                "it again with this torch")
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise ExportFormatError(f"the artifact's manifest lacks {', '.join(missing)}")
    # The two tables read before any other check (the tensor bytes, the graph members).
    if not isinstance(m["tensors"], dict) or not isinstance(m["graphs"], list) or type(m["tensors_sha256"]) is not str \
            or not all(type(g) is str and g in ("joint", "forward", "backward") for g in m["graphs"]) \
            or "joint" not in m["graphs"] or len(set(m["graphs"])) != len(m["graphs"]):
        raise ExportFormatError("the artifact's manifest has a malformed tensor or graph table")
    return m
