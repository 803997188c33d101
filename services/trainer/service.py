"""Trainer service: pulls micro-batches from the ready stream, accumulates gradients, steps, commits, hands
weights on.

Protocol: consumes MicroBatch (msgpack) from durable ``trainer_<model>`` on the ready stream. Every optimizer
step is committed before anything else happens (:mod:`services.trainer.commits`): the version's weights and
state go to the object store and KV ``weights.<model>`` moves to it by compare-and-swap. Then, in order: KV
``trained.<model>``, the step record on ``events.trainer`` (written to the events stream), the acks of the
micro-batches it trained, the weights handed to the transport (held in memory for UCX pulls) and a
WeightsAnnounce on ``sync.<model>.announce``. Nothing acked can be lost with the process: a restarted trainer
reads the commit back and continues from it; the micro-batches of a step it lost come back unacked. Drops
(stale, invalid, finished) are recorded before their micro-batch is acked; done (JSON) on ``events.trainer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from services.trainer.backends import TrainerBackend, make_learner
from services.trainer.commits import CommitPointError, Commits, Fenced
from services.trainer.intake import SeenIds, StepBook, filter_samples
from services.trainer.learner import StepResult, adapter_problem
from services.trainer.pool import PooledLearner, TrainingPool
from services.trainer.state import Committed, RecentSteps, pack_state, steps_remembered, unpack_state
from services.trainer.zero import TrainerGroup
from shared.kernel import events
from shared.kernel.bus import fetch, kv_put_int_max, pull_consumer, stream_seq
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.config import ConfigError
from shared.kernel.logs import append_line
from shared.kernel.memcap import LAST_EXIT_ENV, advice
from shared.kernel.runstate import stage_closed
from shared.kernel.schemas import DropEvent, MicroBatch, Sample, StepRecord, WeightsAnnounce
from shared.kernel.service import Service
from shared.kernel.validation import sample_problem
from shared.models.loading import resolve_device
from shared.models.weights import Buffer, WeightsHeader, flatten, load_into, unpack
from shared.models.weightsync import NatsSource, UcxSource, WeightSource, resolve_transport
from shared.results.tracking import Trackers

T = TypeVar("T")

FETCH_TIMEOUT_S = 1.0
COMMIT_BACKOFF_S = (0.5, 5.0)  # first and largest wait between attempts to commit while the broker is away
FINISHED = "finished"  # drop reason: arrived after the model reached train.max_versions


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class TrainerService(Service):
    """One model's trainer: micro-batches in, one optimizer step per global batch, each committed, weights out."""

    name = "trainer"
    per_model = True
    trackers: Trackers | None = None  # logging.backends, opened at the first step
    pool: TrainingPool | None = None  # train.pool: the training pool this trainer is a tenant of (its learner's slots)

    async def setup(self) -> None:
        assert self.model is not None
        if self.cfg.train.pool.slots and self.pool is None:
            raise ConfigError(f"train.pool.slots is {self.cfg.train.pool.slots}: every model trains in one training "
                              "pool, served by `chorus serve trainer` without --model")
        # First: a device this machine lacks is a config error (models.<m>.device), before anything is started.
        self.device = resolve_device(self.cfg, self.model)
        self.log.info("device", device=str(self.device), dtype=self.cfg.models[self.model].dtype)
        self.train = self.cfg.train
        self.ckpt_dir = self.cfg.run_dir / "checkpoints" / self.model
        self.metrics_path = self.cfg.run_dir / "metrics.jsonl"
        # Every version's weights go to the object store (a restarted rollouter can always load the served one);
        # with transport ucx the trainer also serves them from memory.
        durable = NatsSource(self.cfg, self.names, self.model, self.js)
        self.source: WeightSource = durable if resolve_transport(self.cfg) == "nats" else \
            UcxSource(self.cfg, self.names, self.model, self.nc, self.status_subject)
        self.source.reject = self.to_dlq
        await self.source.start()
        self.log.info("weight transport", transport=self.source.transport, bucket_mb=self.cfg.paramsync.bucket_mb)
        self.epoch = uuid.uuid4().hex[:8]
        self.commits = Commits(self.js, self.kv, self.names, self.model, durable, self.epoch,
                               self.cfg.paramsync.chunk_kb * 1024)
        # Ids trained in the remembered steps, and in the accumulating one: a copy is a duplicate, not a sample.
        self.remembered = steps_remembered(self.train.max_staleness)
        self.seen = SeenIds(self.remembered * (self.train.global_batch + self.train.micro_batch))
        self.recent = RecentSteps(self.remembered)
        self.book = StepBook()
        self.held: list[Msg] = []  # micro-batches of the accumulating step, acked once it is committed
        self.queue: list[Msg] = []  # fetched, not yet handled
        self.done = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trainer-{self.model}",
                                        initializer=_init_worker, initargs=(self.train.threads,))
        await self._last_exit()  # before the learner is built: a learner that cannot be built is what it says
        # the torch learner, rank 0 of a DeepSpeed trainer group (models.<m>.trainer.backend), or a tenant of the
        # training pool (train.pool): services/trainer/backends.py
        self.learner: TrainerBackend
        if self.pool is not None:
            self.learner = await self._torch(PooledLearner, self.pool, self.model)
        else:
            self.learner = await self._torch(make_learner, self.cfg, self.model, self.train.threads)
        if isinstance(self.learner, TrainerGroup):
            self.log.info("trainer group", backend="deepspeed", ranks=self.learner.world,
                          zero_stage=self.learner.stage)
            self.spawn(self._group_watch(), "group-watch")
        await self._restore()
        await self._release(False)
        # A new consumer delivers at once what the last one held unacked (a dead trainer's micro-batches would
        # otherwise wait out the ack wait).
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(self.names.ready_stream(self.model), self.names.trainer_consumer(self.model))
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
        """Finish the message in hand, give uncommitted micro-batches back (nak) for prompt redelivery."""
        await self.finish_task(getattr(self, "_consume_task", None), 20)
        for msg in self.held + self.queue:
            await self._safe(msg.nak)
        self.held, self.queue = [], []
        # A late status reply to the last fetch would sit unread in the pull subscription and stall drain().
        await self.release(getattr(self, "sub", None))
        await self.nc.flush(timeout=5)
        if getattr(self, "learner", None) is not None:
            await self._torch(self.learner.close)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.trackers is not None:
            await asyncio.to_thread(self.trackers.close)
        if hasattr(self, "source"):
            await self.source.close()

    def extra_metrics(self) -> dict[str, Any]:
        learner = getattr(self, "learner", None)
        return {
            "version": learner.version if learner else 0,
            "accumulated": learner.accumulated if learner else 0,
            "held_msgs": len(getattr(self, "held", [])),
            "done": getattr(self, "done", False),
            "epoch": getattr(self, "epoch", None),
            "commit_s": round(self.commits.seconds, 3) if hasattr(self, "commits") else 0.0,
            "committing": getattr(self, "committing", None),  # the version being committed (objects, then KV)
            **({"weights": dict(self.source.counters)} if hasattr(self, "source") else {}),
        }

    # --- start: the last commit, or a first one -------------------------------------------
    async def _restore(self) -> None:
        """Continue from the newest commit; with none, from the newest checkpoint file (or fresh weights), which
        is committed first. Then the step record of that version is written again (it may have been lost with
        the last trainer), old objects are swept and the version is announced."""
        assert self.model is not None
        ann = await self.commits.latest()
        record = None
        if ann is not None:
            weights, state = await self.commits.read(ann)
            committed: Committed = await self._torch(self._load_commit, ann, weights, state)
            self.recent = committed.recent
            self.seen.add_all(self.recent.ids())
            record = committed.record
            await self._hold_in_memory()
            group = {"group_loaded": self.learner.loaded} if isinstance(self.learner, TrainerGroup) else {}
            self.log.info("restored the committed version", version=ann.version, state=ann.state_object,
                          epoch=self.epoch, **group)
        else:
            path = await self._torch(self.learner.restore_latest, self.ckpt_dir)
            if path is not None:
                self.log.info("restored checkpoint file", path=str(path), version=self.learner.version)
            ann = await self._commit(None)
            if ann is None:  # stopping before the first commit: nothing to announce
                return
        self.counters["objects_swept"] += await self.commits.sweep(ann)
        await self._set_trained(ann.version)
        if record is not None:
            await self._record_step(record)
        await self._announce(ann)

    async def _hold_in_memory(self) -> None:
        """Transport ucx: hold the restored version's flat buffer for pulls (it was committed by the last trainer)."""
        if isinstance(self.source, UcxSource):
            header, buf = await self._torch(self._flatten, self.source.spare())
            await self.source.publish(header, buf)

    async def exit_blocker(self) -> str | None:
        """--exit-when-done: the model's mq sends nothing more (``closed.mq.<model>``) and every micro-batch of
        the ready stream is read and dropped as finished."""
        assert self.model is not None
        if not await stage_closed(self.kv, self.cfg, self.names.mq_closed_key(self.model)):
            return "the mq's last micro-batches"
        info = await self.sub.consumer_info()
        if info.num_pending or info.num_ack_pending or self.queue or self.held:
            return f"micro-batches still to drop as finished: {info.num_pending} unread, {info.num_ack_pending} unacked"
        return None

    # --- loops ----------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        while not self.stopping:
            # Fetch only what the current global batch still needs, so nothing waits through a step.
            missing = self.train.global_batch - self.learner.accumulated
            want = 16 if self.done else max(1, min(16, math.ceil(missing / self.train.micro_batch)))
            try:
                self.queue = await fetch(self.sub, want, FETCH_TIMEOUT_S)
            except nats.errors.Error as exc:
                self.counters["fetch_errors"] += 1
                self.log.warning("fetch failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)
                continue
            while self.queue and not self.stopping:
                await self._handle(self.queue[0])
                self.queue.pop(0)
                await self._release(bool(self.queue))

    async def _last_exit(self) -> None:
        """The supervisor's word that the OOM killer ended this trainer's last start (CHORUS_LAST_EXIT): said again
        as an event and a counter, by model, with what to change."""
        raw = os.environ.get(LAST_EXIT_ENV)
        if not raw:
            return
        try:
            last = json.loads(raw)
        except ValueError:
            return
        if isinstance(last, dict) and isinstance(last.get("out_of_memory"), dict):
            self.counters["oom_kills"] = int(last.get("count") or 1)
            self.log.error("the last start of this trainer was killed by the kernel's out-of-memory killer",
                           who=last.get("who"), evidence=last.get("evidence"), advice=last.get("advice"))
            await self.event(events.OUT_OF_MEMORY, **{k: last.get(k) for k in ("who", "evidence", "advice", "count",
                                                                               "out_of_memory")})

    async def _group_watch(self) -> None:
        """A DeepSpeed group lives and dies whole: a rank that exits stops this service (its ranks go with it), and
        the supervisor starts the group again from the committed version. A rank the OOM killer ended is said so."""
        assert isinstance(self.learner, TrainerGroup)
        while not self.stopping:
            await asyncio.sleep(0.5)
            if not self.learner.alive():
                codes = self.learner.exit_codes()
                self.counters["group_rank_exits"] += 1
                for rank, oom in self.learner.out_of_memory():
                    self.counters["oom_kills"] += 1
                    hint = advice(self.learner.model_name, "deepspeed", self.learner.world, self.learner.stage)
                    self.log.error("a rank of the trainer group was killed by the kernel's out-of-memory killer",
                                   rank=rank, evidence=oom.evidence(), advice=hint)
                    await self.event(events.OUT_OF_MEMORY, who=f"rank {rank}", evidence=oom.evidence(), advice=hint,
                                     count=self.counters["oom_kills"], out_of_memory=oom.as_dict())
                self.log.error("a rank of the trainer group exited: stopping the group", ranks=codes)
                self.stop(1)
                return

    async def _heartbeat_loop(self) -> None:
        """In-progress acks keep held micro-batches from being redelivered while the batch fills or a step runs."""
        interval = max(0.2, self.train.ack_wait_s / 3)
        while not self.stopping:
            await asyncio.sleep(interval)
            for msg in list(self.held) + list(self.queue):
                await self._safe(msg.in_progress)

    # --- one micro-batch ------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        seq = stream_seq(msg)
        for i, held in enumerate(self.held):
            if seq is not None and stream_seq(held) == seq:
                # Redelivered while its step was still accumulating (a long stall): keep the newest delivery.
                self.held[i] = msg
                self.counters["redelivered_held"] += 1
                return
        try:
            mb = decode(MicroBatch, msg.data)
        except DecodeError as exc:
            await self._reject(msg, exc.reason)
            return
        if mb.model != self.model:
            await self._reject(msg, f"micro-batch {mb.batch_id} is for model {mb.model!r}, "
                                    f"this trainer trains {self.model!r}")
            return
        if self.done:
            if await self._drop(mb.samples, FINISHED, f"{FINISHED}: arrived after train.max_versions "
                                                      f"({self.train.max_versions})"):
                await self._safe(msg.ack)
            return
        samples = await self._without_invalid(msg.subject, mb)
        if samples is None:
            return  # stopping before the drop was recorded: the micro-batch comes back
        version = self.learner.version
        f = filter_samples(samples, version, self.train.max_staleness, self.seen)
        if f.stale:
            self.counters["dropped_stale"] += len(f.stale)
            if not await self._drop(f.stale, "stale", f"staleness > {self.train.max_staleness} at trainer "
                                                      f"version {version}"):
                return
        if f.duplicates:
            self.counters["duplicates"] += len(f.duplicates)
        if not f.keep:
            accumulating = set(self.book.sample_ids)
            if any(s.sample_id in accumulating for s in f.duplicates):
                self.held.append(msg)  # a copy of samples of the uncommitted step: acked with that step
            else:
                await self._safe(msg.ack)
            return
        t0 = time.perf_counter()
        try:
            await self._torch(self._accumulate, samples, f.keep_idx)
        except (RuntimeError, ValueError, IndexError) as exc:
            self.counters["learner_errors"] += 1
            why = f"training on micro-batch {mb.batch_id} failed: {type(exc).__name__}: {exc}"
            if await self._drop(f.keep, "learner_error", why):
                await self._reject(msg, why)
            return
        self.book.compute_s += time.perf_counter() - t0
        self.book.add(f.keep, version)
        self.seen.add_all(s.sample_id for s in f.keep)
        self.counters["samples"] += len(f.keep)
        self.counters["micro_batches"] += 1
        self.held.append(msg)
        if self.learner.ready():
            await self._step()

    async def _drop(self, samples: Sequence[Sample], reason: str, detail: str) -> bool:
        """Record a drop (before the caller acks); False if the service stopped before it was recorded."""
        return await self._drop_ids([s.sample_id for s in samples], reason, detail)

    async def _drop_ids(self, ids: list[str], reason: str, detail: str) -> bool:
        assert self.model is not None
        if reason == FINISHED:
            self.counters["dropped_finished"] += len(ids)
        drop = DropEvent(model=self.model, sample_ids=ids, reason=reason, count=len(ids), detail=detail)
        return await self.record(events.DROP, drop.record_id, **drop.model_dump(mode="json", exclude={"schema_"}))

    async def _without_invalid(self, subject: str, mb: MicroBatch) -> list[Sample] | None:
        """Samples that cannot be trained go to the DLQ one by one (with the reason); the rest of the batch trains.
        None if the service stopped before their drop was recorded."""
        keep: list[Sample] = []
        bad: list[tuple[Sample, str]] = []
        for s in mb.samples:
            why = (f"sample {s.sample_id} is for model {s.model!r}, this trainer trains {self.model!r}"
                   if s.model != self.model else self._sample_problem(s))
            if why is None and s.version > self.learner.version:
                why = (f"sample {s.sample_id} claims weight version {s.version}, newer than this trainer's "
                       f"{self.learner.version}: no rollouter could have served it")
            if why is None:
                keep.append(s)
            else:
                bad.append((s, f"micro-batch {mb.batch_id}: {why}"))
        if bad:
            self.counters["dropped_invalid"] += len(bad)
            for s, why in bad:
                await self.to_dlq(subject, encode(s), why)
            if not await self._drop([s for s, _ in bad], "invalid", f"invalid: {bad[0][1]}"):
                return None
        return keep

    def _sample_problem(self, s: Sample) -> str | None:
        """The run's checks of a sample, with this learner's vocabulary and context, then its adapters."""
        why = sample_problem(s, self.cfg, self.learner.vocab_size, self.learner.context)
        adapter = None if why is not None else adapter_problem(s, self.learner.adapters)
        return why if adapter is None else f"sample {s.sample_id}: {adapter}"

    def _accumulate(self, samples: Sequence[Sample], keep_idx: list[int]) -> float:
        """Worker thread: the kept samples' advantages and their forward/backward (:meth:`Learner.micro_batch`)."""
        return self.learner.micro_batch(samples, keep_idx, self.cfg.train.advantage)

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
        assert self.model is not None
        if result.skipped:
            await self._skip_step(result)
            return
        if not await self._drop_untrained(result):
            return  # stopping before the drops were recorded: the micro-batches come back
        step_s = self.book.compute_s + (time.perf_counter() - t0)
        summary = self.book.summary()
        gone = {i for ids in result.untrained.values() for i in ids}
        if gone:  # MARFT: in the step's batch, not trained by it (recorded as dropped above)
            kept = [i for i in self.book.sample_ids if i not in gone]
            summary["sample_ids"], summary["samples"] = kept, len(kept)
        record = StepRecord(model=self.model, version=result.version, dropped_stale=self.counters["dropped_stale"],
                            step_seconds=round(step_s, 6), loss=result.loss, **summary)
        line = record.model_dump(mode="json", exclude={"schema_"})
        fields = {**line, "grad_norm": result.grad_norm, "steps_skipped": self.counters["steps_skipped_nonfinite"],
                  "adapter_samples": dict(sorted(self.book.adapters.items())), **result.stats}
        self.recent.add(result.version, self.book.sample_ids)
        self.book = StepBook()
        try:
            ann = await self._commit(fields)
        except Fenced as exc:
            self.counters["fenced"] += 1
            self.log.error("stopping: fenced off by a newer trainer", error=str(exc))
            self.stop(1)
            return
        if ann is None:
            return  # stopping before the commit: its micro-batches come back to the next trainer
        await self._set_trained(result.version)
        if not await self._record_step(fields):
            return  # committed; the restarted trainer records it and acks the redelivered micro-batches
        await asyncio.gather(*(self._safe(m.ack) for m in self.held))
        self.held = []
        await self._safe(lambda: self.nc.flush(timeout=5))
        self.counters["steps"] += 1
        # the step record, with the loss's statistics (clip fractions, KL estimates, IS weights, grad norm)
        metrics = {**line, "grad_norm": result.grad_norm, "steps_skipped": self.counters["steps_skipped_nonfinite"],
                   **result.stats}
        await asyncio.to_thread(append_line, self.metrics_path, json.dumps(metrics, separators=(",", ":")))
        self.log.info("step", version=result.version, samples=result.samples, loss=round(result.loss, 5),
                      reward_mean=round(record.reward_mean, 4), commit_s=round(self.commits.last_seconds, 3))
        await self._announce(ann)
        await self.commits.prune()
        await self._track(metrics, result.version)
        every = self.train.checkpoint_every
        if result.version >= self.train.max_versions:
            await self._finish()  # writes the final checkpoint
        elif every and result.version % every == 0:
            await self._checkpoint()

    async def _drop_untrained(self, result: StepResult) -> bool:
        """MARFT: record the samples of the step's batch that it did not train (another agent's turn, the critic's
        warm-up, the trust-region cut) as dropped with the reason, before the step is committed and they are acked;
        False if the service stopped first."""
        for reason, ids in sorted(result.untrained.items()):
            if not ids:
                continue
            self.counters[f"dropped_{reason}"] += len(ids)
            if not await self._drop_ids(ids, reason, result.why.get(reason, reason)):
                return False
        if result.untrained.get("kl_cut"):
            self.counters["steps_cut_kl"] += 1
            self.log.warning("step cut: the approximate KL is above marft.kl_target; the weights stay",
                             version=result.version, approx_kl=round(result.stats.get("approx_kl", 0.0), 6),
                             samples=len(result.untrained["kl_cut"]))
        return True

    async def _skip_step(self, result: StepResult) -> None:
        """The step's gradient norm was not finite and the learner kept its weights: its samples are recorded as
        dropped, then acknowledged."""
        self.counters["steps_skipped_nonfinite"] += 1
        ids = list(self.book.sample_ids)
        self.log.warning("step skipped: the gradient norm is not finite; the weights stay", version=result.version,
                         grad_norm=str(result.grad_norm), samples=len(ids), loss=str(result.loss))
        self.book = StepBook()
        why = f"non-finite gradient norm ({result.grad_norm}) at version {result.version}: step skipped"
        if not await self._drop_ids(ids, "nonfinite_grad", why):
            return  # stopping before the drop was recorded: the micro-batches come back
        await asyncio.gather(*(self._safe(m.ack) for m in self.held))
        self.held = []
        await self.event(events.STEP_SKIPPED, model=self.model, version=result.version, samples=len(ids),
                         grad_norm=str(result.grad_norm))

    async def _set_trained(self, version: int) -> None:
        """KV ``trained.<model>`` (what mq and the coordinator read; the commit point itself already moved)."""
        await self.retried(lambda: kv_put_int_max(self.kv, self.names.trained_key(self.model or ""), version),
                           "setting trained.<model>")

    async def _record_step(self, fields: dict[str, Any]) -> bool:
        assert self.model is not None
        return await self.record(events.STEP, f"step.{self.model}.{fields['version']}", **fields)

    async def _checkpoint(self) -> None:
        path = await self._torch(self.learner.save_checkpoint, self.ckpt_dir)
        self.log.info("checkpoint", path=str(path))

    async def _track(self, metrics: dict[str, Any], version: int) -> None:
        """The metrics.jsonl record to the tracking backends (logging.backends), in a thread: they write files."""
        if self.trackers is None:  # opened at the first step, off the start-up path
            self.trackers = await asyncio.to_thread(Trackers, self.cfg, self.model or "")
        before = self.trackers.errors
        await asyncio.to_thread(self.trackers.log, metrics, version)
        if self.trackers.errors > before:
            self.counters["tracking_errors"] += self.trackers.errors - before
            self.log.warning("tracking failed", error=self.trackers.last_error)

    async def _finish(self) -> None:
        """The last version: its weights are kept as a checkpoint file whatever train.checkpoint_every says (before
        the done event, so a run that has finished has its weights on disk)."""
        if not await asyncio.to_thread((self.ckpt_dir / f"v{self.learner.version}.pt").is_file):
            await self._checkpoint()
        self.done = True
        self.log.info("max_versions reached; later micro-batches are dropped as finished", version=self.learner.version)
        await self.event(events.DONE, model=self.model, version=self.learner.version)

    # --- weights --------------------------------------------------------------------------
    def _flatten(self, out: Buffer | None) -> tuple[WeightsHeader, Buffer]:
        return flatten(self.model or "", self.learner.version, self.learner.named_tensors(),
                       bucket_bytes=self.source.bucket_bytes, out=out)

    def _pack(self, record: dict[str, Any] | None) -> bytes:
        return pack_state(self.learner.version, self.learner.optimizer_state(), record, self.recent)

    def _load_commit(self, ann: WeightsAnnounce, weights: memoryview, state: memoryview) -> Committed:
        """Worker thread: the learner as committed: the weights object's tensors (every bucket checked) and the
        state's optimizer and version."""
        committed = unpack_state(state, self.remembered)
        header, body = unpack(weights)
        if committed.version != ann.version or header.version != ann.version or header.checksum != ann.checksum:
            raise CommitPointError(f"the objects of {self.model} v{ann.version} hold state v{committed.version} and "
                                   f"weights v{header.version} ({header.checksum}, committed {ann.checksum})")
        tensors = {name: t.clone() for name, t in self.learner.named_tensors().items()}
        if {s.name for s in header.slots} != set(tensors):
            raise CommitPointError(f"the committed weights of {self.model} v{ann.version} do not hold this model's "
                                   f"tensors (was models.{self.model} changed since?)")
        load_into(tensors, header, body, verify=True)
        self.learner.load_state_dict({"version": committed.version, "model": tensors,
                                      "optimizer": committed.optimizer})
        return committed

    async def _commit(self, record: dict[str, Any] | None) -> WeightsAnnounce | None:
        """Commit the learner's version (retried while the broker is away); None if stopping first. With
        transport ucx the flat buffer is then held in memory for pulls."""
        header, buf = await self._torch(self._flatten, self.source.spare())
        state = await self._torch(self._pack, record)
        wait = COMMIT_BACKOFF_S[0]
        self.committing: int | None = header.version
        try:
            while True:
                try:
                    ann = await self.commits.commit(header, buf, state, self.source.transport)
                    break
                except (nats.errors.Error, TimeoutError) as exc:
                    self.counters["commit_retries"] += 1
                    self.log.warning("commit failed; retrying", version=header.version,
                                     error=f"{type(exc).__name__}: {exc}")
                    if self.stopping:
                        return None
                    await asyncio.sleep(wait)
                    wait = min(COMMIT_BACKOFF_S[1], wait * 2)
        finally:
            self.committing = None
        if self.source is not self.commits.weights:
            await self.source.publish(header, buf)
        self.counters["commits"] += 1
        return ann

    async def _announce(self, ann: WeightsAnnounce) -> None:
        """Tell paramsync (a wake-up: it also reads the commit point in KV, so a lost announce delays nothing)."""
        if await self.publish_quietly(self.names.sync_announce(self.model or ""), encode(ann)):
            self.counters["weights_published"] += 1

    # --- helpers --------------------------------------------------------------------------
    async def _release(self, more: bool) -> None:
        """In a training pool: the micro-batch is trained; the slot goes back unless ``more`` are ready here (and no
        other model waits for it)."""
        if isinstance(self.learner, PooledLearner):
            await self._torch(self.learner.release, more)

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
