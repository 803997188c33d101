"""The coordinator's side of FlexMARL's rollout manager (services/coordinator/balancer.py, docs/balancing.md).

It feeds the manager — registrations from the KV bucket, load reports (heartbeats) from ``rollout.<model>.load``
— and sends each generation request to the instance the manager picks, on that instance's own subject. The
requests of an instance that dies (its status subject has no responder, or it stops answering probes) run again
on another; a request that times out is re-queued on another instance while the first attempt may still answer,
and the first answer wins: a second one is discarded and counted. Every ``balance.poll_s`` the manager compares
the models' queue lengths and asks instances of the least loaded model to serve the most loaded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from services.coordinator.balancer import Attempt, Migration, RolloutManager, plan_migrations
from shared.kernel.bus import kv_keys
from shared.kernel.codec import DecodeError, decode, decode_json_as, encode
from shared.kernel.config import ChorusConfig
from shared.kernel.peers import NotAccepted, PeerGone, ReplyMux
from shared.kernel.schemas import LoadReport, RolloutControl, RolloutControlReply
from shared.kernel.subjects import Names

MAX_LAUNCHES = 8  # attempts of one request, over every instance, before it is given up
BACKOFF_MAX_S = 2.0
REGISTRY_POLL_S = 1.0  # how often the KV registrations are read (an instance joins within this and a report)
# ... at least: a listing reads every registration, so with many instances it is read less often (128: every 6.4 s,
# 1024: every 51 s); an instance's load report at its join still makes it known at once, and one that stops
# reporting is expired after its missed heartbeats whether or not it deregistered
REGISTRY_POLL_PER_INSTANCE_S = 0.05


class NoInstance(LookupError):
    """No live instance of the model is known: the caller sends to the model's queue group instead."""


class Host(Protocol):
    """What the router needs of the service that owns it."""

    nc: NATS
    js: JetStreamContext
    names: Names
    cfg: ChorusConfig
    counters: Counter[str]

    @property
    def stopping(self) -> bool: ...

    @property
    def link_settle_s(self) -> float: ...

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...

    def link_dropped_since(self, t0: float) -> bool: ...

    async def wait_link(self, settle_s: float) -> None: ...

    async def to_dlq(self, subject: str, data: bytes, reason: str) -> None: ...


