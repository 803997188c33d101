"""Weights as one contiguous buffer plus O(1) metadata, and in-place loading on the receiving side.

Wire/object layout: ``[8-byte little-endian header length][msgpack header][flat buffer]``. The header
lists names, shapes, dtypes and byte offsets, and the sha256 of the flat buffer.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import torch

_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightsHeader:
    model: str
    version: int
    slots: list[TensorSlot]
    nbytes: int
    checksum: str

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "model": self.model,
                "version": self.version,
                "nbytes": self.nbytes,
                "checksum": self.checksum,
                "slots": [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in self.slots],
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes) -> WeightsHeader:
        raw: dict[str, Any] = msgpack.unpackb(data, raw=False)
        slots = [TensorSlot(n, tuple(sh), dt, off, nb) for n, sh, dt, off, nb in raw["slots"]]
        return cls(raw["model"], int(raw["version"]), slots, int(raw["nbytes"]), raw["checksum"])


def checksum(buf: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def flatten(model: str, version: int, named: dict[str, torch.Tensor]) -> tuple[WeightsHeader, bytearray]:
    """Copy every tensor into one contiguous buffer (one copy, no per-tensor messages)."""
    import torch

    slots: list[TensorSlot] = []
    offset = 0
    for name, t in named.items():
        nb = t.numel() * t.element_size()
        slots.append(TensorSlot(name, tuple(t.shape), _dtype_name(t), offset, nb))
        offset += nb
    buf = bytearray(offset)
    flat = torch.frombuffer(buf, dtype=torch.uint8) if offset else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        for slot, t in zip(slots, named.values(), strict=True):
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[slot.offset : slot.offset + slot.nbytes].copy_(src)
    return WeightsHeader(model, version, slots, offset, checksum(buf)), buf


def pack(header: WeightsHeader, buf: bytes | bytearray) -> bytes:
    """Header + buffer as one object (for the NATS object store transport)."""
    h = header.pack()
    return _LEN.pack(len(h)) + h + bytes(buf)


def unpack(blob: bytes | bytearray | memoryview) -> tuple[WeightsHeader, memoryview]:
    view = memoryview(blob)
    (n,) = _LEN.unpack(view[: _LEN.size])
    header = WeightsHeader.unpack(bytes(view[_LEN.size : _LEN.size + n]))
    body = view[_LEN.size + n :]
    if len(body) != header.nbytes:
        raise ValueError(f"weights body is {len(body)} bytes, header says {header.nbytes}")
    return header, body


def load_into(named: dict[str, torch.Tensor], header: WeightsHeader, body: bytes | bytearray | memoryview,
              *, verify: bool = True) -> str:
    """Write the buffer straight into existing tensors (in place); returns the checksum of what was loaded.

    The header may name a subset of ``named`` (a LoRA update ships only adapter tensors), but every tensor
    it names must exist with the same shape and dtype. All of that is checked before the first copy, so a
    rejected update leaves ``named`` exactly as it was.
    """
    import torch

    digest = checksum(body)
    if verify and digest != header.checksum:
        raise ValueError(f"weights checksum mismatch for {header.model} v{header.version}: {digest} != {header.checksum}")
    missing = [s.name for s in header.slots if s.name not in named]
    if missing:
        raise ValueError(f"weights for {header.model} v{header.version} name {len(missing)} tensors the receiver "
                         f"does not have, e.g. {missing[:3]} (do both sides build models.{header.model} the same way?)")
    for s in header.slots:
        dst = named[s.name]
        if tuple(dst.shape) != s.shape or _dtype_name(dst) != s.dtype:
            raise ValueError(f"{s.name}: have {tuple(dst.shape)} {dst.dtype}, got {s.shape} {s.dtype}")
        if s.nbytes != dst.numel() * dst.element_size() or s.offset < 0 or s.offset + s.nbytes > len(body):
            raise ValueError(f"{s.name}: slot [{s.offset}, {s.offset + s.nbytes}) does not fit its tensor "
                             f"or the {len(body)}-byte body")
    # torch.frombuffer wants a writable buffer (and cannot take an empty one).
    writable = bytearray(body) if memoryview(body).readonly else body
    flat = torch.frombuffer(writable, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        for s in header.slots:
            dst = named[s.name]
            src = flat[s.offset : s.offset + s.nbytes].view(dst.dtype).view(dst.shape)
            dst.copy_(src)
    return digest
