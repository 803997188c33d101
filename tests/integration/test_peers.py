"""Requests to a peer that dies or freezes fail once a probe finds it gone (PeerGone), not at their own timeout,
against a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest

from shared.kernel.config import PeersSection
from shared.kernel.peers import (
    ACCEPTED,
    Liveness,
    NotAccepted,
    PeerGone,
    PeerWatch,
    ReplyMux,
    accept,
    probe,
    request_watched,
)

CFG = PeersSection(probe_interval_s=0.2, probe_timeout_s=0.3, misses=2, accept_timeout_s=1.0)


class Peer:
    """A stand-in service instance: a status endpoint, and a work subject it accepts requests on."""

    def __init__(self, nc: nats.NATS, name: str, *, answer_after_s: float | None = 0.1, accepts: bool = True) -> None:
        self.nc, self.name = nc, name
        self.answer_after_s, self.accepts = answer_after_s, accepts
        self.subs: list[object] = []
        self.status = f"{name}.status"

    async def start(self, work: str) -> Peer:
        async def on_status(msg: object) -> None:
            await msg.respond(b"{}")  # type: ignore[attr-defined]

        async def on_work(msg: object) -> None:
            if self.accepts:
                await accept(self.nc, msg, self.status)  # type: ignore[arg-type]
            if self.answer_after_s is not None:
                asyncio.get_running_loop().call_later(
                    self.answer_after_s, lambda: asyncio.ensure_future(msg.respond(b"done:" + msg.data)))  # type: ignore[attr-defined]

        self.subs = [await self.nc.subscribe(self.status, cb=on_status),
                     await self.nc.subscribe(work, queue="q", cb=on_work)]
        return self

    async def die(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()  # type: ignore[attr-defined]
        await self.nc.flush()


async def test_probe_tells_alive_from_dead_from_frozen(nats_url: str, run_id: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        peer = await Peer(nc, f"{run_id}.a").start(f"{run_id}.work")
        assert await probe(nc, peer.status, 1.0) is Liveness.ALIVE
        assert await probe(nc, f"{run_id}.nobody", 1.0) is Liveness.DEAD
        await nc.subscribe(f"{run_id}.frozen.status")  # subscribed, never answers: a SIGSTOPped process
        assert await probe(nc, f"{run_id}.frozen.status", 0.3) is Liveness.SILENT
    finally:
        await nc.close()


async def test_an_accepted_request_is_answered_through_the_mux(nats_url: str, run_id: str) -> None:
    nc = await nats.connect(nats_url)
    watch = PeerWatch(nc, CFG)
    loop = asyncio.create_task(watch.run())
    try:
        await Peer(nc, f"{run_id}.a").start(f"{run_id}.work")
        mux = await ReplyMux(nc, watch, CFG).start()
        answers = await asyncio.gather(*(mux.request(f"{run_id}.work", f"{i}".encode(), 5.0) for i in range(10)))
        assert answers == [f"done:{i}".encode() for i in range(10)]
        assert not watch._peers  # nothing left watched once the requests are done
        # A responder that answers at once, without accepting (a rejection), is answered too.
        await Peer(nc, f"{run_id}.b", accepts=False, answer_after_s=0.0).start(f"{run_id}.plain")
        assert await mux.request(f"{run_id}.plain", b"x", 5.0) == b"done:x"
        with pytest.raises(nats.errors.NoRespondersError):
            await mux.request(f"{run_id}.nobody", b"x", 5.0)
        await nc.subscribe(f"{run_id}.deaf", queue="q")  # takes requests, never accepts them
        with pytest.raises(NotAccepted):  # at the acceptance timeout; the request's own would raise TimeoutError
            await mux.request(f"{run_id}.deaf", b"x", 600.0)
        await mux.close()
    finally:
        loop.cancel()
        await nc.close()


async def test_a_request_to_a_peer_that_dies_fails_as_gone_not_at_its_timeout(nats_url: str, run_id: str) -> None:
    nc = await nats.connect(nats_url)
    watch = PeerWatch(nc, CFG)
    loop = asyncio.create_task(watch.run())
    try:
        mux = await ReplyMux(nc, watch, CFG).start()
        slow = await Peer(nc, f"{run_id}.slow", answer_after_s=None).start(f"{run_id}.work")  # accepts, never answers
        # timeouts of 600 s: their end would raise TimeoutError; PeerGone comes from the probes
        pending = asyncio.create_task(mux.request(f"{run_id}.work", b"x", 600.0))
        await asyncio.sleep(0.5)
        await slow.die()
        with pytest.raises(PeerGone):
            await pending
        assert watch.counters["peers_dead"] == 1

        # Frozen rather than dead: its status subject is still subscribed but never answers.
        frozen = f"{run_id}.frozen.status"
        await nc.subscribe(frozen)
        await nc.subscribe(f"{run_id}.frozen.work")
        with pytest.raises(PeerGone):
            await request_watched(nc, f"{run_id}.frozen.work", b"x", 600.0, watch, frozen)
        assert watch.counters["peers_silent"] == 1
    finally:
        loop.cancel()
        await nc.close()


async def test_an_acceptance_names_the_instance_that_took_the_request(nats_url: str, run_id: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        await Peer(nc, f"{run_id}.a").start(f"{run_id}.work")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"{run_id}.work", b"x", reply=inbox, headers={"Chorus-Accept": "1"})
        first = await sub.next_msg(timeout=5)
        assert first.headers[ACCEPTED] == f"{run_id}.a.status" and first.data == b""
        assert (await sub.next_msg(timeout=5)).data == b"done:x"
        # Without the header (a plain nc.request), there is no acceptance: the reply comes first.
        assert (await nc.request(f"{run_id}.work", b"y", timeout=5)).data == b"done:y"
    finally:
        await nc.close()
