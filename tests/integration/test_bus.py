"""Bus helpers against a real nats-server: reading object store objects in one buffer."""

from __future__ import annotations

import os

import nats
import pytest
from nats.js.api import ObjectMeta, ObjectMetaOptions

from shared.bus import read_object


@pytest.mark.parametrize(("size", "chunk"), [(0, 1024), (5, 1024), (4096, 1024), (3 * 1024 * 1024 + 7, 128 * 1024),
                                             (600 * 1024, 64 * 1024)])
async def test_read_object_returns_exactly_what_was_put(nats_url: str, run_id: str, size: int, chunk: int) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        store = await js.create_object_store(f"b{run_id}")
        data = os.urandom(size)
        await store.put("w", data, meta=ObjectMeta(name="w", options=ObjectMetaOptions(max_chunk_size=chunk)))
        assert await read_object(js, f"b{run_id}", "w") == data
        # A newer version of the same name replaces it.
        await store.put("w", data[::-1], meta=ObjectMeta(name="w", options=ObjectMetaOptions(max_chunk_size=chunk)))
        assert await read_object(js, f"b{run_id}", "w") == data[::-1]
        with pytest.raises(nats.js.errors.ObjectNotFoundError):
            await read_object(js, f"b{run_id}", "missing")
    finally:
        await nc.close()
