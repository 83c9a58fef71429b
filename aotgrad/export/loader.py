"""Reading an export artifact back: ``load(path)`` checks the manifest, unpacks the tensors and
graphs and hands them to :mod:`.rebuild`, which builds the ``Exported`` step. The writer
(:mod:`aotgrad.store.artifact`) imports no stage object, so ``Captured.export`` reaches it without a cycle."""
from __future__ import annotations

import time
import zipfile
import zlib

import torch

from .. import errors
from ..store import schema  # noqa: F401  (registers the stage metadata classes with the codec)
from ..store import tensors as tensor_io
from ..store.manifest import check_manifest, check_members, read_entry


def load(path: str, *, state: dict | None = None, placeholders: bool = False):
    """The ``Exported`` training step in the artifact at ``path``; ``state`` maps parameter and
    buffer names to tensors the step uses in place of the stored values (required for an artifact
    written with ``values=False``): ``dict(model.named_parameters())`` makes it train ``model``'s own.
    ``placeholders``: zeros for values neither the file nor ``state`` has (to inspect the graphs)."""
    start = time.perf_counter()
    try:
        with zipfile.ZipFile(path) as z:
            check_members(z)
            manifest = check_manifest(read_entry(z, "manifest.json", json=True))
            check_members(z, manifest["graphs"])
            size = tensor_io.check_extent(manifest["tensors"], z.getinfo("tensors.bin").file_size)  # before reading
            blob = read_entry(z, "tensors.bin", limit=size)
            tensor_io.check_digest(blob, manifest["tensors_sha256"])
            tensors = tensor_io.unpack(blob, manifest["tensors"])
            graphs = {k: read_entry(z, f"graphs/{k}.json", json=True) for k in manifest["graphs"]}
    except (zipfile.BadZipFile, EOFError, zlib.error, RecursionError) as e:
        raise errors.ExportFormatError(f"{path} is not a readable aotgrad artifact: it is corrupted or "
                                       f"truncated ({e})") from None
    except OSError as e:
        raise errors.ExportFormatError(f"cannot read the aotgrad artifact {path}: {e}") from None
    from .rebuild import build_exported
    try:
        if placeholders:
            state = {**_zeros(manifest), **(state or {})}
        return build_exported(path, manifest, graphs, tensors, state, start)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, RuntimeError) as e:
        # The checks cover each field; what they miss is still a malformed file, not a step to run
        # (the chained exception keeps the traceback, should it be this aotgrad's fault instead).
        raise errors.ExportFormatError(f"{path} could not be loaded, it is malformed "
                                       f"({type(e).__name__}: {str(e)[:200]})") from e


def _zeros(manifest: dict) -> dict:
    """Zero tensors of the exported specs for the parameters and buffers the file holds no value for."""
    from .rebuild import _typed_list
    from ..guards.inputs import TensorSpec
    specs = _typed_list(manifest["guards"], TensorSpec)
    return {e["name"]: torch.zeros(spec.size, dtype=spec.dtype, device=spec.device)
            for e, spec in zip(manifest["state"], specs) if f"state/{e['name']}" not in manifest["tensors"]}
