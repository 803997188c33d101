"""NATS helpers: connect with reconnect, idempotent streams, consumers, KV and object store."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats
import numpy as np
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared.kernel.config import ChorusConfig, NatsSection
from shared.kernel.credentials import client_options, describe, permission_denied
from shared.kernel.subjects import Names

log = structlog.get_logger("bus")

DEDUP_WINDOW_S = 120.0

T = TypeVar("T")


class BrokerUnreachable(ConnectionError):
    """No server of the URL answered within the connect timeout (wrong URL, server down, firewall)."""

    def __init__(self, url: str, timeout_s: float, last_error: str | None) -> None:
        self.url = url
        why = f" (last error: {last_error})" if last_error else ""
        super().__init__(f"cannot reach NATS at {url} within nats.connect_timeout_s ({timeout_s:g} s){why}; "
                         "check the URL (--nats, nats.url or CHORUS_NATS__URL) and that the server is up")


async def connect(url: str, name: str, *, timeout_s: float = 5.0, nats_cfg: NatsSection | None = None,
                  kind: str | None = None, on_denied: Callable[[str, str], None] | None = None,
                  on_disconnected: Callable[[], Awaitable[None]] | None = None) -> NATS:
    """Connect, trying the servers of ``url`` for ``timeout_s`` in all (then :class:`BrokerUnreachable`); once
    connected, reconnects are unlimited and connection problems are logged, not raised later.

    ``url`` may name several servers of a cluster, comma-separated; the client also learns the others from the
    server it reaches and reconnects to a surviving one when its server goes. With ``nats_cfg`` and ``kind`` the
    client authenticates as that kind (:func:`shared.kernel.credentials.client_options`: user/password, token, nkey,
    creds, TLS). A permissions violation the server reports is logged with its operation and subject and passed
    to ``on_denied(operation, subject)``; the connection stays up. ``on_disconnected`` is awaited whenever the
    connection drops (not on a close of our own).
    """
    options = client_options(nats_cfg, kind) if nats_cfg is not None and kind is not None else {}
    last_error: list[str] = []

    async def on_error(exc: Exception) -> None:
        last_error[:] = [f"{type(exc).__name__}: {exc}".rstrip(": ")]
        denied = permission_denied(str(exc))
        if denied is not None:
            log.warning("nats permission denied", operation=denied[0], subject=denied[1], client=name, kind=kind)
            if on_denied is not None:
                on_denied(*denied)
            return
        if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower():
            log.error("nats refused this client's credentials; check nats.user / password / token / nkey_seed / "
                      "creds and the server's authorization config", client=name, kind=kind,
                      auth=describe(nats_cfg, kind) if nats_cfg is not None and kind is not None else "none")
            return
        log.warning("nats error", error=str(exc), client=name)

    async def on_disconnect() -> None:
        if nc.is_closed:  # our own close (drain, shutdown): not a fault
            log.debug("nats connection closed", client=name)
        else:
            log.warning("nats disconnected", client=name)
            if on_disconnected is not None:
                await on_disconnected()

    async def on_reconnect() -> None:
        log.info("nats reconnected", client=name)

    nc = NATS()
    servers = [u.strip() for u in url.split(",") if u.strip()]
    # nats-py retries the first connect as often as later reconnects (forever here): the deadline is ours. Each try
    # of one server gets its share of it: a server whose packets are dropped (a partition, a dead host) would hold
    # a try for its whole timeout, and the servers after it would never be tried.
    per_try_s = timeout_s / max(1, len(servers))
    connecting = asyncio.ensure_future(nc.connect(
        servers=servers,
        name=name,
        connect_timeout=per_try_s,  # type: ignore[arg-type]  # seconds: nats-py takes floats
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds: nats-py takes floats
        allow_reconnect=True,
        ping_interval=nats_cfg.ping_interval_s if nats_cfg is not None else NatsSection().ping_interval_s,  # type: ignore[arg-type]  # seconds: nats-py takes floats
        max_outstanding_pings=2,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **options,
    ))
    try:
        await asyncio.wait_for(asyncio.shield(connecting), timeout_s)
    except TimeoutError:
        connecting.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await connecting
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2.0)
        raise BrokerUnreachable(url, timeout_s, last_error[0] if last_error else None) from None
    except asyncio.CancelledError:
        connecting.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2.0)
        raise
    return nc


NO_PEERS = 10005  # JetStream's "no suitable peers for placement": a cluster whose servers have not all joined yet
PLACEMENT_WAIT_S = 30.0  # how long a create waits for the cluster's servers to be known to its meta leader


async def _placed(create: Callable[[], Awaitable[T]]) -> T:
    """``create`` (a stream or bucket), waiting out a cluster still forming: a meta leader that does not yet know
    enough servers (with the placement tags) for the replicas answers "no suitable peers for placement"."""
    deadline = asyncio.get_running_loop().time() + PLACEMENT_WAIT_S
    while True:
        try:
            return await create()
        except BadRequestError as exc:
            if exc.err_code != NO_PEERS or asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.5)


async def _create(create: Callable[[], Awaitable[T]], exists: Callable[[], Awaitable[T]]) -> T:
    """``create``, waiting out a cluster still forming (:func:`_placed`); ``exists`` when it was refused because
    the stream or bucket is there already (created concurrently, or with other settings)."""
    try:
        return await _placed(create)
    except BadRequestError as exc:
        if exc.err_code == NO_PEERS:
            raise
        return await exists()


async def _already_there() -> Any:
    return None


async def ensure_stream(js: JetStreamContext, config: jsapi.StreamConfig) -> jsapi.StreamInfo:
    """Create a stream, or update it in place if it exists with other settings."""
    return await _create(lambda: js.add_stream(config=config), lambda: js.update_stream(config=config))


def placement(tags: list[str]) -> jsapi.Placement | None:
    """JetStream placement on the servers that carry every one of ``tags`` (None: anywhere)."""
    return jsapi.Placement(tags=list(tags)) if tags else None


async def ensure_kv(js: JetStreamContext, bucket: str, history: int = 1, replicas: int = 1,
                    tags: list[str] | None = None) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        # The bucket's stream as nats-py's create_key_value makes it, with placement (which that call drops).
        config = jsapi.StreamConfig(
            name=f"KV_{bucket}", subjects=[f"$KV.{bucket}.>"], allow_rollup_hdrs=True, allow_msg_ttl=True,
            deny_delete=True, discard=jsapi.DiscardPolicy.NEW, duplicate_window=DEDUP_WINDOW_S, max_consumers=-1,
            max_msgs=-1, max_msgs_per_subject=history, num_replicas=replicas, placement=placement(tags or []))
        await _create(lambda: js.add_stream(config=config), _already_there)  # created concurrently by another service
        return await js.key_value(bucket)


async def ensure_obj(js: JetStreamContext, bucket: str, replicas: int = 1, tags: list[str] | None = None) -> ObjectStore:
    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        return await _create(lambda: js.create_object_store(bucket=bucket, config=jsapi.ObjectStoreConfig(
            replicas=replicas, placement=placement(tags or []))), lambda: js.object_store(bucket))


async def ensure_run(js: JetStreamContext, cfg: ChorusConfig) -> tuple[KeyValue, ObjectStore]:
    """Idempotently create every stream, the KV bucket and the object store of a run, each with
    ``nats.replicas`` copies on servers tagged ``nats.placement_tags``; the streams keep messages for
    ``nats.max_age_s`` (0: no limit)."""
    names = Names(cfg.run.id)
    max_bytes = cfg.nats.max_payload_mb * 1024 * 1024
    replicas = cfg.nats.replicas
    tags = cfg.nats.placement_tags
    where: dict[str, Any] = {"num_replicas": replicas, "placement": placement(tags),
                             "max_age": cfg.nats.max_age_s or None}
    dedup = min(DEDUP_WINDOW_S, cfg.nats.max_age_s or DEDUP_WINDOW_S)  # the server wants it within max_age
    await ensure_stream(
        js,
        jsapi.StreamConfig(
            name=names.events_stream(),
            subjects=[names.events_all()],
            retention=jsapi.RetentionPolicy.LIMITS,
            storage=jsapi.StorageType.FILE,
            max_bytes=cfg.nats.events_max_mb * 1024 * 1024,
            discard=jsapi.DiscardPolicy.OLD,
            duplicate_window=dedup,
            max_msg_size=max_bytes,
            **where,
        ),
    )
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
                duplicate_window=dedup,
                max_msg_size=max_bytes,
                **where,
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
                duplicate_window=dedup,
                max_msg_size=max_bytes,
                **where,
            ),
        )
    if cfg.marft_on:  # MARFT's critic samples, one CriticBatch per finished episode
        await ensure_stream(
            js,
            jsapi.StreamConfig(
                name=names.critic_stream(),
                subjects=[names.critic_samples()],
                retention=jsapi.RetentionPolicy.WORK_QUEUE,
                storage=jsapi.StorageType.FILE,
                max_msgs=1_000_000,
                discard=jsapi.DiscardPolicy.NEW,
                duplicate_window=dedup,
                max_msg_size=max_bytes,
                **where,
            ),
        )
    kv = await ensure_kv(js, names.kv_bucket, replicas=replicas, tags=tags)
    obj = await ensure_obj(js, names.obj_bucket, replicas=replicas, tags=tags)
    return kv, obj


async def run_consumers(js: JetStreamContext, names: Names, models: list[str]) -> dict[str, int]:
    """Consumers on every stream of a run, by stream (a stream not created yet counts 0)."""
    out: dict[str, int] = {}
    for stream in names.streams(models):
        try:
            out[stream] = (await js.stream_info(stream)).state.consumer_count
        except NotFoundError:
            out[stream] = 0
    return out


KV_LIST_CONCURRENCY = 64  # keys a listing reads at once


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str) -> list[str]:
    """Live keys of a KV bucket under ``prefix``, sorted, read without a watch.

    A KV watch (and ``KeyValue.keys``) creates a consumer that outlives the call by minutes on the server;
    a listing done at every weight sync would pile up consumers until the server refuses new ones. This asks
    the stream which key subjects hold messages and reads the last of each (a deleted key's is a tombstone).
    """
    kv_prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{kv_prefix}{prefix}>")
    subjects = sorted(info.state.subjects or {})
    if not subjects:
        return []
    kv = await js.key_value(bucket)
    gate = asyncio.Semaphore(KV_LIST_CONCURRENCY)

    async def live(key: str) -> bool:
        async with gate:
            try:
                await kv.get(key)
            except KeyNotFoundError:  # deleted or purged (KeyDeletedError is a KeyNotFoundError)
                return False
            return True

    # the keys read side by side: one after the other, a listing of a thousand instances took a thousand round trips
    keys = [s[len(kv_prefix):] for s in subjects]
    found = await asyncio.gather(*(live(k) for k in keys))
    return [k for k, ok in zip(keys, found, strict=True) if ok]


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


def stream_seq(msg: Msg) -> int | None:
    """The stream sequence of a JetStream message: the same for every delivery of it."""
    try:
        return msg.metadata.sequence.stream
    except (AttributeError, ValueError, IndexError):
        return None


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


OBJECT_FETCH_BATCH = 256  # chunks per pull request when reading an object, at most
# bytes per pull request, at most: nats-server cuts a client off as a slow consumer beyond 64 MiB pending
OBJECT_FETCH_BYTES = 32 * 1024 * 1024


async def read_object(js: JetStreamContext, bucket: str, name: str, *, timeout_s: float = 30.0,
                      into: bytearray | np.ndarray | None = None, verify_digest: bool = True) -> memoryview:
    """An object store object read straight into one buffer, checked against its SHA-256 digest.

    Returns a view of exactly the object's bytes: of ``into`` when it is large enough (a reused receive
    buffer), of a new buffer otherwise. ``verify_digest=False`` skips the SHA-256 (about 1.7 GB/s) for
    content that carries its own checksums, such as weights; the size is always checked.

    Reads the chunks with batched direct gets (no consumer, no JetStream API request: a weight sync to a
    thousand instances creates no consumer at all), where the stream allows direct gets and the server answers
    them (nats-server 2.11 and later); else with a short-lived pull consumer in large batches. nats-py's
    ``ObjectStore.get`` goes through an ordered push consumer whose flow control stalls about 0.25 s every few
    megabytes (an 11 MB object took 0.53 s here, against 0.05 s this way).
    """
    stream = f"OBJ_{bucket}"
    info = await _object_info_direct(js, bucket, name)
    if info is None:  # no direct gets on this stream (or a replica that has not seen the object yet): the leader's
        store = await js.object_store(bucket)
        info = await store.get_info(name)
    if info.is_link():
        raise ValueError(f"object {name!r} in {bucket!r} is a link; links are not followed")
    size = int(info.size or 0)
    buf = into if into is not None and len(into) >= size else np.empty(size, dtype=np.uint8)
    view = (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")
    if size == 0:
        return view[:0]
    if await _read_chunks_direct(js._nc, stream, f"$O.{bucket}.C.{info.nuid}", int(info.chunks or 0),  # noqa: SLF001
                                 view[:size], timeout_s):
        if verify_digest:
            expected = (info.digest or "").split("=", 1)[-1]
            if base64.urlsafe_b64encode(hashlib.sha256(view[:size]).digest()).decode() != expected:
                raise ValueError(f"object {name!r}: its digest does not match")
        return view[:size]
    # A named consumer, deleted when the read ends; the inactivity threshold only covers a reader that dies.
    consumer = f"read_{js._nc._nuid.next().decode()}"  # noqa: SLF001 - the client's own nuid source
    await js.add_consumer(stream, config=jsapi.ConsumerConfig(
        name=consumer, filter_subject=f"$O.{bucket}.C.{info.nuid}", ack_policy=jsapi.AckPolicy.NONE,
        deliver_policy=jsapi.DeliverPolicy.ALL, inactive_threshold=max(5.0, timeout_s)))
    sub = await js.pull_subscribe_bind(consumer=consumer, stream=stream)
    digest = hashlib.sha256()
    offset = chunks = 0
    total_chunks = int(info.chunks or 0)
    per_pull = max(1, min(OBJECT_FETCH_BATCH, OBJECT_FETCH_BYTES // max(1, -(-size // max(1, total_chunks)))))
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while chunks < total_chunks:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"reading object {name!r}: {chunks} of {info.chunks} chunks in {timeout_s}s")
            for msg in await sub.fetch(min(per_pull, total_chunks - chunks), timeout=left):
                end = offset + len(msg.data)
                if end > size:
                    raise ValueError(f"object {name!r}: chunks hold more than its {size} bytes")
                view[offset:end] = msg.data
                if verify_digest:
                    digest.update(msg.data)
                offset, chunks = end, chunks + 1
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await sub.unsubscribe()
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await js.delete_consumer(stream, consumer)
    expected = (info.digest or "").split("=", 1)[-1]
    if offset != size or (verify_digest and base64.urlsafe_b64encode(digest.digest()).decode() != expected):
        raise ValueError(f"object {name!r}: read {offset} of {size} bytes, or its digest does not match")
    return view[:size]


DIRECT_BATCH_BYTES = 8 * 1024 * 1024  # bytes one batched direct get asks for, at most


class DirectUnavailable(Exception):
    """A direct get was not answered as one: no direct gets on the stream, an older server, a lagging replica."""


async def _object_info_direct(js: JetStreamContext, bucket: str, name: str) -> jsapi.ObjectInfo | None:
    """An object's meta by a direct get (any replica answers, no API request); None when there is none to be had
    that way (the caller asks the stream's leader)."""
    subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
    try:
        msg = await js._nc.request(f"$JS.API.DIRECT.GET.OBJ_{bucket}",  # noqa: SLF001 - the client's own connection
                                   json.dumps({"last_by_subj": subject}).encode(), timeout=5.0)
    except (nats.errors.Error, TimeoutError):
        return None
    if msg.headers and msg.headers.get("Status"):
        return None
    try:
        info = jsapi.ObjectInfo.from_response(json.loads(msg.data))
    except (ValueError, TypeError, KeyError):
        return None
    return None if info.deleted or not info.nuid else info


async def _read_chunks_direct(nc: NATS, stream: str, subject: str, chunks: int, view: memoryview,
                              timeout_s: float) -> bool:
    """Read the ``chunks`` messages of ``subject`` into ``view`` by batched direct gets, one request per
    ``DIRECT_BATCH_BYTES``; False when direct gets are not to be had (nothing was trusted: the caller reads the
    object another way), an error past that."""
    if chunks == 0:
        return len(view) == 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    offset = got = 0
    seq = 1
    try:
        while got < chunks:
            req = {"seq": seq, "next_by_subj": subject, "batch": chunks - got, "max_bytes": DIRECT_BATCH_BYTES}
            await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(req).encode(), reply=inbox)
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"reading {subject}: {got} of {chunks} chunks in {timeout_s}s")
                msg = await sub.next_msg(timeout=min(left, 5.0))
                status = msg.headers.get("Status") if msg.headers else None
                if status == "204":  # the end of this batch
                    break
                if status is not None or not msg.headers:
                    raise DirectUnavailable(f"direct get answered {status}")
                end = offset + len(msg.data)
                if end > len(view) or got >= chunks:
                    raise DirectUnavailable("chunks hold more than the object's size")
                view[offset:end] = msg.data
                offset, got = end, got + 1
                seq = int(msg.headers["Nats-Sequence"]) + 1
                if got == chunks:
                    # the batch's end-of-batch status follows: read and drop it with the subscription
                    break
            if got < chunks and seq == req["seq"]:
                raise DirectUnavailable("a batch returned no chunk")
    except (DirectUnavailable, nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    if offset != len(view):
        return False
    return True


OBJECT_PUT_WINDOW = 32  # chunk publishes awaiting their JetStream ack at once


async def write_object(js: JetStreamContext, bucket: str, name: str, parts: list[bytes | bytearray | memoryview], *,
                       chunk_bytes: int, timeout_s: float = 120.0, replace: bool = True) -> int:
    """Put the concatenation of ``parts`` in the object store as object ``name``, without joining them.

    Readable by any object store client (same chunk and meta subjects, SHA-256 digest, rollup meta). Unlike
    nats-py's ``ObjectStore.put``, which waits for each chunk's ack before sending the next (about 0.33
    GB/s here), up to ``OBJECT_PUT_WINDOW`` chunks are in flight, and the digest is computed in a worker
    thread while they go out. A previous object of the same name is replaced and its chunks purged (``replace``;
    a name written for the first time saves the two lookups); on failure the new chunks are purged. Returns the
    size.
    """
    stream = f"OBJ_{bucket}"
    previous = None
    if replace:
        store = await js.object_store(bucket)
        with contextlib.suppress(NotFoundError):
            previous = await store.get_info(name)
    nuid = js._nc._nuid.next().decode()  # noqa: SLF001 - the client's own nuid source, as ObjectStore.put uses
    chunk_subject = f"$O.{bucket}.C.{nuid}"
    views = [memoryview(p).cast("B") for p in parts]
    chunks = [v[o:o + chunk_bytes] for v in views for o in range(0, len(v), chunk_bytes)]
    size = sum(len(v) for v in views)

    def sha256_of_parts() -> bytes:
        h = hashlib.sha256()
        for v in views:
            h.update(v)
        return h.digest()

    digest = asyncio.get_running_loop().run_in_executor(None, sha256_of_parts)
    try:
        async with asyncio.timeout(timeout_s):
            for i in range(0, len(chunks), OBJECT_PUT_WINDOW):
                await asyncio.gather(*(js.publish(chunk_subject, bytes(c)) for c in chunks[i:i + OBJECT_PUT_WINDOW]))
            sha = await digest
            info = jsapi.ObjectInfo(
                name=name, bucket=bucket, nuid=nuid, size=size, chunks=len(chunks),
                mtime=datetime.now(UTC).isoformat(),
                digest="SHA-256=" + base64.urlsafe_b64encode(sha).decode(),
                options=jsapi.ObjectMetaOptions(max_chunk_size=chunk_bytes),
            )
            meta_subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
            await js.publish(meta_subject, json.dumps(info.as_dict()).encode(),
                             headers={jsapi.Header.ROLLUP: "sub"})
    except BaseException:
        with contextlib.suppress(Exception):
            await js.purge_stream(stream, subject=chunk_subject)
        raise
    if previous is not None and not previous.deleted and previous.nuid:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await js.purge_stream(stream, subject=f"$O.{bucket}.C.{previous.nuid}")
    return size


async def object_names(js: JetStreamContext, bucket: str) -> list[str]:
    """Names of the objects in a bucket, read without a watch (``ObjectStore.list`` creates a consumer)."""
    meta = f"$O.{bucket}.M."
    info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"{meta}>")
    names = []
    for subject in sorted(info.state.subjects or {}):
        with contextlib.suppress(ValueError):
            names.append(base64.urlsafe_b64decode(subject[len(meta):].encode()).decode())
    return names


async def delete_object(js: JetStreamContext, bucket: str, name: str) -> bool:
    """Remove an object entirely: its chunks and its meta message (``ObjectStore.delete`` leaves a meta tombstone
    per name, and names that carry a version would pile one up per version). False if there was none."""
    store = await js.object_store(bucket)
    try:
        info = await store.get_info(name)
    except NotFoundError:
        return False
    stream = f"OBJ_{bucket}"
    if info.nuid:
        await js.purge_stream(stream, subject=f"$O.{bucket}.C.{info.nuid}")
    await js.purge_stream(stream, subject=f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}")
    return True
