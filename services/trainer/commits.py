"""The trainer's durable commits: every version's weights and state in the object store, and one commit point.

KV ``weights.<model>`` holds the WeightsAnnounce of the newest committed version, naming its two objects
(``weights/<model>/v<N>-<epoch>``: the flat weights any rollouter can load; ``state/<model>/v<N>-<epoch>``: the
trainer's state). A version is committed once both objects are written and that key moved to it by
compare-and-swap against the revision this trainer last read or wrote: a second trainer of the same model (one
that was frozen and woke up) loses the swap and stops, so there is only ever one line of versions. ``epoch``
differs per trainer incarnation, so the loser never overwrote the winner's objects either.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.kernel.bus import delete_object, object_names, read_object, write_object
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.schemas import WeightsAnnounce
from shared.kernel.subjects import Names
from shared.models.weights import Buffer, WeightsHeader
from shared.models.weightsync import NatsSource

log = structlog.get_logger("trainer.commits")

KEEP_STATES = 2  # committed states kept; the newest is the one a restart reads
ATTEMPTS = 5
BACKOFF_S = 0.5


class Fenced(RuntimeError):
    """Another trainer of this model committed since this one last did: this one is stale and must stop."""


class CommitPointError(RuntimeError):
    """The commit point names a state that cannot be read back."""


class Commits:
    """Writes and reads one model's commits."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, names: Names, model: str, weights: NatsSource,
                 epoch: str, chunk_bytes: int) -> None:
        self.js, self.kv, self.names, self.model = js, kv, names, model
        self.weights = weights  # writes the weights objects (and keeps the last NatsSource.KEEP of them)
        self.epoch = epoch
        self.chunk_bytes = chunk_bytes
        self.revision = 0  # of the commit point as this trainer last read or wrote it; 0: no commit yet
        self._states: deque[str] = deque()
        self.seconds = 0.0  # time spent committing, for the metrics
        self.last_seconds = 0.0

    @property
    def key(self) -> str:
        return self.names.weights_key(self.model)

    async def latest(self) -> WeightsAnnounce | None:
        """The newest commit, remembered as the base of the next compare-and-swap."""
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            self.revision = 0
            return None
        self.revision = int(entry.revision or 0)
        try:
            return decode(WeightsAnnounce, entry.value or b"")
        except DecodeError as exc:
            raise CommitPointError(f"KV {self.key} does not hold a WeightsAnnounce: {exc.reason}") from exc

    async def read(self, ann: WeightsAnnounce) -> tuple[memoryview, memoryview]:
        """The committed weights object (``[header][flat buffer]``) and state of ``ann``."""
        if not ann.state_object or not ann.object_name:
            raise CommitPointError(f"commit of {self.model} v{ann.version} does not name its objects")
        out = []
        for name in (ann.object_name, ann.state_object):
            try:
                out.append(await read_object(self.js, self.names.obj_bucket, name, timeout_s=120,
                                             verify_digest=name == ann.state_object))
            except nats.js.errors.NotFoundError as exc:
                raise CommitPointError(f"{name}, committed for {self.model} v{ann.version}, is missing from the "
                                       "object store") from exc
        return out[0], out[1]

    async def commit(self, header: WeightsHeader, buf: Buffer, state: bytes, transport: str) -> WeightsAnnounce:
        """Write both objects of ``header.version``, then move the commit point to it; raises :class:`Fenced`."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        version = header.version
        weights_name = self.names.weights_object(self.model, version, self.epoch)
        state_name = self.names.state_object(self.model, version, self.epoch)
        await asyncio.gather(self.weights.publish(header, buf, weights_name, replace=False, prune=False),
                             self._put(state_name, state))
        ann = WeightsAnnounce(model=self.model, version=version, transport=transport,
                              object_name=weights_name, checksum=header.checksum, nbytes=header.nbytes,
                              state_object=state_name)
        await self._swap(ann)
        self._states.append(state_name)
        self.last_seconds = loop.time() - t0
        self.seconds += self.last_seconds
        return ann

    async def prune(self) -> None:
        """Delete the states and weights beyond what is kept (after the commit's acks and announce: off the
        critical path of a step)."""
        while len(self._states) > KEEP_STATES:
            old = self._states.popleft()
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await delete_object(self.js, self.names.obj_bucket, old)
        await self.weights.prune()

    async def _put(self, name: str, data: bytes) -> None:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                await write_object(self.js, self.names.obj_bucket, name, [data], chunk_bytes=self.chunk_bytes,
                                   replace=False)
                return
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("state upload failed", model=self.model, object=name, attempt=attempt,
                            error=f"{type(exc).__name__}: {exc}")
                if attempt == ATTEMPTS:
                    raise
                await asyncio.sleep(BACKOFF_S * attempt)

    async def _swap(self, ann: WeightsAnnounce) -> None:
        """Compare-and-swap the commit point from ``self.revision`` to ``ann``. A lost reply is told from a lost
        race by reading the key back: holding our announce of this version means our write went through."""
        data = encode(ann)
        for attempt in range(1, ATTEMPTS + 1):
            try:
                if self.revision:
                    self.revision = await self.kv.update(self.key, data, last=self.revision)
                else:
                    self.revision = await self.kv.create(self.key, data)
                return
            except KeyWrongLastSequenceError:
                if await self._ours(ann):
                    return
                raise Fenced(f"another trainer of {self.model} committed since revision {self.revision}; "
                             f"this one (epoch {self.epoch}) is stale") from None
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("commit point update failed", model=self.model, version=ann.version, attempt=attempt,
                            error=f"{type(exc).__name__}: {exc}")
                if attempt == ATTEMPTS:
                    raise
                await asyncio.sleep(BACKOFF_S * attempt)
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    if await self._ours(ann):
                        return

    async def _ours(self, ann: WeightsAnnounce) -> bool:
        """Whether the commit point holds ``ann``'s version as this trainer wrote it: the same objects, whose names
        carry this trainer's epoch. Not the same bytes: a commit retried after its reply was lost (the broker away
        past the swap's attempts) announces the same objects again with a new ``created_at``."""
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return False
        try:
            held = decode(WeightsAnnounce, entry.value or b"")
        except DecodeError:
            return False
        if (held.version, held.object_name, held.state_object, held.checksum) == (
                ann.version, ann.object_name, ann.state_object, ann.checksum):
            self.revision = int(entry.revision or 0)
            return True
        return False

    async def sweep(self, current: WeightsAnnounce | None) -> int:
        """Delete objects of this model that no commit needs (states other than the current one, weights older
        than the last ``NatsSource.KEEP`` versions, any other than the committed one of the newest version or later);
        returns how many. Weights of recent versions stay for rollouters catching up."""
        keep = {current.object_name, current.state_object} if current else set()
        newest = current.version if current else 0
        removed = 0
        for name in await object_names(self.js, self.names.obj_bucket):
            version = Names.object_version(self.model, name)
            if version is None or name in keep:
                continue
            if name.startswith("state/") or version <= newest - NatsSource.KEEP or version >= newest:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    removed += await delete_object(self.js, self.names.obj_bucket, name)
        return removed
