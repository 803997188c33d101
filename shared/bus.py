"""NATS helpers: connect with reconnect, idempotent streams, consumers, KV and object store."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared.config import ChorusConfig
from shared.subjects import Names

log = structlog.get_logger("bus")

DEDUP_WINDOW_S = 120.0


async def connect(url: str, name: str, *, timeout_s: float = 5.0) -> NATS:
    """Connect with unlimited reconnects; connection problems are logged, not raised later."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc), client=name)

    async def on_disconnect() -> None:
        log.warning("nats disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats reconnected", client=name)

    return await nats.connect(
        servers=[url],
        name=name,
        connect_timeout=timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


async def ensure_stream(js: JetStreamContext, config: jsapi.StreamConfig) -> jsapi.StreamInfo:
    """Create a stream, or update it in place if it exists with other settings."""
    try:
        return await js.add_stream(config=config)
    except BadRequestError:
        return await js.update_stream(config=config)


async def ensure_kv(js: JetStreamContext, bucket: str, history: int = 1) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        try:
            return await js.create_key_value(bucket=bucket, history=history)
        except BadRequestError:  # created concurrently by another service
            return await js.key_value(bucket)


async def ensure_obj(js: JetStreamContext, bucket: str) -> ObjectStore:
    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        try:
            return await js.create_object_store(bucket=bucket)
        except BadRequestError:
            return await js.object_store(bucket)


async def ensure_run(js: JetStreamContext, cfg: ChorusConfig) -> tuple[KeyValue, ObjectStore]:
    """Idempotently create every stream, the KV bucket and the object store of a run."""
    names = Names(cfg.run.id)
    max_bytes = cfg.nats.max_payload_mb * 1024 * 1024
    for model in cfg.models:
        await ensure_stream(
            js,
            jsapi.StreamConfig(
                name=names.traj_stream(model),
                subjects=[names.traj(model)],
                retention=jsapi.RetentionPolicy.WORK_QUEUE,
                storage=jsapi.StorageType.FILE,
                max_msgs=1_000_000,
                discard=jsapi.DiscardPolicy.NEW,
                duplicate_window=DEDUP_WINDOW_S,
                max_msg_size=max_bytes,
            ),
        )
        await ensure_stream(
            js,
            jsapi.StreamConfig(
                name=names.ready_stream(model),
                subjects=[names.ready(model)],
                retention=jsapi.RetentionPolicy.WORK_QUEUE,
                storage=jsapi.StorageType.FILE,
                max_msgs=cfg.mq.max_ready_msgs,
                discard=jsapi.DiscardPolicy.NEW,
                duplicate_window=DEDUP_WINDOW_S,
                max_msg_size=max_bytes,
            ),
        )
    kv = await ensure_kv(js, names.kv_bucket)
    obj = await ensure_obj(js, names.obj_bucket)
    return kv, obj


async def pull_consumer(
    js: JetStreamContext,
    *,
    stream: str,
    subject: str,
    durable: str,
    ack_wait_s: float,
    max_ack_pending: int,
    max_deliver: int = -1,
) -> JetStreamContext.PullSubscription:
    """A durable pull subscription sized to the real work (MaxAckPending stops delivery when reached)."""
    config = jsapi.ConsumerConfig(
        durable_name=durable,
        ack_policy=jsapi.AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        max_deliver=max_deliver,
        filter_subject=subject,
        deliver_policy=jsapi.DeliverPolicy.ALL,
    )
    return await js.pull_subscribe(subject, durable=durable, stream=stream, config=config)


async def fetch(sub: JetStreamContext.PullSubscription, batch: int, timeout_s: float) -> list[Any]:
    """Fetch up to ``batch`` messages; an empty list on timeout."""
    try:
        return await sub.fetch(batch, timeout=timeout_s)
    except (TimeoutError, nats.errors.TimeoutError):
        return []


async def kv_get_int(kv: KeyValue, key: str, default: int = 0) -> int:
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return default
    if entry.value is None or entry.value == b"":
        return default
    return int(entry.value.decode())


async def kv_put_int_max(kv: KeyValue, key: str, value: int) -> int:
    """Raise an integer key to ``value`` with compare-and-swap; never lowers it. Returns the stored value."""
    for _ in range(50):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            try:
                await kv.create(key, str(value).encode())
                return value
            except Exception:  # created concurrently; read it again
                continue
        current = int(entry.value.decode()) if entry.value else 0
        if current >= value:
            return current
        try:
            await kv.update(key, str(value).encode(), last=entry.revision)
            return value
        except Exception:  # lost a race; read again
            await asyncio.sleep(0.01)
    raise RuntimeError(f"could not set KV {key} to {value}: too much contention")


OBJECT_FETCH_BATCH = 256  # chunks per pull request when reading an object


async def read_object(js: JetStreamContext, bucket: str, name: str, *, timeout_s: float = 30.0,
                      into: bytearray | None = None) -> memoryview:
    """An object store object read straight into one buffer, checked against its SHA-256 digest.

    Returns a view of exactly the object's bytes: of ``into`` when it is large enough (a reused receive
    buffer), of a new buffer otherwise.

    Reads the chunks with a short-lived pull consumer in large batches. nats-py's ``ObjectStore.get`` goes
    through an ordered push consumer whose flow control stalls about 0.25 s every few megabytes (an 11 MB
    object took 0.53 s here, against 0.05 s this way).
    """
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if info.is_link():
        raise ValueError(f"object {name!r} in {bucket!r} is a link; links are not followed")
    size = int(info.size or 0)
    buf = into if into is not None and len(into) >= size else bytearray(size)
    if size == 0:
        return memoryview(buf)[:0]
    sub = await js.pull_subscribe(
        f"$O.{bucket}.C.{info.nuid}", stream=f"OBJ_{bucket}",
        config=jsapi.ConsumerConfig(ack_policy=jsapi.AckPolicy.NONE, deliver_policy=jsapi.DeliverPolicy.ALL,
                                    inactive_threshold=max(5.0, timeout_s)),
    )
    digest = hashlib.sha256()
    offset = chunks = 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while chunks < int(info.chunks or 0):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"reading object {name!r}: {chunks} of {info.chunks} chunks in {timeout_s}s")
            for msg in await sub.fetch(min(OBJECT_FETCH_BATCH, int(info.chunks) - chunks), timeout=left):
                end = offset + len(msg.data)
                if end > size:
                    raise ValueError(f"object {name!r}: chunks hold more than its {size} bytes")
                buf[offset:end] = msg.data
                digest.update(msg.data)
                offset, chunks = end, chunks + 1
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await sub.unsubscribe()
    expected = (info.digest or "").split("=", 1)[-1]
    if offset != size or base64.urlsafe_b64encode(digest.digest()).decode() != expected:
        raise ValueError(f"object {name!r}: read {offset} of {size} bytes, or its digest does not match")
    return memoryview(buf)[:size]
