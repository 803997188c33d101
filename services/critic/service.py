"""The critic service: MARFT's central critic (one per run, ``train.loss: marft``).

It answers the coordinator's value requests (``critic.values``: the values of a finished episode's observations)
and trains its head on the critic samples the coordinator publishes once per episode (``critic.samples``, a
work-queue stream of its own): one Adam step per ``marft.critic.batch`` observations, each step committed before
any of its messages is acknowledged.

Crash-only like the trainer: a step's head and Adam state go to the object store (``critic/v<N>-<epoch>``) and the
commit point, KV ``critic``, moves to it by compare-and-swap; the step record (which critic samples it trained)
is written to the events stream before the acks. A restarted critic loads the committed version; the messages it
had not acknowledged come back, and those whose samples the committed step already trained (its ids are in the
commit) are acknowledged without training them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import nats.errors
import torch
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from services.critic.learner import CriticLearner, CriticStep
from shared.kernel import events
from shared.kernel.bus import delete_object, fetch, pull_consumer, read_object, write_object
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.config import ConfigError
from shared.kernel.logs import append_line
from shared.kernel.peers import accept
from shared.kernel.schemas import CriticBatch, CriticRequest, CriticSample, CriticValues
from shared.kernel.service import Service
from shared.models.critic import CentralCritic
from shared.models.loading import load_base, load_tokenizer, resolve_device
from shared.models.modeling import model_seed

T = TypeVar("T")
FETCH = 16  # critic batches per fetch
FETCH_TIMEOUT_S = 1.0
REMEMBERED_STEPS = 4  # committed steps whose sample ids a restart remembers (redeliveries of them are acked)
KEEP_OBJECTS = 2


class Fenced(RuntimeError):
    """Another critic committed since this one last did: this one is stale and must stop."""


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def build_learner(cfg: Any) -> tuple[CriticLearner, int]:
    """The critic on the configured model's frozen base (its head seeded from the run), and the pad id."""
    mc = cfg.marft.critic
    model = cfg.critic_model()
    base = load_base(cfg, model).to(resolve_device(cfg, model))
    with torch.random.fork_rng():
        torch.manual_seed(model_seed(cfg, "critic"))
        critic = CentralCritic(base, head_sizes=mc.head_sizes).to(resolve_device(cfg, model))
    critic.eval()
    learner = CriticLearner(critic, lr=mc.lr, grad_clip=mc.grad_clip, value_clip=mc.value_clip,
                            huber_delta=mc.huber_delta)
    return learner, load_tokenizer(cfg, model).pad_id


