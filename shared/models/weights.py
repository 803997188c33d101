"""Weights as one contiguous buffer cut into fixed-size buckets, O(1) metadata, and in-place loading.

A version of a model's shipped tensors is one flat buffer: every tensor copied in once, back to back. The
buffer is cut into buckets of ``bucket_bytes`` (the last one shorter), the unit a transport moves and
checks: one transfer and one checksum per bucket, never one per tensor. The header lists names, shapes,
dtypes and byte offsets into the flat buffer (a tensor may span two buckets), the bucket size and each
bucket's XXH3-128 digest; the version's checksum is the digest of the bucket digests, so the receiver checks
every bucket as it lands and the whole version without a second pass.

Object layout (NATS object store): ``[8-byte little-endian header length][msgpack header][flat buffer]``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

_LEN = struct.Struct("<Q")
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

# A flat weight buffer: a 1-d uint8 numpy array. numpy asks the kernel for transparent huge pages on large
# allocations, which halves the cost of UCX's cross-memory attach (fewer pages to pin: 2.47 GB moved at 10-14
# GB/s from numpy arrays against 4-7 GB/s from bytearrays here) and of first-touch page faults.
Buffer = np.ndarray


def alloc(nbytes: int) -> Buffer:
    """An uninitialised flat buffer of ``nbytes``."""
    return np.empty(nbytes, dtype=np.uint8)


def byte_view(buf: bytes | bytearray | memoryview | Buffer) -> memoryview:
    """``buf`` as a flat memoryview of bytes, without a copy (an array's own ``data`` view)."""
    return (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")


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
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    bucket_checksums: list[str] = field(default_factory=list)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of every bucket of the flat buffer."""
        return bucket_spans(self.nbytes, self.bucket_bytes)

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "model": self.model,
                "version": self.version,
                "nbytes": self.nbytes,
                "checksum": self.checksum,
                "bucket_bytes": self.bucket_bytes,
                "bucket_checksums": self.bucket_checksums,
                "slots": [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in self.slots],
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes) -> WeightsHeader:
        try:
            raw: dict[str, Any] = msgpack.unpackb(data, raw=False)
            slots = [TensorSlot(n, tuple(sh), dt, off, nb) for n, sh, dt, off, nb in raw["slots"]]
            header = cls(raw["model"], int(raw["version"]), slots, int(raw["nbytes"]), raw["checksum"],
                         int(raw["bucket_bytes"]), list(raw["bucket_checksums"]))
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed weights header: {type(exc).__name__}: {exc}") from None
        if header.bucket_bytes <= 0 or len(header.bucket_checksums) != len(header.buckets):
            raise ValueError(f"weights header of {header.model} v{header.version}: {len(header.bucket_checksums)} "
                             f"bucket checksums for {len(header.buckets)} buckets of {header.bucket_bytes} bytes")
        return header


def bucket_spans(nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    return [(off, min(bucket_bytes, nbytes - off)) for off in range(0, nbytes, bucket_bytes)]


def bucket_checksum(buf: bytes | bytearray | memoryview | Buffer) -> str:
    return xxhash.xxh3_128_hexdigest(byte_view(buf))


def combine(bucket_checksums: list[str]) -> str:
    """The checksum of a version: the digest of its bucket digests, in order."""
    return xxhash.xxh3_128_hexdigest("".join(bucket_checksums).encode())


def bucket_checksums(buf: bytes | bytearray | memoryview | Buffer, nbytes: int, bucket_bytes: int) -> list[str]:
    """The digest of every bucket of the first ``nbytes`` of a flat buffer."""
    view = byte_view(buf)
    return [bucket_checksum(view[o:o + n]) for o, n in bucket_spans(nbytes, bucket_bytes)]


def checksum(buf: bytes | bytearray | memoryview | Buffer, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> str:
    """The checksum of a flat buffer cut into buckets of ``bucket_bytes``."""
    return combine(bucket_checksums(buf, len(byte_view(buf)), bucket_bytes))


def verify_bucket(header: WeightsHeader, index: int, data: bytes | bytearray | memoryview | Buffer) -> None:
    got = bucket_checksum(data)
    if got != header.bucket_checksums[index]:
        raise ValueError(f"weights of {header.model} v{header.version}: bucket {index} checksum {got} != "
                         f"{header.bucket_checksums[index]} (corrupted or partly written)")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


ALIGN = 64  # every tensor starts on a 64-byte boundary: any dtype can view its bytes in place


def layout(named: dict[str, torch.Tensor]) -> tuple[list[TensorSlot], int]:
    """Slots of the flat buffer, in order, each aligned to ``ALIGN`` bytes; and the buffer's size."""
    slots: list[TensorSlot] = []
    offset = 0
    for name, t in named.items():
        offset = -(-offset // ALIGN) * ALIGN
        nb = t.numel() * t.element_size()
        slots.append(TensorSlot(name, tuple(t.shape), _dtype_name(t), offset, nb))
        offset += nb
    return slots, offset


def flatten(model: str, version: int, named: dict[str, torch.Tensor], *,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES, out: Buffer | None = None,
            checksums: bool = True) -> tuple[WeightsHeader, Buffer]:
    """Copy every tensor into one contiguous buffer (one copy, no per-tensor messages) and checksum its buckets.

    The buffer is host memory whatever device the tensors live on (a GPU tensor is copied to it directly, as
    raw bytes: bfloat16 travels as it is).

    ``out``, when at least as large as the tensors, is reused (a fresh multi-GB buffer costs page faults
    on first touch); the returned buffer is then ``out`` and the header's ``nbytes`` says how much of it
    holds this version. ``checksums`` False leaves the digests out (a buffer that never leaves the host, such as
    a swapped learner state: a third of the time of a flatten); such a header cannot be verified.
    """
    import torch

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    slots, total = layout(named)
    buf = out if out is not None and len(out) >= total else alloc(total)
    flat = torch.from_numpy(buf) if len(buf) else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        end = 0
        for slot, t in zip(slots, named.values(), strict=True):
            flat[end:slot.offset].zero_()  # alignment padding: a reused buffer holds old bytes there
            end = slot.offset + slot.nbytes
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[slot.offset : slot.offset + slot.nbytes].copy_(src)
    if not checksums:
        return WeightsHeader(model, version, slots, total, "", bucket_bytes,
                             [""] * len(bucket_spans(total, bucket_bytes))), buf
    sums = bucket_checksums(buf, total, bucket_bytes)
    return WeightsHeader(model, version, slots, total, combine(sums), bucket_bytes, sums), buf


def head(header: WeightsHeader) -> bytes:
    """What precedes the buffer in the object layout: the header's length and the header."""
    h = header.pack()
    return _LEN.pack(len(h)) + h


def pack(header: WeightsHeader, buf: bytes | bytearray | memoryview | Buffer) -> bytes:
    """Header + buffer as one object (for the NATS object store transport)."""
    return head(header) + bytes(byte_view(buf)[: header.nbytes])


def unpack(blob: bytes | bytearray | memoryview | Buffer) -> tuple[WeightsHeader, memoryview]:
    view = byte_view(blob)
    if len(view) < _LEN.size:
        raise ValueError(f"weights object of {len(view)} bytes has no header")
    (n,) = _LEN.unpack(view[: _LEN.size])
    if _LEN.size + n > len(view):
        raise ValueError(f"weights header length {n} runs past the {len(view)}-byte object")
    header = WeightsHeader.unpack(bytes(view[_LEN.size : _LEN.size + n]))
    body = view[_LEN.size + n :]
    if len(body) != header.nbytes:
        raise ValueError(f"weights body is {len(body)} bytes, header says {header.nbytes}")
    return header, body


def load_into(named: dict[str, torch.Tensor], header: WeightsHeader, body: bytes | bytearray | memoryview | Buffer,
              *, verify: bool = True) -> str:
    """Write the buffer straight into existing tensors (in place); returns the checksum of what was loaded.

    ``body`` holds at least ``header.nbytes`` bytes (a reused receive buffer may be larger). With ``verify``
    every bucket is checked against the header first. The header may name a subset of ``named`` (a LoRA
    update ships only adapter tensors), but every tensor it names must exist with the same shape and dtype.
    All of that is checked before the first copy, so a rejected update leaves ``named`` exactly as it was.
    The tensors may live on any device: each is filled by one ``copy_`` from the host buffer.
    """
    import torch

    view = byte_view(body)
    if len(view) < header.nbytes:
        raise ValueError(f"weights body is {len(view)} bytes, header says {header.nbytes}")
    view = view[: header.nbytes]
    if verify:
        for i, (o, n) in enumerate(header.buckets):
            verify_bucket(header, i, view[o:o + n])
        if combine(header.bucket_checksums) != header.checksum:
            raise ValueError(f"weights checksum mismatch for {header.model} v{header.version}: the bucket "
                             f"checksums do not combine to {header.checksum}")
    missing = [s.name for s in header.slots if s.name not in named]
    if missing:
        raise ValueError(f"weights for {header.model} v{header.version} name {len(missing)} tensors the receiver "
                         f"does not have, e.g. {missing[:3]} (do both sides build models.{header.model} the same way?)")
    for s in header.slots:
        dst = named[s.name]
        if tuple(dst.shape) != s.shape or _dtype_name(dst) != s.dtype:
            raise ValueError(f"{s.name}: have {tuple(dst.shape)} {dst.dtype}, got {s.shape} {s.dtype}")
        if s.nbytes != dst.numel() * dst.element_size() or s.offset < 0 or s.offset + s.nbytes > len(view):
            raise ValueError(f"{s.name}: slot [{s.offset}, {s.offset + s.nbytes}) does not fit its tensor "
                             f"or the {len(view)}-byte body")
    # torch.frombuffer wants a writable buffer (and cannot take an empty one).
    writable = bytearray(view) if view.readonly else view
    flat = torch.frombuffer(writable, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        for s in header.slots:
            dst = named[s.name]
            src = flat[s.offset : s.offset + s.nbytes].view(dst.dtype).view(dst.shape)
            dst.copy_(src)
    return header.checksum