class RolloutRouter:
    """Least-loaded dispatch of generation requests over the live rollouter instances of each model."""

    def __init__(self, host: Host, mux: ReplyMux, models: list[str], log: Any) -> None:
        self.host = host
        self.mux = mux
        self.models = models
        self.log = log
        bal = host.cfg.balance
        self.manager = RolloutManager(heartbeat_s=host.cfg.heartbeat_s, misses=bal.misses)
        self.migrations: list[dict[str, Any]] = []  # the last ones, for status
        self._last_migration = 0.0
        # instances removed as dead or silent: their KV registration may outlive them (a frozen process keeps it),
        # so only a load report (a sign of life) brings one back, not the registry
        self._gone: set[tuple[str, str]] = set()

    async def start(self) -> None:
        for m in self.models:
            await self.host.nc.subscribe(self.host.names.rollout_load(m), cb=self._on_load)
        await self._read_registry()
        self.host.spawn(self._registry_loop(), "rollout-registry")
        if self.host.cfg.balance.migrate and len(self.models) > 1:
            self.host.spawn(self._migrate_loop(), "rollout-migrate")

    # --- the registry ----------------------------------------------------------------------------------------------
    async def _on_load(self, msg: Msg) -> None:
        try:
            r = decode_json_as(LoadReport, msg.data)
        except DecodeError as exc:
            await self.host.to_dlq(msg.subject, msg.data, f"malformed LoadReport JSON: {exc}")
            return
        if r.model not in self.models:
            return  # another run's model? the subject is per model: only by a misconfigured publisher
        self._gone.discard((r.model, r.instance))
        self.manager.report(r.model, r.instance, time.monotonic(), queued=r.queued_rows, running=r.running_rows,
                            tokens=r.tokens, draining=not r.routing)

    async def _read_registry(self) -> None:
        names = self.host.names
        now = time.monotonic()
        for m in self.models:
            prefix = names.rollouter_prefix(m)
            try:
                keys = await kv_keys(self.host.js, names.kv_bucket, prefix)
            except (nats.errors.Error, TimeoutError):
                return  # the broker is away: the heartbeats still tell who lives
            registered = {k[len(prefix):] for k in keys if len(k) > len(prefix)}
            for name in registered:
                if name not in self.manager.instances.get(m, {}) and (m, name) not in self._gone:
                    self.manager.register(m, name, now)
                    self.host.counters["rollouters_joined"] += 1
            for name in [n for n in self.manager.instances.get(m, {}) if n not in registered]:
                inst = self.manager.instances[m][name]
                if now - inst.last_seen > self.manager.heartbeat_s * self.manager.misses:
                    self.manager.remove(m, name)  # deregistered and silent: gone
                    self.host.counters["rollouters_left"] += 1

    async def _registry_loop(self) -> None:
        last_read = time.monotonic()
        while not self.host.stopping:
            await asyncio.sleep(min(self.manager.heartbeat_s, REGISTRY_POLL_S))
            for model, name, lost in self.manager.expire(time.monotonic()):
                self._gone.add((model, name))
                self.host.counters["rollouters_expired"] += 1
                self.log.warning("rollouter instance missed its heartbeats; removed", model=model, instance=name,
                                 requests_to_rerun=len(lost))
            known = sum(len(v) for v in self.manager.instances.values())
            if time.monotonic() - last_read >= max(REGISTRY_POLL_S, known * REGISTRY_POLL_PER_INSTANCE_S):
                last_read = time.monotonic()
                await self._read_registry()

    # --- dispatch --------------------------------------------------------------------------------------------------
    async def request(self, model: str, rows: int, data: Callable[[], bytes], timeout_s: float) -> bytes:
        """Send a generation request to the least-loaded live instance of ``model`` and return the reply's data.

        Raises :class:`NoInstance` at once when no live instance of ``model`` is known, and ``TimeoutError``
        when ``MAX_LAUNCHES`` attempts got no answer.
        """
        if not self.manager.live(model):
            raise NoInstance(model)
        rid = uuid.uuid4().hex
        pending: dict[asyncio.Task[bytes], Attempt] = {}
        tried: set[str] = set()
        launches = 0
        counters = self.host.counters
        started = time.monotonic()  # since the coordinator's own connection was last steady

        def launch(attempt: Attempt) -> None:
            nonlocal launches
            launches += 1
            tried.add(attempt.instance)
            subject = self.host.names.gen_direct(model, attempt.instance)
            # the first attempt may answer late, after a re-queue: it waits twice as long before it gives up
            pending[asyncio.ensure_future(self.mux.request(subject, data(), 2 * timeout_s))] = attempt

        try:
            while True:
                if not pending:
                    if self.host.link_dropped_since(started):  # the coordinator's own link: no attempt is spent
                        counters["gen_waits_for_link"] += 1
                        await self.host.wait_link(self.host.link_settle_s)
                        started, launches, tried = time.monotonic(), 0, set()
                        continue
                    if launches >= MAX_LAUNCHES or self.host.stopping:
                        raise TimeoutError(f"generation for {model}: no answer after {launches} attempt(s)")
                    attempt = (self.manager.dispatch(rid, model, rows, exclude=tried)
                               or self.manager.dispatch(rid, model, rows))
                    if attempt is None:  # every instance gone or draining: wait for one to come (back)
                        counters["gen_waits_for_instance"] += 1
                        launches += 1
                        await asyncio.sleep(_backoff(launches))
                        continue
                    launch(attempt)
                done, _ = await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # timed out: re-queue on another instance, keep waiting for the first as well
                    if len(pending) == 1 and launches < MAX_LAUNCHES:
                        again = self.manager.requeue(next(iter(pending.values())))
                        if again is not None:
                            counters["gen_requeued"] += 1
                            launch(again)
                            continue
                    # nowhere else to go: the attempts in flight run out their own (longer) timeout
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    attempt = pending.pop(task)
                    answer = self._outcome(task, attempt)
                    if answer is None:
                        continue
                    if self.manager.finish(attempt):
                        for other_task, other in pending.items():
                            other_task.cancel()
                            self.manager.finish(other)  # its answer, if it comes, is not used: discarded, counted
                        pending.clear()
                        return answer
                if not pending:
                    await asyncio.sleep(_backoff(launches))
        finally:
            for task, attempt in pending.items():
                task.cancel()
                self.manager.abandon(attempt)
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _outcome(self, task: asyncio.Task[bytes], attempt: Attempt) -> bytes | None:
        """The reply of a finished attempt, or None after accounting why it has none."""
        counters = self.host.counters
        if task.cancelled():
            self.manager.abandon(attempt)
            return None
        exc = task.exception()
        if exc is None:
            return task.result()
        if isinstance(exc, PeerGone):  # it died or froze with the request: its other requests go elsewhere too
            counters["gen_peer_gone"] += 1
            lost = self.manager.remove(attempt.model, attempt.instance)
            self._gone.add((attempt.model, attempt.instance))
            self.log.warning("rollouter instance gone with requests in flight; running them elsewhere",
                             model=attempt.model, instance=attempt.instance, requests=len(lost) or 1)
            return None
        self.manager.abandon(attempt)
        if isinstance(exc, nats.errors.NoRespondersError):  # out of routing (or just died): no new requests
            counters["gen_no_responders"] += 1
            self.manager.suspend(attempt.model, attempt.instance)
        elif isinstance(exc, NotAccepted):
            counters["gen_not_accepted"] += 1
        elif isinstance(exc, nats.errors.TimeoutError | TimeoutError):
            counters["gen_timeouts"] += 1
        elif isinstance(exc, nats.errors.Error):
            counters["gen_connection_errors"] += 1
        else:
            raise exc
        return None

    # --- inter-agent balancing -------------------------------------------------------------------------------------
    async def _migrate_loop(self) -> None:
        bal = self.host.cfg.balance
        polls: deque[dict[str, int]] = deque(maxlen=bal.window)
        while not self.host.stopping:
            await asyncio.sleep(bal.poll_s)
            polls.append({m: q for m, q in self.manager.queue_lengths().items() if m in self.models})
            if time.monotonic() - self._last_migration < bal.cooldown_s or len(polls) < bal.window:
                continue
            # the mean of the last `window` polls: a burst on one model does not move instances back and forth
            queues = {m: round(sum(p.get(m, 0) for p in polls) / len(polls)) for m in self.models}
            live = {m: self.manager.live(m) for m in self.models if self.manager.live(m)}
            loads = {m: {n: i.load for n, i in self.manager.instances.get(m, {}).items()} for m in live}
            for mig in plan_migrations(queues, live, bal.delta, loads):
                self._last_migration = time.monotonic()
                polls.clear()  # the next decision sees only the loads after this one
                await self.migrate(mig, queues)

    async def migrate(self, mig: Migration, queues: dict[str, int]) -> None:
        """Ask each instance of ``mig`` to serve the target model; until it registers there it takes no request."""
        for name in mig.instances:
            self.manager.suspend(mig.donor, name)
            ctl = RolloutControl(verb="migrate", version=0, target=mig.target, timeout_s=60.0)
            subject = self.host.names.rollout_control(mig.donor, name, "migrate")
            reply: RolloutControlReply | None = None
            try:
                got = decode(RolloutControlReply, (await self.host.nc.request(subject, encode(ctl), timeout=5.0)).data)
            except (nats.errors.Error, TimeoutError, DecodeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                reply, error = got, got.error or ""
            if reply is None or not reply.ok:
                self.host.counters["migrate_errors"] += 1
                self.log.warning("migration refused or unanswered", instance=name, target=mig.target, error=error)
                continue
            self.host.counters["migrations"] += 1
            self.migrations = [*self.migrations[-9:], {"from": mig.donor, "to": mig.target, "instance": name,
                                                       "queues": dict(queues), "time": time.time()}]
            self.log.info("migrating a rollouter instance", instance=name, donor=mig.donor, target=mig.target,
                          queues=queues)

    # --- status ----------------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        m = self.manager
        return {
            "queues": m.queue_lengths(),
            "instances": {model: {n: {"load": i.load, "requests": i.requests, "draining": i.draining}
                                  for n, i in sorted(insts.items())} for model, insts in sorted(m.instances.items())},
            "counters": dict(m.counters),
            "migrations": self.migrations[-5:],
        }


def _backoff(attempt: int) -> float:
    return min(BACKOFF_MAX_S, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
