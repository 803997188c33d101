"""Mq service: one model's experience queue between the coordinator and the trainer.

Consumes Sample (msgpack) from durable ``mq_<model>`` on the traj stream; drops stale samples (counted, a
``{"kind": "drop", ...DropEvent}`` record written to the events stream on ``events.mq``, then acked); in
async mode sheds the oldest groups beyond ``mq.capacity`` (reason ``overflow``); once the trainer reached
``train.max_versions`` drops everything (reason ``finished``); assembles micro-batches by the store's policy (whole groups, or the
oldest samples under ``train.grouping: trainer``; in sync mode a whole global batch at once) into MicroBatch
(msgpack) on the ready stream (``Nats-Msg-Id`` = sha256 of the sorted sample ids) and acks the samples
only after the PubAck; a full ready stream postpones dispatch without stopping intake; publishes
DepthReport JSON on ``mq.<model>.depth``. Nothing is acked before it is
downstream or recorded as dropped, so a restarted mq is redelivered whatever was unfinished: it starts with a
new consumer, which delivers at once what the last mq held.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js.errors import APIError, NotFoundError

from services.mq.experience_store import AddKind, Dropped, ExperienceStore, Policy, Take
from shared.kernel import events
from shared.kernel.bus import fetch, kv_get_int, pull_consumer, stream_seq
from shared.kernel.codec import DecodeError, encode, encode_json
from shared.kernel.runstate import stage_closed
from shared.kernel.schemas import DepthReport, DropEvent, MicroBatch, Sample
from shared.kernel.service import Service
from shared.kernel.validation import sample_problem
from shared.models.loading import model_limits

FETCH_BATCH = 256
FETCH_TIMEOUT_S = 0.25
# Held samples wait for their group; keep-alive acks stop redelivery, a frozen mq's hold expires after this.
ACK_WAIT_S = 15.0
PUBLISH_TIMEOUT_S = 5.0
BACKOFF_S = (0.05, 1.0)  # first and largest wait between ready-stream publish attempts
STREAM_FULL_CODE = 10077  # JetStream: maximum messages exceeded (DiscardNew)


def batch_id(sample_ids: Sequence[str]) -> str:
    """Idempotency key of a micro-batch: sha256 hex of its sorted sample ids."""
    return hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()


class MqService(Service):
    """Experience store of one model on JetStream."""

    name = "mq"
    per_model = True

    async def setup(self) -> None:
        assert self.model is not None
        # Ids and groups already dispatched or dropped are remembered for a while (a redelivered copy is acked,
        # not sent again); a copy that comes later still is caught by the trainer.
        self.store: ExperienceStore[Msg] = ExperienceStore(self.model, self.cfg.train.max_staleness,
                                                           policy=Policy.of(self.cfg),
                                                           remember=max(10_000, 50 * self.cfg.mq_capacity))
        self.n_groups = self.cfg.micro_batch_groups()
        # The model's vocabulary and context, from its config file (token ids and prompt lengths a rollouter
        # could have produced); unknown until a SmolLM2 is converted, and the trainer checks them again anyway.
        self.limits = await asyncio.to_thread(model_limits, self.cfg, self.model)
        self.trained_version = await kv_get_int(self.kv, self.names.trained_key(self.model))
        self.ready_msgs = 0
        self.samples_per_batch = float(self.n_groups * self.cfg.workflow.group_size)
        self._ready_full_until = 0.0  # monotonic time before which a full ready stream is not retried
        self._full_backoff = BACKOFF_S[0]
        capacity = self.cfg.mq_capacity
        # A new consumer delivers at once what the last mq held unacked (a dead mq's samples would otherwise
        # wait out the ack wait).
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(self.names.traj_stream(self.model), self.names.mq_consumer(self.model))
        self.sub = await pull_consumer(
            self.js,
            stream=self.names.traj_stream(self.model),
            subject=self.names.traj(self.model),
            durable=self.names.mq_consumer(self.model),
            ack_wait_s=ACK_WAIT_S,
            max_ack_pending=4 * capacity + 1000,
        )
        self._main = self.spawn(self._consume_loop(), "consume")
        self.spawn(self._version_loop(), "version")
        self.spawn(self._depth_loop(), "depth")
        self.spawn(self._keepalive_loop(), "keepalive")

    async def teardown(self) -> None:
        """Finish the batch in hand, then give held samples back (nak) so the next mq gets them at once."""
        await self.finish_task(getattr(self, "_main", None), 15)
        store = getattr(self, "store", None)
        if store is not None:
            await self._settle(store.handles(), "nak")
        await self.release(getattr(self, "sub", None))
        await self.nc.flush(timeout=5)

    async def exit_blocker(self) -> str | None:
        """--exit-when-done: the coordinator's last samples are published (``closed.coordinator``) and every one
        of them read and dropped as finished; then ``closed.mq.<model>`` tells the trainer nothing more comes."""
        assert self.model is not None
        if not await stage_closed(self.kv, self.cfg, self.names.coordinator_closed_key()):
            return "the coordinator's last samples"
        info = await self.sub.consumer_info()
        held = self.store.depth()
        if info.num_pending or info.num_ack_pending or held or self.trained_version < self.cfg.train.max_versions:
            return f"samples still to drop as finished: {info.num_pending} unread, {info.num_ack_pending} unacked"
        await self.kv.put(self.names.mq_closed_key(self.model), str(self.cfg.train.max_versions).encode())
        return None

    def extra_metrics(self) -> dict[str, Any]:
        store = getattr(self, "store", None)
        return {
            "depth": self.depth(),
            "held": store.depth() if store else 0,
            "complete_groups": store.complete_groups() if store else 0,
            "ready_msgs": getattr(self, "ready_msgs", 0),
            "trained_version": getattr(self, "trained_version", 0),
            "agents": store.counts() if store else {},
        }

    def depth(self) -> int:
        """Samples in mq plus an estimate of samples waiting in the ready stream for the trainer."""
        store = getattr(self, "store", None)
        held = store.depth() if store else 0
        return held + round(getattr(self, "ready_msgs", 0) * getattr(self, "samples_per_batch", 0.0))

    # --- loops ----------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        """The only writer of the store: intake, staleness, dispatch, in that order, one batch at a time."""
        while not self.stopping:
            try:
                msgs = await fetch(self.sub, FETCH_BATCH, FETCH_TIMEOUT_S)
            except nats.errors.Error as exc:
                self.counters["fetch_errors"] += 1
                self.log.warning("fetch failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)
                continue
            await self._intake(msgs)
            if self.trained_version >= self.cfg.train.max_versions:
                # First: a sample that arrives once the run is over is dropped as finished, whatever its age
                await self._report(self.store.finish())
            await self._report(self.store.set_trained_version(self.trained_version))
            if self.cfg.train.mode == "async":
                # Over capacity (a slow or stalled trainer): the oldest groups go, counted, so memory stays
                # bounded and the coordinator keeps serving the other models.
                await self._report(self.store.shed(self.cfg.mq_capacity))
            await self._dispatch()

    async def _version_loop(self) -> None:
        """Follow the trainer's version in KV; the consume loop applies it to the store."""
        assert self.model is not None
        while not self.stopping:
            try:
                self.trained_version = max(
                    self.trained_version, await kv_get_int(self.kv, self.names.trained_key(self.model))
                )
            except (nats.errors.Error, ValueError) as exc:
                self.counters["kv_errors"] += 1
                self.log.warning("reading trained version failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(min(0.25, self.cfg.mq.report_interval_s))

    async def _depth_loop(self) -> None:
        assert self.model is not None
        while not self.stopping:
            try:
                info = await self.js.stream_info(self.names.ready_stream(self.model))
                self.ready_msgs = info.state.messages
            except nats.errors.Error as exc:
                self.counters["stream_info_errors"] += 1
                self.log.warning("ready stream info failed", error=f"{type(exc).__name__}: {exc}")
            try:
                # Read after the stream: the trainer sets its version before it acks the step's micro-batches, so
                # a report never shows them gone without the version that consumed them (the coordinator paces
                # by trained_version * global_batch + depth).
                self.trained_version = max(
                    self.trained_version, await kv_get_int(self.kv, self.names.trained_key(self.model))
                )
            except (nats.errors.Error, ValueError) as exc:
                self.counters["kv_errors"] += 1
                self.log.warning("reading trained version failed", error=f"{type(exc).__name__}: {exc}")
            report = DepthReport(
                model=self.model, depth=self.depth(), capacity=self.cfg.mq_capacity,
                trained_version=self.trained_version, dropped_stale=self.counters["dropped_stale"],
            )
            await self.publish_quietly(self.names.depth(self.model), encode_json(report))
            await asyncio.sleep(self.cfg.mq.report_interval_s)

    async def _keepalive_loop(self) -> None:
        """In-progress acks keep held samples (waiting for their group) from being redelivered."""
        while not self.stopping:
            await asyncio.sleep(ACK_WAIT_S / 4)
            await self._settle(self.store.handles(), "in_progress")

    # --- steps ----------------------------------------------------------------------------
    async def _intake(self, msgs: list[Msg]) -> None:
        drops: list[Dropped[Msg]] = []
        to_ack: list[Msg] = []
        for msg in msgs:
            try:
                sample = self.decode_own(Sample, msg.data)
                why = sample_problem(sample, self.cfg, *self.limits)
                if why is not None:
                    raise DecodeError(why)
            except DecodeError as exc:
                await self.to_dlq(msg.subject, msg.data, exc.reason)
                await self._settle([msg], "term")
                continue
            res = self.store.add(sample, msg)
            if res.kind is AddKind.NEW:
                self.counters["accepted"] += 1
            elif res.kind is AddKind.DUPLICATE:
                self.counters["duplicates"] += 1
                old = res.settle
                # A redelivery of the same stream message keeps one ack; a re-published copy is spare.
                if old is not None and stream_seq(old) != stream_seq(msg):
                    to_ack.append(old)
            elif res.kind is AddKind.SEEN:
                self.counters["duplicates"] += 1
                if res.settle is not None:
                    to_ack.append(res.settle)
            drops.extend(res.dropped)
        await self._report(drops)
        await self._settle(to_ack, "ack")

    async def _report(self, drops: list[Dropped[Msg]]) -> None:
        """Count and record dropped samples, then ack them (unrecorded, when stopping first: they come back)."""
        assert self.model is not None
        for d in drops:
            self.counters[f"dropped_{d.reason}"] += len(d.sample_ids)
            ev = DropEvent(model=self.model, sample_ids=d.sample_ids, reason=d.reason, count=len(d.sample_ids))
            if await self.record(events.DROP, ev.record_id, **ev.model_dump(by_alias=True),
                                 trained_version=self.trained_version):
                await self._settle(d.handles, "ack")

    async def _dispatch(self) -> None:
        """Publish every micro-batch that is due; a full ready stream postpones the rest, never blocks intake."""
        if time.monotonic() < self._ready_full_until:
            return
        while not self.stopping:
            take = self.store.take_micro_batch()  # sized and timed by the store's policy (train.grouping/mode)
            if take is None:
                return
            if not await self._publish(take):
                self.store.release(take)
                return
            await self._settle(self.store.commit(take), "ack")
            self.counters["micro_batches"] += 1
            self.counters["dispatched"] += len(take.sample_ids)
            # Recent batch sizes make the ready-stream part of the depth estimate.
            self.samples_per_batch = 0.8 * self.samples_per_batch + 0.2 * len(take.sample_ids)

    async def _publish(self, take: Take[Msg]) -> bool:
        """Publish one micro-batch until the ready stream acks it; False if stopping first or the stream is full
        (the trainer pushing back: the batch stays in the store and is tried again after a back-off)."""
        assert self.model is not None
        bid = batch_id(take.sample_ids)
        data = encode(MicroBatch(batch_id=bid, model=self.model, samples=take.samples,
                                 trained_version_seen=self.trained_version))
        wait = BACKOFF_S[0]
        while True:
            try:
                ack = await self.js.publish(self.names.ready(self.model), data, timeout=PUBLISH_TIMEOUT_S,
                                            headers={"Nats-Msg-Id": bid})
                if ack.duplicate:
                    self.counters["republished"] += 1
                self._full_backoff = BACKOFF_S[0]
                return True
            except APIError as exc:
                if exc.err_code == STREAM_FULL_CODE or "maximum messages" in str(exc.description or ""):
                    self.counters["backpressure_waits"] += 1
                    self._ready_full_until = time.monotonic() + self._full_backoff
                    self._full_backoff = min(BACKOFF_S[1], self._full_backoff * 2)
                    return False
                self.counters["publish_errors"] += 1
                self.log.warning("micro-batch publish failed", error=f"{type(exc).__name__}: {exc}")
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters["publish_errors"] += 1
                self.log.warning("micro-batch publish failed", error=f"{type(exc).__name__}: {exc}")
            if self.stopping:
                return False
            await asyncio.sleep(wait)
            wait = min(BACKOFF_S[1], wait * 2)

    async def _settle(self, msgs: Sequence[Msg], how: str) -> None:
        """ack / nak / term / in_progress a batch of messages; a failure is counted, JetStream redelivers."""
        if not msgs:
            return
        calls: list[Callable[[], Awaitable[None]]] = [getattr(m, how) for m in msgs]
        results = await asyncio.gather(*(c() for c in calls), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self.counters[f"{how}_errors"] += len(failed)
            self.log.warning("settling messages failed", how=how, failed=len(failed), error=str(failed[0]))
        self.counters[f"{how}_sent"] += len(msgs) - len(failed)