class CriticService(Service):
    """Values on request, one committed Adam step of the head per batch of critic samples."""

    name = "critic"

    async def setup(self) -> None:
        if not self.cfg.marft_on:
            raise ConfigError(f"the critic serves MARFT runs only (train.loss: marft); this run's train.loss is "
                              f"{self.cfg.train.loss!r}")
        mc = self.cfg.marft.critic
        self.batch = mc.batch or self.cfg.train.global_batch
        self.metrics_path = self.cfg.run_dir / "metrics.jsonl"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic", initializer=_init_worker,
                                        initargs=(mc.threads,))
        self.learner, self.pad_id = await self._torch(build_learner, self.cfg)
        self.vocab = int(cast(Any, self.learner.critic.base).get_input_embeddings().num_embeddings)
        # features of recent observations (see _features_of): a few batches of the run's samples in flight
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cache_rows = 4 * max(self.batch, self.cfg.mq_capacity)
        self.epoch = uuid.uuid4().hex[:8]
        self.version = 0
        self.revision = 0  # of the commit point as this critic last read or wrote it
        self.trained: deque[list[str]] = deque(maxlen=REMEMBERED_STEPS)  # ids of the remembered committed steps
        self.objects: deque[str] = deque()
        self.pending: list[CriticSample] = []  # samples of the accumulating step
        self.held: list[Msg] = []  # their messages, acked once the step is committed
        self.last: CriticStep | None = None
        await self._restore()
        await self.nc.subscribe(self.names.critic_values(), queue="critic", cb=self._on_values)
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(self.names.critic_stream(), self.names.critic_consumer())
        self.sub = await pull_consumer(self.js, stream=self.names.critic_stream(), subject=self.names.critic_samples(),
                                       durable=self.names.critic_consumer(), ack_wait_s=self.cfg.train.ack_wait_s,
                                       max_ack_pending=1024)
        self._consume_task = self.spawn(self._consume_loop(), "consume")

    async def teardown(self) -> None:
        await self.finish_task(getattr(self, "_consume_task", None), 20)
        for msg in getattr(self, "held", []):
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
        self.held = []
        await self.release(getattr(self, "sub", None))
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=False, cancel_futures=True)

    def extra_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": getattr(self, "version", 0), "pending": len(getattr(self, "pending", []))}
        if getattr(self, "last", None) is not None:
            assert self.last is not None
            out.update(value_loss=self.last.value_loss, explained_variance=self.last.explained_variance)
        return out

    async def _torch(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- values ---------------------------------------------------------------------------
    async def _on_values(self, msg: Msg) -> None:
        await accept(self.nc, msg, self.status_subject)  # the coordinator then sees at once if this critic dies
        try:
            req = decode(CriticRequest, msg.data)
        except DecodeError as exc:
            self.counters["values_rejected"] += 1
            await self.to_dlq(msg.subject, msg.data, exc.reason)
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(encode(CriticValues(error=f"not a CriticRequest: {exc.reason}")))
            return
        try:
            values = await self._torch(self._values, req)
            reply = CriticValues(values=values, version=self.version)
            self.counters["values_answered"] += 1
            self.counters["values_rows"] += len(req.rows)
        except (ValueError, RuntimeError, IndexError) as exc:
            self.counters["values_errors"] += 1
            reply = CriticValues(error=f"{type(exc).__name__}: {exc}", version=self.version)
            await self.to_dlq(msg.subject, msg.data, reply.error or "")
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(encode(reply))

    def _rows(self, rows: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
        out = []
        for i, r in enumerate(rows):
            why = self._row_problem(r)
            if why is not None:
                raise ValueError(f"row {i}: {why}")
            out.append((r.ids.numpy().astype("int64").tolist(), list(r.positions)))
        return out

    def _row_problem(self, row: Any) -> str | None:
        """Why the critic cannot value ``row`` (a CriticRow), or None."""
        ids = row.ids
        if len(ids.shape) != 1 or ids.shape[0] == 0 or ids.dtype not in ("int32", "int64"):
            return f"ids must be 1-d int32 with at least one token, got {ids.dtype} {ids.shape}"
        values = ids.numpy()
        if int(values.min()) < 0 or int(values.max()) >= self.vocab:
            return f"token ids outside [0, {self.vocab})"
        if not row.positions or any(not 0 <= p < ids.shape[0] for p in row.positions):
            return f"positions must be at least one, each inside the row's {ids.shape[0]} tokens"
        return None

    def _values(self, req: CriticRequest) -> list[list[float]]:
        rows = self._rows(req.rows)
        features = self._features_of(rows)
        flat = self.learner.values_of(torch.cat(features) if features else torch.zeros(0)).tolist()
        out, at = [], 0
        for _, positions in rows:
            out.append([float(v) for v in flat[at : at + len(positions)]])
            at += len(positions)
        return out

    def _features_of(self, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Each row's features at its positions. The base is frozen, so a row's features never change: those the
        value request computed are kept (by the row's ids and positions) and the training step of the same
        observation reads them instead of running the base again."""
        keys = [hashlib.blake2b(repr(row).encode(), digest_size=16).digest() for row in rows]
        missing = [i for i, k in enumerate(keys) if k not in self._cache]
        if missing:
            flat = self.learner.row_features([rows[i] for i in missing], self.pad_id)
            at = 0
            for i in missing:
                n = len(rows[i][1])
                self._cache[keys[i]] = flat[at : at + n].clone()
                at += n
            self.counters["feature_rows_computed"] += len(missing)
        self.counters["feature_rows_reused"] += len(rows) - len(missing)
        out = [self._cache[k] for k in keys]
        for k in keys:
            self._cache.move_to_end(k)
        while len(self._cache) > self.cache_rows:
            self._cache.popitem(last=False)
        return out

    # --- training -------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        while not self.stopping:
            try:
                msgs = await fetch(self.sub, FETCH, FETCH_TIMEOUT_S)
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters["fetch_errors"] += 1
                self.log.warning("fetch failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                if self.stopping:
                    return  # unacked: redelivered to the next critic
                await self._handle(msg)
            if len(self.pending) >= self.batch:
                await self._step()

    def _done_ids(self) -> set[str]:
        return {i for ids in self.trained for i in ids}

    async def _handle(self, msg: Msg) -> None:
        try:
            batch = decode(CriticBatch, msg.data)
        except DecodeError as exc:
            self.counters["batches_rejected"] += 1
            await self.to_dlq(msg.subject, msg.data, exc.reason)
            with contextlib.suppress(nats.errors.Error):
                await msg.ack()
            return
        done, accumulating = self._done_ids(), {s.sample_id for s in self.pending}
        fresh = []
        for s in batch.samples:
            why = self._problem(s)
            if why is not None:
                self.counters["samples_invalid"] += 1
                await self.to_dlq(msg.subject, encode(s), f"critic sample {s.sample_id}: {why}")
            elif s.sample_id in done or s.sample_id in accumulating:
                self.counters["duplicates"] += 1
            else:
                fresh.append(s)
        if not fresh:
            with contextlib.suppress(nats.errors.Error):
                await msg.ack()
            return
        self.pending += fresh
        self.held.append(msg)
        self.counters["samples"] += len(fresh)

    def _problem(self, s: CriticSample) -> str | None:
        n = len(s.row.positions)
        if len(s.old_values) != n or len(s.returns) != n:
            return f"{n} positions, {len(s.old_values)} old values and {len(s.returns)} returns: one each per position"
        if not all(math.isfinite(v) for v in (*s.old_values, *s.returns)):
            return "old values and returns must be finite numbers"
        return self._row_problem(s.row)

    def _train(self, samples: list[CriticSample]) -> CriticStep:
        rows = self._rows([s.row for s in samples])
        features = torch.cat(self._features_of(rows))
        old = torch.as_tensor([v for s in samples for v in s.old_values], dtype=torch.float32)
        ret = torch.as_tensor([v for s in samples for v in s.returns], dtype=torch.float32)
        step = self.learner.step_features(features, old.to(features.device), ret.to(features.device))
        return step

    def _state_bytes(self, ids: list[str], record: dict[str, Any]) -> bytes:
        """The committed state: the head, Adam, the version, the ids of the remembered steps, and this step's
        record (a critic killed between its commit and its record writes it on restart)."""
        buf = io.BytesIO()
        torch.save({**self.learner.state_dict(), "version": self.version + 1,
                    "trained": [*self.trained, ids], "record": json.dumps(record)}, buf)
        return buf.getvalue()

    async def _step(self) -> None:
        samples, held = self.pending, self.held
        ids = [s.sample_id for s in samples]
        t0 = time.perf_counter()
        try:
            result = await self._torch(self._train, samples)
        except (ValueError, RuntimeError, IndexError) as exc:  # a sample the checks let through and torch refused
            self.counters["step_errors"] += 1
            why = f"critic step failed: {type(exc).__name__}: {exc}"
            self.log.error(why)
            for msg in held:
                await self.to_dlq(msg.subject, msg.data, why)
                with contextlib.suppress(nats.errors.Error):
                    await msg.ack()
            self.pending, self.held = [], []
            return
        version = self.version + 1
        fields = {"version": version, "samples": len(ids), "value_loss": result.value_loss,
                  "explained_variance": result.explained_variance, "critic_grad_norm": result.grad_norm,
                  "step_seconds": round(time.perf_counter() - t0, 6), "sample_ids": ids}
        state = await self._torch(self._state_bytes, ids, fields)
        try:
            committed = await self._commit(version, state)
        except Fenced as exc:
            self.counters["fenced"] += 1
            self.log.error("stopping: fenced off by a newer critic", error=str(exc))
            self.stop(1)
            return
        if not committed:
            return  # stopping before the commit: the messages come back to the next critic
        self.version, self.last = version, result
        self.trained.append(ids)
        if not await self.record(events.CRITIC_STEP, f"critic.{version}", **fields):
            return  # committed; the restarted critic acks the redelivered messages as trained
        await asyncio.gather(*(self._ack(m) for m in held))
        self.pending, self.held = [], []
        self.counters["steps"] += 1
        line = {k: v for k, v in fields.items() if k != "sample_ids"}
        line.update(kind="critic_step", time=time.time())
        await asyncio.to_thread(append_line, self.metrics_path, json.dumps(line, separators=(",", ":")))
        self.log.info("critic step", version=version, samples=len(ids), value_loss=round(result.value_loss, 5),
                      explained_variance=round(result.explained_variance, 4))
        await self._prune()

    async def _ack(self, msg: Msg) -> None:
        with contextlib.suppress(nats.errors.Error):
            await msg.ack()

    # --- commits --------------------------------------------------------------------------
    async def _commit(self, version: int, state: bytes) -> bool:
        """Write the state object, then compare-and-swap the commit point to it; False if stopping first."""
        name = self.names.critic_object(version, self.epoch)
        ok = await self.retried(lambda: write_object(self.js, self.names.obj_bucket, name, [state],
                                                                chunk_bytes=self.cfg.paramsync.chunk_kb * 1024, replace=True),
                                "writing the critic's state")
        if ok is None:
            return False
        data = json.dumps({"version": version, "object": name}).encode()

        async def swap() -> bool:
            try:
                if self.revision:
                    self.revision = await self.kv.update(self.names.critic_key(), data, last=self.revision)
                else:
                    self.revision = await self.kv.create(self.names.critic_key(), data)
            except KeyWrongLastSequenceError:
                entry = await self.kv.get(self.names.critic_key())
                if entry.value != data:
                    raise Fenced(f"another critic committed since revision {self.revision}") from None
                self.revision = int(entry.revision or 0)
            return True

        if await self.retried(swap, "moving the critic's commit point") is None:  # None: stopped before it moved
            return False
        self.objects.append(name)
        return True

    async def _prune(self) -> None:
        while len(self.objects) > KEEP_OBJECTS:
            old = self.objects.popleft()
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await delete_object(self.js, self.names.obj_bucket, old)

    async def _restore(self) -> None:
        try:
            entry = await self.kv.get(self.names.critic_key())
        except KeyNotFoundError:
            self.log.info("no committed critic: starting from the initial head")
            return
        self.revision = int(entry.revision or 0)
        point = json.loads(entry.value or b"{}")
        blob = await read_object(self.js, self.names.obj_bucket, point["object"], timeout_s=120)
        state = torch.load(io.BytesIO(bytes(blob)), map_location="cpu", weights_only=True)
        await self._torch(self.learner.load_state_dict, state)
        self.version = int(state["version"])
        self.trained.extend(state.get("trained", []))
        self.objects.append(point["object"])
        self.counters["restored"] += 1
        self.log.info("restored the committed critic", version=self.version)
        # The committed step's record, again: the critic may have died between its commit and its record (the
        # record id makes a second copy a duplicate the events stream drops).
        if "record" in state:
            fields = json.loads(state["record"])
            await self.record(events.CRITIC_STEP, f"critic.{self.version}", **fields)

