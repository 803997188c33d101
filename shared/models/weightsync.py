"""Weight transports: how a trainer's flat weight buffer reaches each rollouter instance of its model.

One interface, two implementations, chosen by ``paramsync.transport``:

- ``ucx``: the trainer keeps the last ``keep_versions`` flat buffers in memory. A rollouter asks the trainer
  for a version's header (one metadata message over NATS), posts one tagged UCX receive per bucket into its
  staging buffer, then asks the trainer to send (one more NATS request); the trainer sends every bucket with
  tagged sends on an endpoint created from the rollouter's worker address, and UCX moves the bytes (shared
  memory / cross-memory attach on one host, RDMA or TCP across hosts). The endpoint is created with error
  handling off: with it on, UCX drops to its TCP transport (about 0.9 GB/s on loopback here, against 4-15
  GB/s through cross-memory attach, depending on load), so every wait has its own timeout instead.
- ``nats``: the trainer puts ``[header][flat buffer]`` in the JetStream object store and a rollouter reads it
  with a pull consumer into its staging buffer. Needs nothing but the broker; slower, and the weights of
  recent versions outlive the trainer.

Both deliver into a staging buffer that is reused from one version to the next and checked bucket by bucket
before a single tensor is touched, so a half-transferred version never serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.kernel.bus import delete_object, read_object, write_object
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.config import ChorusConfig
from shared.kernel.peers import PeerWatch, until_gone
from shared.kernel.schemas import WeightsMetaRequest, WeightsPull, WeightsReply
from shared.kernel.subjects import Names
from shared.models.weights import Buffer, WeightsHeader, alloc, byte_view, head, unpack

log = structlog.get_logger("weightsync")

TRANSPORTS = ("ucx", "nats")
PUT_ATTEMPTS = 3
PUT_TIMEOUT_S = 120.0
META_TIMEOUT_S = 10.0


class TransportUnavailable(RuntimeError):
    """The configured transport cannot run in this environment."""


def ucx_available() -> bool:
    try:
        _ucxx()
    except TransportUnavailable:
        return False
    return True


def resolve_transport(cfg: ChorusConfig) -> str:
    """``paramsync.transport`` with ``auto`` made concrete: ucx where ucxx imports, nats otherwise."""
    choice = cfg.paramsync.transport
    if choice == "auto":
        return "ucx" if ucx_available() else "nats"
    if choice == "ucx":
        _ucxx()  # a clear error now rather than at the first sync
    return choice


def _ucxx() -> Any:
    """The ucxx module (imported on first use: it loads UCX and starts a progress thread)."""
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows; without this it warns on every start.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx
    except ImportError as exc:
        raise TransportUnavailable(
            f"paramsync.transport ucx needs the ucxx package (pip install 'chorus[ucx]' or ucxx-cu12): {exc}. "
            "Set paramsync.transport to nats to sync through the object store instead.") from exc
    return ucxx


@dataclass
class Held:
    header: WeightsHeader
    buf: Buffer
    pulls: int = 0  # sends in progress from this buffer


# --- trainer side ------------------------------------------------------------------------------------------


class WeightSource(ABC):
    """Trainer side: makes each new version available to the model's rollouters."""

    transport: str

    def __init__(self, cfg: ChorusConfig, names: Names, model: str) -> None:
        self.cfg, self.names, self.model = cfg, names, model
        self.bucket_bytes = int(cfg.paramsync.bucket_mb * 1024 * 1024)
        self.counters: dict[str, int] = {}
        # Where a malformed request is sent with its reason (the owning service's DLQ); None: only counted.
        self.reject: Callable[[str, bytes, str], Awaitable[None]] | None = None

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    async def start(self) -> None:  # noqa: B027 - optional hook
        pass

    def spare(self) -> Buffer | None:
        """A buffer no longer needed, to flatten the next version into (None: allocate)."""
        return None

    @abstractmethod
    async def publish(self, header: WeightsHeader, buf: Buffer, name: str | None = None) -> str | None:
        """Make ``header``'s version available (under object ``name``, transport nats); returns the object name
        (transport nats) or None."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class NatsSource(WeightSource):
    """The object store: one object per version (``weights/<model>/v<N>`` unless named), the last ``KEEP``
    published by this source kept."""

    transport = "nats"
    KEEP = 8  # paramsync or a catching-up rollouter may still be reading a recent one

    def __init__(self, cfg: ChorusConfig, names: Names, model: str, js: JetStreamContext) -> None:
        super().__init__(cfg, names, model)
        self.js = js
        self.chunk_bytes = cfg.paramsync.chunk_kb * 1024
        self._spare: Buffer | None = None
        self._written: deque[str] = deque()

    def spare(self) -> Buffer | None:
        return self._spare

    async def publish(self, header: WeightsHeader, buf: Buffer, name: str | None = None, *,
                      replace: bool = True, prune: bool = True) -> str:
        """Put the version under ``name``; ``replace=False`` when the name is new (saves the lookup of an object
        to replace); ``prune``: delete what is beyond the last ``KEEP`` now (else at :meth:`prune`, off the
        caller's critical path)."""
        name = name or self.names.weights_object(self.model, header.version)
        parts: list[bytes | bytearray | memoryview] = [head(header), byte_view(buf)[: header.nbytes]]  # no join
        for attempt in range(1, PUT_ATTEMPTS + 1):
            try:
                await write_object(self.js, self.names.obj_bucket, name, parts, chunk_bytes=self.chunk_bytes,
                                   timeout_s=PUT_TIMEOUT_S, replace=replace)
                self._spare = buf  # the object store holds its own copy now
                break
            except (TimeoutError, nats.errors.Error) as exc:
                self.count("weights_publish_retries")
                log.warning("weights upload failed", model=self.model, attempt=attempt,
                            error=f"{type(exc).__name__}: {exc}")
                if attempt == PUT_ATTEMPTS:
                    raise
                await asyncio.sleep(0.5 * 2**attempt)
        if name not in self._written:
            self._written.append(name)
        if prune:
            await self.prune()
        return name

    async def prune(self) -> None:
        """Delete the objects this source wrote beyond the last ``KEEP``."""
        while len(self._written) > self.KEEP:
            old = self._written.popleft()
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await asyncio.wait_for(delete_object(self.js, self.names.obj_bucket, old), timeout=30)


class UcxSource(WeightSource):
    """Holds recent versions in memory and sends their buckets to whichever rollouter asks."""

    transport = "ucx"

    def __init__(self, cfg: ChorusConfig, names: Names, model: str, nc: NATS, peer: str | None = None) -> None:
        super().__init__(cfg, names, model)
        self.nc = nc
        self.peer = peer  # this trainer's status subject, for receivers to probe while they wait
        self.keep = cfg.paramsync.keep_versions
        self.send_timeout_s = cfg.paramsync.load_timeout_s
        self.held: OrderedDict[int, Held] = OrderedDict()
        self._free: list[Buffer] = []
        self._endpoints: dict[bytes, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Any] = []

    async def start(self) -> None:
        self.ucxx = _ucxx()
        self._subs = [await self.nc.subscribe(self.names.weights_meta(self.model), cb=self._on_meta),
                      await self.nc.subscribe(self.names.weights_pull(self.model), cb=self._on_pull)]

    def spare(self) -> Buffer | None:
        return self._free.pop() if self._free else None

    async def publish(self, header: WeightsHeader, buf: Buffer, name: str | None = None) -> None:
        self.held[header.version] = Held(header, buf)
        while len(self.held) > self.keep:
            version, old = next(iter(self.held.items()))
            if old.pulls:  # still being sent: keep it a little longer
                break
            del self.held[version]
            if old.buf is not buf:
                self._free = [old.buf]  # one spare is enough: the next flatten takes it
        return None

    async def _reply(self, msg: Msg, reply: WeightsReply) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(encode(reply))

    async def _requested(self, msg: Msg, schema: type, misses: str) -> tuple[Any, Held] | None:
        """Decode a meta or pull request and find the version it names; a bad or unanswerable one is
        counted and answered here."""
        try:
            req: Any = decode(schema, msg.data)
        except DecodeError as exc:
            self.count("bad_weight_requests")
            if self.reject is not None:
                await self.reject(msg.subject, msg.data, exc.reason)
            await self._reply(msg, WeightsReply(ok=False, error=f"rejected: {exc.reason}"))
            return None
        held = self.held.get(req.version)
        if held is None or req.model != self.model:
            self.count(misses)
            await self._reply(msg, WeightsReply(ok=False, held=list(self.held), error=(
                f"{req.model} v{req.version} is not held by this trainer of {self.model} (holds {list(self.held)})")))
            return None
        return req, held

    async def _on_meta(self, msg: Msg) -> None:
        found = await self._requested(msg, WeightsMetaRequest, "meta_misses")
        if found is not None:
            held = found[1]
            await self._reply(msg, WeightsReply(ok=True, header=held.header.pack(), held=list(self.held),
                                                peer=self.peer))

    async def _on_pull(self, msg: Msg) -> None:
        # Callbacks of one subscription run one after another: several instances pull at once in tasks.
        task = asyncio.create_task(self._serve_pull(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_pull(self, msg: Msg) -> None:
        found = await self._requested(msg, WeightsPull, "pull_misses")
        if found is None:
            return
        req, held = found
        t0 = time.perf_counter()
        held.pulls += 1
        ep = None
        try:
            ep = await self._endpoint(req.address)
            view = byte_view(held.buf)
            sends = [ep.send(view[o:o + n], tag=req.tag + i, force_tag=True)
                     for i, (o, n) in enumerate(held.header.buckets)]
            await asyncio.wait_for(asyncio.gather(*sends), self.send_timeout_s)
        except Exception as exc:  # a dead or stuck receiver: drop its endpoint, report, serve the others
            self.count("pull_failures")
            if ep is not None:
                self._drop_endpoint(req.address, ep)
            log.warning("weights send failed", model=self.model, version=req.version, instance=req.instance,
                        error=f"{type(exc).__name__}: {exc}")
            await self._reply(msg, WeightsReply(ok=False, error=f"send failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            held.pulls -= 1
        self.count("pulls")
        self.count("bytes_sent", held.header.nbytes)
        await self._reply(msg, WeightsReply(ok=True, seconds=round(time.perf_counter() - t0, 6)))

    async def _endpoint(self, address: bytes) -> Any:
        ep = self._endpoints.get(address)
        if ep is None:
            addr = self.ucxx.get_ucx_address_from_buffer(address)
            ep = await self.ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)
            self._endpoints[address] = ep
        return ep

    def _drop_endpoint(self, address: bytes, ep: Any) -> None:
        self._endpoints.pop(address, None)
        with contextlib.suppress(Exception):
            ep.abort()

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        for address, ep in list(self._endpoints.items()):
            self._drop_endpoint(address, ep)


# --- rollouter side ----------------------------------------------------------------------------------------


class WeightSink(ABC):
    """Rollouter side: fetches a version into a staging buffer, reused from one version to the next."""

    transport: str

    def __init__(self, names: Names, model: str, instance: str) -> None:
        self.names, self.model, self.instance = names, model, instance
        self._staging: Buffer | None = None

    def staging(self, nbytes: int) -> Buffer:
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = alloc(nbytes)
        return self._staging

    def discard_staging(self) -> None:
        """After a failed transfer: a late write must not land in the buffer of a later version."""
        self._staging = None

    @abstractmethod
    async def fetch(self, version: int, *, object_name: str | None, timeout_s: float) -> tuple[WeightsHeader,
                                                                                                 memoryview]:
        """Header and body of ``version`` (body checked by the caller's :func:`shared.models.weights.load_into`)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class NatsSink(WeightSink):
    transport = "nats"

    def __init__(self, names: Names, model: str, instance: str, js: JetStreamContext) -> None:
        super().__init__(names, model, instance)
        self.js = js

    async def fetch(self, version: int, *, object_name: str | None, timeout_s: float) -> tuple[WeightsHeader,
                                                                                                 memoryview]:
        name = object_name or self.names.weights_object(self.model, version)
        try:
            # the buckets carry XXH3 checksums, checked before loading: the object's SHA-256 would be a second pass
            blob = await read_object(self.js, self.names.obj_bucket, name, timeout_s=timeout_s,
                                     into=self._staging, verify_digest=False)
        except BaseException:
            self.discard_staging()
            raise
        if self._staging is None or blob.obj is not self._staging:
            self._staging = blob.obj  # type: ignore[assignment]
        return unpack(blob)


class UcxSink(WeightSink):
    transport = "ucx"

    def __init__(self, names: Names, model: str, instance: str, nc: NATS, watch: PeerWatch | None = None) -> None:
        super().__init__(names, model, instance)
        self.nc = nc
        self.watch = watch  # probes the trainer during a pull: a dead one fails the fetch in seconds
        self.ucxx = _ucxx()
        self.address = bytes(self.ucxx.get_worker_address())

    async def header(self, version: int, timeout_s: float) -> tuple[WeightsHeader, str | None]:
        """The header of ``version`` and the trainer's status subject."""
        reply = await self._request(self.names.weights_meta(self.model),
                                    WeightsMetaRequest(model=self.model, version=version), timeout_s)
        if reply.header is None:
            raise ValueError("the trainer's header reply is empty")
        return WeightsHeader.unpack(reply.header), reply.peer

    async def fetch(self, version: int, *, object_name: str | None, timeout_s: float) -> tuple[WeightsHeader,
                                                                                                 memoryview]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        header, peer = await self.header(version, min(META_TIMEOUT_S, timeout_s))
        if header.model != self.model or header.version != version:
            raise ValueError(f"asked for {self.model} v{version}, the trainer sent the header of "
                             f"{header.model} v{header.version}")
        view = byte_view(self.staging(header.nbytes))
        buckets = header.buckets
        if len(buckets) >= 2**20:
            raise ValueError(f"{len(buckets)} buckets: raise paramsync.bucket_mb")
        tag = random.getrandbits(40) << 20  # unique per transfer: bucket i arrives with tag + i
        recvs = [asyncio.ensure_future(self.ucxx.recv(view[o:o + n], tag=tag + i))
                 for i, (o, n) in enumerate(buckets)]
        try:
            pull = WeightsPull(model=self.model, version=version, instance=self.instance, address=self.address,
                               tag=tag)
            transfer = self._transfer(pull, recvs, deadline)
            if self.watch is not None and peer:
                with self.watch.watching(peer) as gone:
                    await until_gone(transfer, gone, peer)
            else:
                await transfer
        except BaseException:
            for r in recvs:
                r.cancel()
            self.discard_staging()
            raise
        return header, view[: header.nbytes]

    async def _transfer(self, pull: WeightsPull, recvs: list[asyncio.Future[Any]], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        await self._request(self.names.weights_pull(self.model), pull, max(0.1, deadline - loop.time()))
        # The trainer replied once its sends completed; the receives complete with them.
        await asyncio.wait_for(asyncio.gather(*recvs), max(0.1, deadline - loop.time()))

    async def _request(self, subject: str, req: WeightsMetaRequest | WeightsPull, timeout_s: float) -> WeightsReply:
        try:
            msg = await self.nc.request(subject, encode(req), timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise ConnectionError(f"no trainer of {self.model} answers {subject} (not running?)") from exc
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise TimeoutError(f"no reply from the trainer of {self.model} on {subject} in {timeout_s:.1f}s") from exc
        reply = decode(WeightsReply, msg.data)
        if not reply.ok:
            raise ValueError(f"trainer of {self.model}: {reply.error}")
        return reply


def make_sink(transport: str, names: Names, model: str, instance: str, nc: NATS,
              js: JetStreamContext, watch: PeerWatch | None = None) -> WeightSink:
    if transport == "ucx":
        return UcxSink(names, model, instance, nc, watch)
    if transport == "nats":
        return NatsSink(names, model, instance, js)
    raise ValueError(f"unknown weight transport {transport!r} (one of {TRANSPORTS})")
