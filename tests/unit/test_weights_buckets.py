"""Bucketed flat weight buffers: layout, per-bucket checksums, reuse of the buffer, refusal of partial data."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.models.weights import WeightsHeader, bucket_spans, checksum, flatten, load_into, pack, unpack


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(37, 11, generator=g), "norm": torch.randn(11, generator=g),
            "half": torch.randn(5, 7, generator=g).to(torch.bfloat16), "ids": torch.arange(13, dtype=torch.int64)}


def zeros_like(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in named.items()}


def test_buckets_cut_the_flat_buffer_and_tensors_may_span_them() -> None:
    src = tensors()
    header, buf = flatten("m", 4, src, bucket_bytes=100)
    total = header.slots[-1].offset + header.slots[-1].nbytes
    assert header.nbytes == total == len(buf)
    assert header.buckets == bucket_spans(total, 100) and len(header.buckets) == -(-total // 100)
    assert sum(n for _, n in header.buckets) == total and all(n == 100 for _, n in header.buckets[:-1])
    assert any(s.offset // 100 != (s.offset + s.nbytes - 1) // 100 for s in header.slots)  # one spans two
    assert checksum(buf, 100) == header.checksum != checksum(buf, 64)
    back = WeightsHeader.unpack(header.pack())
    assert back == header
    dst = zeros_like(src)
    assert load_into(dst, back, buf) == header.checksum
    assert all(torch.equal(dst[k], src[k]) for k in src)


@pytest.mark.parametrize("where", [0, 150, -1])
def test_a_flipped_byte_in_any_bucket_is_refused_before_anything_is_written(where: int) -> None:
    src = tensors()
    header, buf = flatten("m", 1, src, bucket_bytes=100)
    bad = bytearray(buf)
    bad[where] ^= 0xFF
    dst = zeros_like(src)
    with pytest.raises(ValueError, match=f"bucket {(where % len(buf)) // 100} checksum"):
        load_into(dst, header, bad)
    assert all(not v.any() for v in dst.values())
    with pytest.raises(ValueError, match="combine"):
        load_into(dst, dataclasses.replace(header, checksum="0" * 32), buf)


def test_a_reused_buffer_is_overwritten_in_place_and_may_be_larger() -> None:
    big_header, big = flatten("m", 1, {"w": torch.randn(1000)}, bucket_bytes=512)
    header, buf = flatten("m", 2, tensors(1), bucket_bytes=512, out=big)
    assert buf is big and header.nbytes < len(buf)
    dst = zeros_like(tensors())
    load_into(dst, header, buf)  # the tail beyond nbytes (old data) is ignored
    assert all(torch.equal(dst[k], v) for k, v in tensors(1).items())
    got, body = unpack(pack(header, buf))
    assert got == header and len(body) == header.nbytes
    with pytest.raises(ValueError, match="says"):
        load_into(dst, header, buf[: header.nbytes - 1])


def test_a_malformed_header_is_a_clear_error() -> None:
    header, _ = flatten("m", 1, tensors(), bucket_bytes=100)
    with pytest.raises(ValueError, match="bucket checksums"):
        WeightsHeader.unpack(dataclasses.replace(header, bucket_checksums=header.bucket_checksums[:-1]).pack())
    with pytest.raises(ValueError, match="malformed"):
        WeightsHeader.unpack(b"\x81\xa1x\x01")
