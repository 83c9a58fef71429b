"""Tensors as raw bytes plus a JSON table (the idea of safetensors, without the dependency).

``pack`` lays each tensor's elements out contiguously, one after another, and returns the
bytes and a table ``{name: {dtype, shape, stride, offset, start, nbytes, device, requires_grad}}``.
``unpack`` checks every entry against the bytes before it builds anything.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import sys

import torch

from ..errors import ExportFormatError
from .codec import DTYPES


def pack(tensors: dict) -> tuple[bytes, dict]:
    chunks, table, start = [], {}, 0
    for name, t in tensors.items():
        t = t.detach()
        data = _bytes(t)
        table[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "stride": list(t.stride()), "device": str(t.device), "start": start, "nbytes": len(data)}
        chunks.append(data)
        start += len(data)
    return b"".join(chunks), table


def _bytes(t: torch.Tensor) -> bytes:
    """The elements of ``t`` in row-major order, as bytes (one memory copy: ``bytes(storage)``
    reads element by element)."""
    if not t.numel():
        return b""
    dense = t.cpu().clone(memory_format=torch.contiguous_format)
    return ctypes.string_at(dense.data_ptr(), dense.numel() * dense.element_size())


def unpack(blob: bytes, table: dict) -> dict:
    if sys.byteorder != "little":
        raise ExportFormatError("the artifact's tensors are little-endian; this machine is not")
    return {name: _tensor(name, blob, entry) for name, entry in table.items()}


def digest(blob: bytes) -> str:
    """The SHA-256 of ``tensors.bin``, kept in the manifest: bytes of the right size that are not
    the ones written (a crafted member, a payload that happens to fill the table) are refused."""
    return hashlib.sha256(blob).hexdigest()


def check_digest(blob: bytes, expected: str) -> None:
    if digest(blob) != expected:
        raise ExportFormatError("the artifact's tensors.bin is not the one its manifest was written with (its "
                                "SHA-256 differs: the file is corrupted or was altered)")


def check_extent(table: dict, size: int) -> int:
    """The table's byte ranges lie one after another from 0 and end at ``size`` (as ``pack`` writes
    them), each the bytes of its declared dtype and shape: no byte is read twice or left over, and a
    member larger than its table is never read. Returns ``size``: the most ``tensors.bin`` may inflate to."""
    end = 0
    try:
        ranges = sorted((e["start"], e["nbytes"], name, _declared(e)) for name, e in table.items())
    except (KeyError, TypeError, ValueError) as err:
        raise ExportFormatError(f"the artifact's tensor table is malformed ({err})") from None
    for start, nbytes, name, declared in ranges:
        if type(start) is not int or type(nbytes) is not int or start != end or nbytes != declared:
            raise ExportFormatError(f"tensor {name!r} does not start where the one before it ends, or holds other "
                                    "than its dtype and shape's bytes (the file is corrupted or truncated)")
        end += nbytes
    if end != size:
        raise ExportFormatError(f"the artifact's tensors.bin holds {size} bytes, its tensor table {end} (the file is "
                                "corrupted or truncated)")
    return size


def _declared(e: dict) -> int:
    shape = _ints(e["shape"])
    if min(shape, default=0) < 0:
        raise ValueError(f"negative size {shape}")
    return math.prod(shape) * DTYPES[e["dtype"]].itemsize


def _tensor(name: str, blob: bytes, e: dict) -> torch.Tensor:
    try:
        dtype, shape, stride = DTYPES[e["dtype"]], _ints(e["shape"]), _ints(e["stride"])
        start, nbytes, device = e["start"], e["nbytes"], torch.device(e["device"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ExportFormatError(f"tensor {name!r} has a malformed entry ({err})") from None
    numel = math.prod(shape)
    if len(stride) != len(shape) or min(shape, default=0) < 0 or nbytes != numel * dtype.itemsize \
            or start < 0 or start + nbytes > len(blob):
        raise ExportFormatError(f"tensor {name!r} does not fit the artifact's bytes (the file is corrupted "
                                "or truncated)")
    if device.type != "cpu" and not _available(device):
        raise ExportFormatError(f"tensor {name!r} lives on {device}, which this machine does not have")
    flat = torch.frombuffer(bytearray(blob[start:start + nbytes]), dtype=torch.uint8) if nbytes \
        else torch.empty(0, dtype=torch.uint8)
    try:
        values = flat.view(dtype).reshape(shape)
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(values)
    except RuntimeError as err:     # strides that overlap or do not fit the shape
        raise ExportFormatError(f"tensor {name!r} has a layout no tensor can have ({err})") from None


def _ints(v) -> list:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise TypeError(f"{str(v)[:40]} is not a list of integers")
    return v


def _available(device: torch.device) -> bool:
    module = getattr(torch, device.type, None)
    return module is not None and hasattr(module, "is_available") and module.is_available() \
        and (device.index is None or device.index < module.device_count())
