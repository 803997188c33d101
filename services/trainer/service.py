"""Trainer service: pulls micro-batches from the ready stream, accumulates gradients, steps, hands weights on.

Protocol: consumes MicroBatch (msgpack) from durable ``trainer_<model>`` on the ready stream; writes
``trained.<model>`` to KV after every step; after every step (and at start) flattens the shipped weights
into one bucketed buffer, hands it to the weight transport (in memory for UCX pulls, or the object store)
and publishes WeightsAnnounce on ``sync.<model>.announce``; step/drop/done events (JSON) on
``events.trainer``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import nats.errors
from nats.aio.msg import Msg

from services.trainer.grpo import micro_batch_advantages
from services.trainer.intake import SeenIds, StepBook, filter_samples
from services.trainer.learner import Learner
from shared.bus import fetch, kv_put_int_max, pull_consumer
from shared.codec import DecodeError, decode, encode
from shared.logs import append_line
from shared.schemas import DropEvent, MicroBatch, Sample, StepRecord, WeightsAnnounce
from shared.service import Service
from shared.weights import Buffer, WeightsHeader, flatten
from shared.weightsync import WeightSource, make_source

T = TypeVar("T")

FETCH_TIMEOUT_S = 1.0


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class TrainerService(Service):
    """One model's trainer: micro-batches in, one optimizer step per global batch, weights out."""

    name = "trainer"
    per_model = True

    async def setup(self) -> None:
        assert self.model is not None
        self.train = self.cfg.train
        self.ckpt_dir = self.cfg.run_dir / "checkpoints" / self.model
        self.metrics_path = self.cfg.run_dir / "metrics.jsonl"
        self.source: WeightSource = make_source(self.cfg, self.names, self.model, self.nc, self.js)
        await self.source.start()
        self.log.info("weight transport", transport=self.source.transport, bucket_mb=self.cfg.paramsync.bucket_mb)
        self.seen = SeenIds()
        self.book = StepBook()
        self.held: list[Msg] = []  # micro-batches whose gradients are accumulated, acked after the step
        self.queue: list[Msg] = []  # fetched, not yet handled
        self.done = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trainer-{self.model}",
                                        initializer=_init_worker, initargs=(self.train.threads,))
        self.learner: Learner = await self._torch(Learner, self.cfg, self.model)
        restored = await self._torch(self.learner.restore_latest, self.ckpt_dir)
        if restored is not None:
            self.log.info("restored checkpoint", path=str(restored), version=self.learner.version)
        await kv_put_int_max(self.kv, self.names.trained_key(self.model), self.learner.version)
        await self._publish_weights()
        self.sub = await pull_consumer(
            self.js,
            stream=self.names.ready_stream(self.model),
            subject=self.names.ready(self.model),
            durable=self.names.trainer_consumer(self.model),
            ack_wait_s=self.train.ack_wait_s,
            max_ack_pending=max(256, self.cfg.mq.max_ready_msgs),
        )
        if self.learner.version >= self.train.max_versions:
            await self._finish()
        self._consume_task = self.spawn(self._consume_loop(), "consume")
        self.spawn(self._heartbeat_loop(), "heartbeat")

    async def teardown(self) -> None:
        """Finish the message in hand, give unstepped micro-batches back (nak) for prompt redelivery."""
        await self.finish_task(getattr(self, "_consume_task", None), 20)
        for msg in self.held + self.queue:
            await self._safe(msg.nak)
        self.held, self.queue = [], []
        # A late status reply to the last fetch would sit unread in the pull subscription and stall drain().
        await self.release(getattr(self, "sub", None))
        await self.nc.flush(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "source"):
            await self.source.close()

    def extra_metrics(self) -> dict[str, Any]:
        learner = getattr(self, "learner", None)
        return {
            "version": learner.version if learner else 0,
            "accumulated": learner.accumulated if learner else 0,
            "held_msgs": len(getattr(self, "held", [])),
            "done": getattr(self, "done", False),
            **({"weights": dict(self.source.counters)} if hasattr(self, "source") else {}),
        }

    # --- loops ----------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        while not self.stopping and not self.done:
            # Fetch only what the current global batch still needs, so nothing waits through a step.
            missing = self.train.global_batch - self.learner.accumulated
            want = max(1, min(16, math.ceil(missing / self.train.micro_batch)))
            try:
                self.queue = await fetch(self.sub, want, FETCH_TIMEOUT_S)
            except nats.errors.Error as exc:
                self.counters["fetch_errors"] += 1
                self.log.warning("fetch failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)
                continue
            while self.queue and not self.stopping and not self.done:
                await self._handle(self.queue[0])
                self.queue.pop(0)
            # Left over after max_versions: give them back for whoever trains next.
            for msg in self.queue:
                await self._safe(msg.nak)
            self.queue = []

    async def _heartbeat_loop(self) -> None:
        """In-progress acks keep held micro-batches from being redelivered while the batch fills or a step runs."""
        interval = max(0.2, self.train.ack_wait_s / 3)
        while not self.stopping:
            await asyncio.sleep(interval)
            for msg in list(self.held) + list(self.queue):
                await self._safe(msg.in_progress)

    # --- one micro-batch ------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        try:
            mb = decode(MicroBatch, msg.data)
        except DecodeError as exc:
            await self._reject(msg, exc.reason)
            return
        if mb.model != self.model:
            await self._reject(msg, f"micro-batch {mb.batch_id} is for model {mb.model!r}, "
                                    f"this trainer trains {self.model!r}")
            return
        samples = await self._without_invalid(msg.subject, mb)
        version = self.learner.version
        f = filter_samples(samples, version, self.train.max_staleness, self.seen)
        if f.stale:
            self.counters["dropped_stale"] += len(f.stale)
            drop = DropEvent(model=self.model or "", sample_ids=[s.sample_id for s in f.stale],
                             reason=f"staleness > {self.train.max_staleness} at trainer version {version}",
                             count=len(f.stale))
            await self.event("drop", **drop.model_dump(mode="json", exclude={"schema_"}))
        if f.duplicates:
            self.counters["duplicates"] += len(f.duplicates)
        if not f.keep:
            await self._safe(msg.ack)
            return
        t0 = time.perf_counter()
        try:
            await self._torch(self._accumulate, samples, f.keep_idx)
        except (RuntimeError, ValueError, IndexError) as exc:
            self.counters["learner_errors"] += 1
            await self._reject(msg, f"training on micro-batch {mb.batch_id} failed: {type(exc).__name__}: {exc}")
            return
        self.book.compute_s += time.perf_counter() - t0
        self.book.add(f.keep, version)
        self.seen.add_all(s.sample_id for s in f.keep)
        self.counters["samples"] += len(f.keep)
        self.counters["micro_batches"] += 1
        self.held.append(msg)
        if self.learner.ready():
            await self._step()

    async def _without_invalid(self, subject: str, mb: MicroBatch) -> list[Sample]:
        """Samples that cannot be trained go to the DLQ one by one (with the reason); the rest of the batch trains."""
        keep: list[Sample] = []
        bad: list[tuple[Sample, str]] = []
        for s in mb.samples:
            why = (f"sample {s.sample_id} is for model {s.model!r}, this trainer trains {self.model!r}"
                   if s.model != self.model else self.learner.validate(s))
            if why is None:
                keep.append(s)
            else:
                bad.append((s, f"micro-batch {mb.batch_id}: {why}"))
        if bad:
            self.counters["dropped_invalid"] += len(bad)
            for s, why in bad:
                await self.to_dlq(subject, encode(s), why)
            drop = DropEvent(model=self.model or "", sample_ids=[s.sample_id for s, _ in bad],
                             reason=f"invalid: {bad[0][1]}", count=len(bad))
            await self.event("drop", **drop.model_dump(mode="json", exclude={"schema_"}))
        return keep

    def _accumulate(self, samples: Sequence[Sample], keep_idx: list[int]) -> float:
        """Worker thread: each sample's advantage (the coordinator's, else GRPO over the micro-batch's groups of the
        samples without one), then forward/backward of the kept rows."""
        adv = micro_batch_advantages([s.reward for s in samples], [s.group_key for s in samples],
                                     [s.advantage for s in samples])
        return self.learner.accumulate([samples[i] for i in keep_idx], [float(adv[i]) for i in keep_idx])

    async def _reject(self, msg: Msg, reason: str) -> None:
        """DLQ it, then ack: the DLQ holds the copy, and a poison message must not come back forever."""
        await self.to_dlq(msg.subject, msg.data, reason)
        await self._safe(msg.ack)

    # --- step -----------------------------------------------------------------------------
    async def _step(self) -> None:
        t0 = time.perf_counter()
        result = await self._torch(self.learner.step)
        if result is None:
            return
        step_s = self.book.compute_s + (time.perf_counter() - t0)
        await asyncio.gather(*(self._safe(m.ack) for m in self.held))
        self.held = []
        await self.nc.flush(timeout=5)
        assert self.model is not None
        await kv_put_int_max(self.kv, self.names.trained_key(self.model), result.version)
        record = StepRecord(model=self.model, version=result.version, dropped_stale=self.counters["dropped_stale"],
                            step_seconds=round(step_s, 6), loss=result.loss, **self.book.summary())  # type: ignore[arg-type]
        adapter_samples = dict(sorted(self.book.adapters.items()))
        self.book = StepBook()
        self.counters["steps"] += 1
        line = record.model_dump(mode="json", exclude={"schema_"})
        await asyncio.to_thread(append_line, self.metrics_path, json.dumps(line, separators=(",", ":")))
        await self.event("step", **line, grad_norm=result.grad_norm, adapter_samples=adapter_samples, **result.stats)
        self.log.info("step", version=result.version, samples=result.samples, loss=round(result.loss, 5),
                      reward_mean=round(record.reward_mean, 4))
        await self._publish_weights()
        every = self.train.checkpoint_every
        if every and result.version % every == 0:
            path = await self._torch(self.learner.save_checkpoint, self.ckpt_dir)
            self.log.info("checkpoint", path=str(path))
        if result.version >= self.train.max_versions:
            await self._finish()

    async def _finish(self) -> None:
        self.done = True
        self.log.info("max_versions reached; idle until stopped", version=self.learner.version)
        await self.event("done", model=self.model, version=self.learner.version)

    # --- weights --------------------------------------------------------------------------
    def _flatten(self, out: Buffer | None) -> tuple[WeightsHeader, Buffer]:
        return flatten(self.model or "", self.learner.version, self.learner.named_tensors(),
                       bucket_bytes=self.source.bucket_bytes, out=out)

    async def _publish_weights(self) -> None:
        """Flatten the shipped tensors into one bucketed buffer, hand it to the transport, announce it."""
        assert self.model is not None
        header, buf = await self._torch(self._flatten, self.source.spare())
        object_name = await self.source.publish(header, buf)
        ann = WeightsAnnounce(model=self.model, version=header.version, transport=self.source.transport,  # type: ignore[arg-type]
                              object_name=object_name, checksum=header.checksum, nbytes=header.nbytes)
        await self.nc.publish(self.names.sync_announce(self.model), encode(ann))
        self.counters["weights_published"] += 1

    # --- helpers --------------------------------------------------------------------------
    async def _torch(self, fn: Callable[..., T], *args: Any) -> T:
        """Run torch work on the single trainer thread, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def _safe(self, op: Callable[[], Any]) -> None:
        """ack/nak/in-progress; a failure only means redelivery, so it is counted, not raised."""
        try:
            await op()
        except (nats.errors.Error, TimeoutError) as exc:
            self.counters["ack_errors"] += 1
            self.log.warning("ack failed", error=f"{type(exc).__name__}: {exc}")
