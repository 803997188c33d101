"""Peers that die or freeze while a request waits on them: probes, a watch, and requests that are accepted.

A SIGKILLed peer's subscriptions go with its connection, so a request to its status subject gets "no
responders" at once. A frozen one (SIGSTOP, a stuck event loop) keeps them, and its probes go unanswered.
Either way a request waiting on that peer fails within a probe interval or a few instead of its own, much
longer, timeout, and the caller retries it elsewhere.

A request sent to a queue group does not say which instance took it. :class:`ReplyMux` sends it with the
``Chorus-Accept`` header; the instance that takes it answers first with an empty message whose
``Chorus-Accepted`` header is its status subject, then with the reply. The requester watches that subject
meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.kernel.config import PeersSection

T = TypeVar("T")

ACCEPT = "Chorus-Accept"  # request header: answer with an acceptance first
ACCEPTED = "Chorus-Accepted"  # acceptance header: the status subject of the instance that took the request
NO_RESPONDERS = "503"


class Liveness(StrEnum):
    ALIVE = "alive"  # answered
    DEAD = "dead"  # nobody subscribes to its status subject: the process is gone
    SILENT = "silent"  # subscribed but did not answer in time: frozen, or the broker is slow


class PeerGone(ConnectionError):
    """The peer a request was waiting on died or stopped answering probes."""


class NotAccepted(TimeoutError):
    """No instance accepted a request in time (none subscribed would be ``NoRespondersError``)."""


async def probe(nc: NATS, subject: str, timeout_s: float) -> Liveness:
    """One probe of a status subject."""
    try:
        await nc.request(subject, b"", timeout=timeout_s)
    except nats.errors.NoRespondersError:
        return Liveness.DEAD
    except (nats.errors.Error, TimeoutError):  # a timeout, or the connection is reconnecting: cannot tell
        return Liveness.SILENT
    return Liveness.ALIVE


@dataclass
class _Peer:
    subject: str
    waiters: int = 0
    misses: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)


class PeerWatch:
    """Probes the peers this process waits on, while it waits; :meth:`run` is the owner's background loop."""

    def __init__(self, nc: NATS, cfg: PeersSection) -> None:
        self.nc = nc
        self.cfg = cfg
        self._peers: dict[str, _Peer] = {}
        self._wake = asyncio.Event()
        self.counters: dict[str, int] = {"probes": 0, "peers_dead": 0, "peers_silent": 0}

    @contextlib.contextmanager
    def watching(self, subject: str) -> Iterator[asyncio.Event]:
        """Watch ``subject`` while the block runs; the event is set once the peer is judged gone."""
        peer = self._peers.get(subject)
        if peer is None:
            peer = self._peers[subject] = _Peer(subject)
            self._wake.set()
        peer.waiters += 1
        try:
            yield peer.gone
        finally:
            peer.waiters -= 1
            if peer.waiters <= 0 and self._peers.get(subject) is peer:
                del self._peers[subject]

    async def run(self) -> None:
        """Forever: probe every watched peer each ``probe_interval_s`` (idle while none is watched)."""
        while True:
            if not self._peers:
                self._wake.clear()
                await self._wake.wait()
            peers = [p for p in self._peers.values() if not p.gone.is_set()]
            await asyncio.gather(*(self._check(p) for p in peers))
            await asyncio.sleep(self.cfg.probe_interval_s)

    async def _check(self, peer: _Peer) -> None:
        self.counters["probes"] += 1
        state = await probe(self.nc, peer.subject, self.cfg.probe_timeout_s)
        if state is Liveness.ALIVE:
            peer.misses = 0
            return
        peer.misses += 1
        if state is Liveness.DEAD or peer.misses >= self.cfg.misses:
            self.counters["peers_dead" if state is Liveness.DEAD else "peers_silent"] += 1
            peer.gone.set()


async def until_gone(aw: Awaitable[T], gone: asyncio.Event, peer: str) -> T:
    """Await ``aw`` unless ``gone`` is set first, then cancel it and raise :class:`PeerGone`."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise PeerGone(f"{peer} died or stopped answering while a request waited on it")
    finally:
        for t in (work, watch):
            t.cancel()
        for t in (work, watch):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def request_watched(nc: NATS, subject: str, data: bytes, timeout_s: float, watch: PeerWatch,
                          peer: str) -> Msg:
    """``nc.request`` that fails with :class:`PeerGone` as soon as the peer behind ``peer`` (its status subject)
    is gone, instead of waiting out ``timeout_s``."""
    with watch.watching(peer) as gone:
        return await until_gone(nc.request(subject, data, timeout=timeout_s), gone, peer)


async def accept(nc: NATS, msg: Msg, status_subject: str) -> None:
    """Tell the requester that this instance took ``msg``, if it asked (header ``Chorus-Accept``)."""
    if msg.reply and msg.headers and msg.headers.get(ACCEPT):
        with contextlib.suppress(nats.errors.Error):
            await nc.publish(msg.reply, b"", headers={ACCEPTED: status_subject})


class ReplyMux:
    """Requests that are first accepted by one instance, then answered; one wildcard inbox for all of them."""

    def __init__(self, nc: NATS, watch: PeerWatch, cfg: PeersSection) -> None:
        self.nc = nc
        self.watch = watch
        self.cfg = cfg
        self._prefix = ""
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}
        self._next = 0
        self._sub: object | None = None

    async def start(self) -> ReplyMux:
        self._prefix = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self._prefix}.*", cb=self._on_reply)
        return self

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
            self._sub = None

    async def _on_reply(self, msg: Msg) -> None:
        queue = self._waiting.get(msg.subject.rsplit(".", 1)[-1])
        if queue is not None:  # else: a late answer to a request given up on
            queue.put_nowait(msg)

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        """Send ``data`` and return the reply's data.

        Raises ``nats.errors.NoRespondersError`` (nobody subscribes), :class:`NotAccepted` (nobody took it within
        ``peers.accept_timeout_s``), :class:`PeerGone` (the instance that took it died or froze) or
        ``nats.errors.TimeoutError`` (accepted, but no reply within ``timeout_s``).
        """
        self._next += 1
        token = str(self._next)
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[token] = queue
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await self.nc.publish(subject, data, reply=f"{self._prefix}.{token}", headers={ACCEPT: "1"})
            try:
                first = await asyncio.wait_for(queue.get(), min(self.cfg.accept_timeout_s, timeout_s))
            except TimeoutError:
                raise NotAccepted(f"no instance accepted a request on {subject} in "
                                  f"{min(self.cfg.accept_timeout_s, timeout_s):.1f}s") from None
            headers = first.headers or {}
            if headers.get("Status") == NO_RESPONDERS and not first.data:
                raise nats.errors.NoRespondersError
            peer = headers.get(ACCEPTED)
            if peer is None:
                return first.data  # answered at once (a rejection), without an acceptance
            with self.watch.watching(peer) as gone:
                try:
                    reply = await until_gone(asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time())),
                                             gone, peer)
                except TimeoutError:
                    raise nats.errors.TimeoutError from None
            return reply.data
        finally:
            del self._waiting[token]
