"""Bus helpers against a real nats-server: reading object store objects in one buffer, listing without consumers."""

from __future__ import annotations

import asyncio
import json
import os

import nats
import pytest
from nats.js.api import ObjectMeta, ObjectMetaOptions

from shared.kernel.bus import delete_object, kv_keys, object_names, read_object, write_object


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


@pytest.mark.parametrize(("sizes", "chunk"), [((0,), 1024), ((13, 0, 5000), 1024), ((40, 3 * 1024 * 1024 + 7), 128 * 1024)])
async def test_write_object_puts_its_parts_as_one_object_any_client_reads(nats_url: str, run_id: str,
                                                                          sizes: tuple[int, ...], chunk: int) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        bucket = f"b{run_id}"
        store = await js.create_object_store(bucket)
        parts = [os.urandom(n) for n in sizes]
        whole = b"".join(parts)
        assert await write_object(js, bucket, "w", [memoryview(p) for p in parts], chunk_bytes=chunk) == len(whole)
        assert await read_object(js, bucket, "w") == whole  # digest checked
        assert (await store.get("w")).data == whole  # nats-py's own reader agrees, digest included
        # writing the name again replaces the object and purges the old chunks
        await write_object(js, bucket, "w", [whole[::-1]], chunk_bytes=chunk)
        assert await read_object(js, bucket, "w") == whole[::-1]
        info = await store.get_info("w")
        assert info.chunks == -(-len(whole) // chunk)
        assert (await js.stream_info(f"OBJ_{bucket}")).state.messages == info.chunks + 1  # + the meta message
    finally:
        await nc.close()


async def test_an_object_larger_than_a_clients_pending_limit_is_read_whole(nats_url: str, run_id: str) -> None:
    """96 MB in 512 KB chunks: pulls are sized in bytes, so nats-server never cuts the reader off as slow."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        bucket = f"b{run_id}"
        await js.create_object_store(bucket)
        data = os.urandom(96 * 1024 * 1024)
        await write_object(js, bucket, "big", [data], chunk_bytes=512 * 1024)
        into = bytearray(len(data) + 10)
        got = await read_object(js, bucket, "big", timeout_s=60, into=into, verify_digest=False)
        assert got.obj is into and got == data
        await js.delete_object_store(bucket)
    finally:
        await nc.close()


async def test_listing_reading_and_deleting_leave_no_consumer_and_no_tombstone(nats_url: str, run_id: str) -> None:
    """What a weight sync does on every version must not pile up consumers or meta messages on the server."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        bucket = f"b{run_id}"
        kv = await js.create_key_value(bucket=bucket)
        await kv.put("rollouter.m.0", b"{}")
        await kv.put("rollouter.m.1", b"{}")
        await kv.put("rollouter.other.0", b"{}")
        await kv.delete("rollouter.m.1")
        store = await js.create_object_store(bucket)
        await write_object(js, bucket, "weights/m/v1", [os.urandom(5000)], chunk_bytes=1024)
        await write_object(js, bucket, "weights/m/v2", [b"x" * 10], chunk_bytes=1024)
        for _ in range(20):  # a long run: many listings and reads
            assert await kv_keys(js, bucket, "rollouter.m.") == ["rollouter.m.0"]
            assert len(await read_object(js, bucket, "weights/m/v1")) == 5000
        assert (await js.stream_info(f"KV_{bucket}")).state.consumer_count == 0
        assert (await js.stream_info(f"OBJ_{bucket}")).state.consumer_count == 0
        assert sorted(await object_names(js, bucket)) == ["weights/m/v1", "weights/m/v2"]
        assert await delete_object(js, bucket, "weights/m/v1") and not await delete_object(js, bucket, "nope")
        assert await object_names(js, bucket) == ["weights/m/v2"]
        with pytest.raises(nats.js.errors.ObjectNotFoundError):
            await store.get_info("weights/m/v1")
        assert await delete_object(js, bucket, "weights/m/v2")
        assert (await js.stream_info(f"OBJ_{bucket}")).state.messages == 0  # chunks and meta gone
    finally:
        await nc.close()


async def test_a_read_goes_by_direct_gets_without_the_jetstream_api_and_falls_back_where_they_are_off(
        nats_url: str, run_id: str) -> None:
    """A weight sync to many instances reads one object many times at once: by batched direct gets (any replica
    answers, no consumer, no API request), and the old way on a stream that does not allow direct gets."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        bucket = f"b{run_id}"
        await js.create_object_store(bucket)
        data = os.urandom(300 * 1024 + 3)
        await write_object(js, bucket, "w", [data], chunk_bytes=64 * 1024)

        async def api_requests() -> int:
            return int(json.loads((await nc.request("$JS.API.INFO", b"", timeout=5)).data)["api"]["total"])

        before = await api_requests()
        reads = await asyncio.gather(*(read_object(js, bucket, "w") for _ in range(16)))
        assert all(r == data for r in reads)
        assert await api_requests() - before <= 1  # the INFO request itself: no consumer, no stream info, no get
        assert (await js.stream_info(f"OBJ_{bucket}")).state.consumer_count == 0
        # the same object store without direct gets (a stream made by an older client): read through a consumer
        info = await js.stream_info(f"OBJ_{bucket}")
        info.config.allow_direct = False
        await js.update_stream(info.config)
        before = await api_requests()
        assert await read_object(js, bucket, "w") == data
        assert await api_requests() - before > 1
    finally:
        await nc.close()


async def test_a_server_that_never_answers_does_not_use_up_the_connect_budget_of_the_others(nats_url: str) -> None:
    """A URL naming a server whose host drops packets (here: one that accepts the connection and never speaks) and a
    live one: each connect reaches the live one within the budget, whichever order the client tries them in."""
    from shared.kernel.bus import connect

    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        for _ in range(4):  # the client shuffles the servers: the silent one comes first about every other time
            nc = await connect(f"nats://127.0.0.1:{port},{nats_url}", "two-servers", timeout_s=20.0)
            try:
                assert nc.is_connected and str(nc.connected_url.port) != str(port)
            finally:
                await nc.close()
    finally:
        silent.close()
