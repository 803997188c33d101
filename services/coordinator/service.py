"""The coordinator: K task loops play the configured workflow (G rollouts of a task at once) through the
rollouters and the actions service and publish every agent turn as a Sample to its model's trajectory stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from services.coordinator.admission import Admission, BatchGate, Pacer, expected_samples
from services.coordinator.clients import MAX_ATTEMPTS, RequestClient, backoff
from services.coordinator.evaluation import evaluate
from services.coordinator.failures import FailureLog, error_key, root_cause
from services.coordinator.generated import GeneratedTokens
from services.coordinator.health import RewardHealth
from services.coordinator.keepbest import BestKeeper
from services.coordinator.marft import HeldBatch, apply_gae, critic_rows, rollouts
from services.coordinator.routing import RolloutRouter
from services.coordinator.samples import SampleWriter, dumps, episode_records, prompt_text
from services.coordinator.tasks import Task, TaskSource, heldout_tasks
from services.coordinator.workflows import (
    Abandon,
    Episode,
    Stopping,
    Tokenizers,
    WorkflowTimeout,
    run_episode,
    workflow_of,
)
from shared.kernel import events
from shared.kernel.bus import kv_get_int
from shared.kernel.codec import DecodeError, decode, decode_json_as, encode
from shared.kernel.config import ChorusConfig, ConfigError
from shared.kernel.logs import append_line
from shared.kernel.peers import ReplyMux
from shared.kernel.schemas import (
    CriticBatch,
    CriticRequest,
    CriticValues,
    DepthReport,
    SyncDone,
)
from shared.kernel.service import EX_RUN_FAILED, Service
from shared.results.plotting import last_generated
from shared.results.tracking import EVAL_TRACKER, Trackers

PUBLISH_ACK_TIMEOUT_S = 10.0  # a sample's PubAck; then it is sent again
POLL_S = 0.05  # MARFT's held batch: completeness re-check period
# A task loop waiting for admission is woken when what admission reads changes (a depth report, a served or trained
# version, a task's end), one loop at a time; it re-checks by itself at least this often (the time-based rules).
ADMISSION_TICK_S = 1.0
VERSION_POLL_S = 0.2
# The served and trained versions come with every SyncDone and depth report; the poll of their KV keys (two reads a
# model) is the backstop, so with many models it runs less often: 0.2 s up to 4 models, 1.6 s at 32.
VERSION_POLL_PER_MODEL_S = 0.05
DRAIN_S = 20.0
EMA = 0.05
CRITIC_TIMEOUT_S = 120.0  # a value request the critic accepted; it may be in the middle of a step
SAMPLES_FLUSH_S = 1.0  # sampled rollouts are buffered and appended to samples.jsonl this often
SAMPLES_MESSAGE_BYTES = 256 * 1024  # sampled records published per message on chorus.<run>.samples, at most
SAMPLES_BUFFER = 10_000  # records waiting for a write; past it new ones are counted (samples_not_written), not kept


def per_model(ep: Episode) -> dict[str, int]:
    """Samples of an episode per model."""
    out: dict[str, int] = {}
    for s in ep.samples:
        out[s.model] = out.get(s.model, 0) + 1
    return out


def _failed(exc: BaseException) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


class CoordinatorService(Service):
    """Per run: ``workflow.concurrency`` concurrent task loops, honouring mq backpressure."""

    name = "coordinator"
    _trackers: Trackers | None = None  # opened at the first evaluation

    def __init__(self, cfg: ChorusConfig, *, nats_url: str, instance: str = "0", model: str | None = None) -> None:
        super().__init__(cfg, nats_url=nats_url, instance=instance, model=model)
        # A custom workflow is imported here, so a bad file or name stops the service before it connects.
        self.workflow = workflow_of(cfg)
        self._admission_waiters: deque[asyncio.Future[None]] = deque()  # task loops waiting to start a task
        self._refused = ""  # what refused the last admission check: saturated, pacer, gate ("" : it admitted)

    async def setup(self) -> None:
        cfg = self.cfg
        wf = cfg.workflow
        # Generation and action requests are accepted by one instance, which is probed while they run: a dead
        # or frozen instance costs a probe interval or a few, then the request goes to another one.
        self.mux = await ReplyMux(self.nc, self.peers, cfg.peers).start()
        # FlexMARL's rollout manager: each generation request to the least-loaded instance of its model
        served = sorted({*(cfg.agents[a].model for a in wf.agents), *([cfg.agents[cfg.reward.judge].model]
                                                                     if cfg.reward.judge else [])})
        self.router = RolloutRouter(self, self.mux, served, self.log)
        if cfg.balance.dispatch == "least_loaded":
            await self.router.start()
        # The models that get samples: their backlogs and budgets pace the run (a judge's model only answers).
        self.models = sorted({cfg.agents[a].model for a in wf.agents})
        self.tokenizers = Tokenizers(cfg)
        for m in sorted({*self.models, *([cfg.agents[cfg.reward.judge].model] if cfg.reward.judge else [])}):
            await self.tokenizers.get(m)
        # generation, action and critic requests, with their timeouts and retries (services/coordinator/clients.py)
        self.client = RequestClient(self, self.mux, self.router, self.tokenizers, self.log)
        self.admission = Admission(self.models, cfg.train.max_versions,
                                   stale_after_s=max(5.0, 10 * cfg.mq.report_interval_s))
        # sync / microbatch: one global batch of tasks per version; async: AReaL's staleness capacity per model.
        agent_models = {a: cfg.agents[a].model for a in wf.agents}
        expected = expected_samples(agent_models, wf.group_size, self.models)
        self.gate: BatchGate | None = None
        self.pacer: Pacer | None = None
        self._ticket: dict[str, float] | None = None  # what the on-policy gate reserved for the task just admitted
        if cfg.train.mode == "async":
            self.pacer = Pacer(self.models, cfg.train.global_batch, cfg.train.max_staleness, expected,
                               stale_after_s=self.admission.stale_after_s)
        else:
            self.gate = BatchGate(self.models, cfg.train.global_batch, expected)
        self.served: dict[str, int] = {}
        # generated tokens against trained versions (metrics.jsonl "generated" lines), continued after a restart
        self.generated = GeneratedTokens(*await asyncio.to_thread(last_generated, cfg.run_dir / "metrics.jsonl"))
        await self._poll_versions()
        self.best = BestKeeper(self.js, self.names, cfg.run_dir, self.models)
        # Same seed, same questions; the time-based prefix keeps ids unique across coordinator restarts
        # (the trainer deduplicates by sample id).
        prefix = f"c{self.instance}x{int(time.time() * 1000):x}".replace("_", "").replace("-", "")
        try:  # a dataset that does not open or parse stays so: stop the run, do not restart into it
            self.tasks = TaskSource(cfg.run.seed, cfg.task, prefix)
            self.heldout = heldout_tasks(cfg.task, cfg.eval.tasks, cfg.run.seed) if cfg.eval.every else []
        except ValueError as exc:
            raise ConfigError(f"task: {exc}") from None
        self.reward_ema: dict[str, float] = {}
        self.final_correct_ema: float | None = None
        self.in_flight = 0
        self._publishing: set[asyncio.Task[None]] = set()
        self._announced_done = False  # every model reached max_versions: episodes that end now are not published
        wf = cfg.workflow
        self.failures = FailureLog(wf.max_failures, wf.backoff_s, wf.backoff_max_s)
        self.health = RewardHealth(self.cfg)
        for m in self.models:
            await self.nc.subscribe(self.names.depth(m), cb=self._on_depth)
            # New weights served: read the version at once (the poll is the fallback), so an on-policy
            # batch opens without waiting out a poll period.
            await self.nc.subscribe(self.names.sync_done(m), cb=self._on_sync_done)
        self.spawn(self._version_loop(), "versions")
        self.held = HeldBatch()  # MARFT on-policy: the open batch's valued episodes, published whole
        if cfg.marft_on and self.gate is not None:
            self.spawn(self._held_batch_loop(), "held-batch")
        # logging.samples_every: one rollout of every Nth task to samples.jsonl (`chorus samples`), written by a
        # flush loop in a worker thread; teardown writes what is left.
        self._samples: list[str] = []
        self._sample_tasks = 0
        self.sample_writer = SampleWriter(cfg.run_dir) if cfg.logging.samples_every else None
        if self.sample_writer is not None:
            self.spawn(self._samples_loop(), "samples")
        self._loops: list[asyncio.Task[None]] = []
        resumed = any(v > 0 for v in self.served.values())  # a restarted coordinator, or a resumed run
        if self.heldout and not resumed:
            # The "before" evaluation runs on version-0 weights: no task is admitted until it is done.
            self.spawn(self._eval_loop(), "eval")
        else:
            self._start_loops()
            if self.heldout:
                self.spawn(self._eval_loop(first=False), "eval")

    def _start_loops(self) -> None:
        self._loops = [self.spawn(self._task_loop(), f"loop{k}") for k in range(self.cfg.workflow.concurrency)]

    async def teardown(self) -> None:
        if self._trackers is not None:
            await asyncio.to_thread(self._trackers.close)
        if getattr(self, "failures", None) is not None and self.failures.total:
            self.log.warning("workflow failures of this coordinator", total=self.failures.total,
                             errors=self.failures.summary())
        # Loops see `stopping` and finish the episode they are in; what is not done in time is abandoned.
        loops = [t for t in self._loops if not t.done()]
        if loops:
            _, pending = await asyncio.wait(loops, timeout=DRAIN_S)
            for t in pending:
                t.cancel()
                self.counters["tasks_left_stopping"] += 1
            await asyncio.gather(*pending, return_exceptions=True)
        if self._publishing:
            await asyncio.wait(self._publishing, timeout=10)
        held = getattr(self, "held", None)
        if held is not None and held.items:  # a MARFT batch not complete: the next coordinator plays a new one
            self.counters["tasks_left_stopping"] += len(held.items)
            self.log.info("an unfinished MARFT batch is left: its episodes were not published", tasks=len(held.items),
                          batch=held.batch)
        if getattr(self, "sample_writer", None) is not None:
            await self._flush_samples()
        if hasattr(self, "mux"):
            await self.mux.close()

    def extra_metrics(self) -> dict[str, Any]:
        if not hasattr(self, "admission"):
            return {}
        now = time.monotonic()
        return {
            "in_flight": self.in_flight,
            "tokens_generated": self.generated.tokens,
            "reward_ema": dict(self.reward_ema),
            "final_correct_ema": self.final_correct_ema,
            "served_versions": dict(self.served),
            "trained_versions": dict(self.admission.trained),
            "backpressured": self.admission.blocked_by(now),
            "admitting": not self.admission.budget_spent and not self.stopping,
            "batches_opened": self.gate.batches if self.gate else None,
            "pacing": self.pacer.snapshot(self.served, now) if self.pacer else None,
            "workflow_failures": self.failures.summary(),
            "balance": {"dispatch": self.cfg.balance.dispatch, **self.router.snapshot()},
        }

    # --- versions and backpressure ------------------------------------------------------
    async def _poll_versions(self) -> None:
        for m in self.models:
            self.served[m] = await kv_get_int(self.kv, self.names.version_key(m))
            self.admission.on_served(m, self.served[m])
            self.admission.on_trained(m, await kv_get_int(self.kv, self.names.trained_key(m)))
        self._wake_admission()

    async def _version_loop(self) -> None:
        while not self.stopping:
            try:
                await self._poll_versions()
            except (nats.errors.Error, TimeoutError) as exc:  # broker hiccup: keep the last known values
                self.counters["version_poll_errors"] += 1
                self.log.warning("version poll failed", error=f"{type(exc).__name__}: {exc}")
            await self._write_generated()
            if self.admission.budget_spent and not self._announced_done:
                self._announced_done = True
                self.log.info("every model reached max_versions: no new tasks", trained=self.admission.trained)
                self.spawn(self._close_publishing(), "close")
                await self.event(events.ADMISSION_STOPPED, trained=dict(self.admission.trained))
            await asyncio.sleep(max(VERSION_POLL_S, VERSION_POLL_PER_MODEL_S * len(self.models)))

    async def _write_generated(self) -> None:
        """The tokens generated so far, once per change of the trained versions (services/coordinator/generated.py)."""
        line = self.generated.on_trained(self.admission.trained)
        if line is None:
            return
        try:
            await asyncio.to_thread(append_line, self.cfg.run_dir / "metrics.jsonl", json.dumps(line, separators=(",", ":")))
        except OSError as exc:
            self.counters["generated_write_errors"] += 1
            self.log.warning("could not write the generated tokens to metrics.jsonl", error=f"{type(exc).__name__}: {exc}")

    async def _on_sync_done(self, msg: Msg) -> None:
        model = msg.subject.rsplit(".", 2)[-2]
        try:
            done = self.decode_own(SyncDone, msg.data, model)
        except DecodeError as exc:
            await self.to_dlq(msg.subject, msg.data, exc.reason)
            return
        if model not in self.models:
            return
        self.best.synced(model, done.version, done.object_name)
        try:
            self.served[model] = max(self.served.get(model, 0),
                                     await kv_get_int(self.kv, self.names.version_key(model)))
            self.admission.on_served(model, self.served[model])
            self._wake_admission()
        except (nats.errors.Error, TimeoutError, ValueError) as exc:
            self.counters["version_poll_errors"] += 1
            self.log.warning("reading the served version failed", model=model, error=f"{type(exc).__name__}: {exc}")

    async def _on_depth(self, msg: Msg) -> None:
        try:
            report = decode_json_as(DepthReport, msg.data)
        except DecodeError as exc:
            await self.to_dlq(msg.subject, msg.data, f"malformed DepthReport JSON: {exc}")
            return
        now = time.monotonic()
        self.admission.on_depth(report.model, report.depth, report.capacity, now, report.trained_version)
        self.admission.on_trained(report.model, report.trained_version)
        if self.pacer is None:
            self._wake_admission()
            return
        # In async mode, after the pacer refused a task, only a report of a model it held back, or of one it took
        # for stuck, can let the next one start (the others fitted, and a report cannot make them hold it back
        # less): with 32 models, the other 31 reports of each round wake no check.
        wakes = (self._refused != "pacer" or report.model in self.pacer.held_by
                 or self.pacer.stuck(report.model, now))
        self.pacer.on_report(report.model, report.depth, report.trained_version, now)
        if wakes:
            self._wake_admission()

    def stop(self, code: int = 0) -> None:
        super().stop(code)
        for fut in self._admission_waiters:  # every waiting loop sees `stopping` now
            if not fut.done():
                fut.set_result(None)

    def _wake_admission(self) -> None:
        """What admission reads changed: the first task loop waiting for it checks again now (admitted, it wakes
        the next: one check per change, not one per waiting loop)."""
        while self._admission_waiters:
            fut = self._admission_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def _wait_admitted(self) -> bool:
        """Wait until a new task may start; False when the service is stopping."""
        waited = paced = False
        while not self.stopping:
            if self.admission.budget_spent:
                await self._admission_wait()  # idle until SIGTERM (or a restored budget)
                continue
            if self._admit():
                self._wake_admission()  # room for one more? the next waiting loop looks
                return True
            if not waited:
                waited = True
                self.counters["backpressure_waits"] += 1
            if not paced and self.pacer is not None and self.pacer.held_by:
                paced = True
                self.counters["tasks_paced"] += 1  # held back by the staleness capacity of some model
            await self._admission_wait()
        return False

    async def _admission_wait(self) -> None:
        """Until :meth:`_wake_admission` picks this loop, or ``ADMISSION_TICK_S``."""
        fut = asyncio.get_running_loop().create_future()
        self._admission_waiters.append(fut)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, ADMISSION_TICK_S)
        finally:
            if not fut.done() or fut.cancelled():  # timed out: not left behind for a wake to skip (at most 64 wait)
                with contextlib.suppress(ValueError):
                    self._admission_waiters.remove(fut)

    def _admit(self) -> bool:
        """Start one task now? Counts it in the open batch when it may (no await between check and count)."""
        now = time.monotonic()
        if self.admission.saturated(now):
            self._refused = "saturated"
            return False
        done = self._budget_spent_models()
        if self.pacer is not None:
            if not self.pacer.may_start(self.served, done, now):
                self._refused = "pacer"
                return False
            self._refused = ""
            self.pacer.started()
            return True
        assert self.gate is not None
        if not self.gate.may_start(self.served, done):
            self._refused = "gate"
            return False
        self._refused = ""
        self._ticket = self.gate.started()  # taken by the task loop that asked, with no await in between
        return True

    # --- held-out evaluation --------------------------------------------------------------
    async def _evaluate(self, final: bool) -> None:
        served = dict(self.served)
        generated = self.generated.tokens  # the training tokens behind the weights about to be scored
        staged = await self.best.stage(served)  # the weights about to be scored, in case they are the best
        rec = await evaluate(self.cfg, self.heldout, self.workflow, self.client.generate, self.client.act,
                             lambda: dict(self.served), self.tokenizers,
                             on_episode=lambda ep: self._sample(ep, eval=True))
        rec["last"] = final
        rec["tokens_generated"] = generated
        rec["best"] = await self.best.settle(rec, staged, served)
        self.counters["best_copy_errors"] = self.best.errors
        self.counters["evaluations"] += 1
        self.counters["eval_tasks_retried"] += rec["retried"]
        self.counters["eval_tasks_failed"] += rec["failed"]
        self.log.info("evaluation", version=rec["version"], pass1=rec["pass1"], final=rec["final"], last=final)
        if rec["failed"]:
            self.log.warning("held-out tasks failed every attempt and count as wrong", failed=rec["failed"],
                             attempts=self.cfg.eval.retries + 1, errors=rec["errors"])
        await asyncio.to_thread(append_line, self.cfg.run_dir / "metrics.jsonl", json.dumps(rec, separators=(",", ":")))
        await self._track_eval(rec)
        await self.event(events.EVAL, **{k: v for k, v in rec.items() if k != "kind"})
        if final:  # with every trained.<model> at max_versions, the run has finished (shared/kernel/runstate.py)
            await self.retried(lambda: self.kv.put(self.names.eval_final_key(), str(rec["version"]).encode()),
                               "setting eval.final")

    async def _track_eval(self, rec: dict[str, Any]) -> None:
        """The evaluation record to the tracking backends (logging.backends) as "eval", at step = its version; the
        writers are opened at the first evaluation, in a thread like every write."""
        if self._trackers is None:
            self._trackers = await asyncio.to_thread(Trackers, self.cfg, EVAL_TRACKER)
        before = self._trackers.errors
        await asyncio.to_thread(self._trackers.log, rec, int(rec["version"]))
        if self._trackers.errors > before:
            self.counters["tracking_errors"] += self._trackers.errors - before
            self.log.warning("tracking failed", error=self._trackers.last_error)

    async def _eval_loop(self, first: bool = True) -> None:
        """Evaluate at version 0 (``first``; a restarted coordinator goes on from the served version), then each
        time every model has moved ``eval.every`` versions, then once more when the training budget is spent and
        the last weights are served."""
        cfg = self.cfg
        done_at = 0
        if first:
            await self._evaluate(final=False)
            self._start_loops()
        else:
            served = min(self.served.values(), default=0)
            done_at = served - served % cfg.eval.every
        while not self.stopping:
            served = min(self.served.values(), default=0)
            if self.admission.budget_spent and served >= cfg.train.max_versions:
                await self._evaluate(final=True)
                return
            if served - done_at >= cfg.eval.every and served < cfg.train.max_versions:
                done_at = served
                await self._evaluate(final=False)
            await asyncio.sleep(VERSION_POLL_S)

    # --- task loops ---------------------------------------------------------------------
    async def _task_loop(self) -> None:
        consecutive = 0  # workflow failures in a row in this loop: the backoff grows with them
        retry: tuple[int, Task, int] | None = None  # a failed task to play again, with its attempt number
        while await self._wait_admitted():
            ticket, self._ticket = self._ticket, None
            batch = self.gate.batches if self.gate is not None else 0  # the on-policy batch the task is in
            if retry is None:
                (env_idx, task), attempt = self.tasks.next(), 0
            else:
                (env_idx, task, attempt), retry = retry, None
                self.counters["tasks_retried"] += 1
            self.counters["tasks_started"] += 1
            self.in_flight += 1
            ep: Episode | None = None
            try:
                ep = await run_episode(self.cfg, task, env_idx, self.workflow, self.client.generate,
                                       self.client.act, lambda: dict(self.served), self.tokenizers)
            except Stopping as exc:  # the run ends (or this coordinator shuts down) with the task in flight
                self.counters["tasks_left_stopping"] += 1
                self.log.info("task left: the coordinator is stopping", task=task.task_id, error=str(exc))
                continue
            except Abandon as exc:  # the services did not answer: not the workflow's fault
                self.counters["tasks_abandoned"] += 1
                self.log.warning("task abandoned", task=task.task_id, error=str(exc))
                continue
            except Exception as exc:  # the workflow raised, timed out or returned no trajectory
                consecutive += 1
                await self._workflow_failed(exc, task.task_id)
                if attempt < self.cfg.workflow.retries:
                    retry = (env_idx, task, attempt + 1)
                else:
                    self.counters["tasks_failed"] += 1
                await self.wait_stopped(self.failures.backoff(consecutive))
                continue
            finally:
                self.in_flight -= 1
                if ep is None or not self.cfg.marft_on:  # MARFT's episodes count once their values are in
                    self._admitted_done(ep, ticket)
            consecutive = 0
            critic: CriticBatch | None = None
            if self.cfg.marft_on:
                valued = False
                try:
                    critic = await self._marft(ep)
                    valued = True
                except Stopping as exc:
                    self.counters["tasks_left_stopping"] += 1
                    self.log.info("task left: the coordinator is stopping", task=task.task_id, error=str(exc))
                    continue
                except Abandon as exc:  # the critic did not answer: the task's samples have no advantages
                    self.counters["tasks_abandoned"] += 1
                    self.log.warning("task abandoned", task=task.task_id, error=str(exc))
                    continue
                finally:
                    # An episode the critic did not value publishes nothing: the on-policy gate must not count its
                    # samples (it would close the batch on samples the trainer never gets, and wait for ever).
                    self._admitted_done(ep if valued else None, ticket)
            if self._announced_done:
                # Every model reached train.max_versions: each mq would drop these samples as finished, and the
                # ones started with --exit-when-done go once the samples published before are recorded.
                self.counters["samples_not_published_finished"] += len(ep.samples)
                self._record(ep)
                await self._sample(ep)
                continue
            if critic is not None and self.gate is not None:
                # MARFT on-policy: held until the batch's last task is in, then normalised and published together
                self.held.add(batch, ep, critic)
                continue
            # Once started, a task's samples are published whole even if a drain cancels this loop.
            pub = asyncio.create_task(self._publish(ep, critic))
            self._publishing.add(pub)
            pub.add_done_callback(self._publishing.discard)
            await asyncio.shield(pub)
            self._record(ep)
            await self._sample(ep)

    async def _held_batch_loop(self) -> None:
        """MARFT in an on-policy mode: once the open batch is complete (every task ended, every model's samples
        in), its held episodes' advantages are normalised together over every agent and model and the batch is
        published whole (services/coordinator/marft.py)."""
        while not self.stopping:
            await asyncio.sleep(POLL_S)
            assert self.gate is not None
            if not self.held.items or not self.gate.complete(self._budget_spent_models()):
                continue
            items = self.held.take(self.cfg.marft.variant)
            if self._announced_done:
                for ep, _ in items:
                    self.counters["samples_not_published_finished"] += len(ep.samples)
                    self._record(ep)
                continue
            self.counters["marft_batches_published"] += 1
            pub = asyncio.create_task(self._publish_all(items))
            self._publishing.add(pub)
            pub.add_done_callback(self._publishing.discard)
            await asyncio.shield(pub)

    async def _publish_all(self, items: list[tuple[Episode, CriticBatch]]) -> None:
        for ep, critic in items:
            await self._publish(ep, critic)
            self._record(ep)
            await self._sample(ep)

    def _budget_spent_models(self) -> set[str]:
        """Models that reached train.max_versions: they need no more samples."""
        return self.admission.done()

    def _admitted_done(self, ep: Episode | None, ticket: dict[str, float] | None) -> None:
        """A task ended, with its episode's samples to publish (None: nothing will be published): the admission
        (the on-policy gate, or the async pacer) counts them."""
        if self.gate is not None:
            self.gate.finished(None if ep is None else per_model(ep), ticket)
        if self.pacer is not None:
            self.pacer.finished(None if ep is None else per_model(ep))
        self._wake_admission()

    async def _workflow_failed(self, exc: Exception, task_id: str) -> None:
        """Count a failure of the workflow; log each distinct error once; stop the run past max_failures."""
        self.counters["workflow_timeouts" if isinstance(exc, WorkflowTimeout) else "workflow_errors"] += 1
        if self.failures.note(exc):
            cause, key, error = root_cause(exc), error_key(exc), f"{type(exc).__name__}: {exc}"
            self.log.error("workflow failed; this error is logged once and counted from now on (metrics "
                           "workflow_failures)", task=task_id, key=key, error=error,
                           exc_info=cause if cause.__traceback__ is not None else None)
            await self.event(events.WORKFLOW_ERROR, key=key, error=error[:1000])
        if self.failures.exhausted and not self.stopping:
            wf = self.cfg.workflow
            error = (f"the workflow failed {self.failures.total} times (workflow.max_failures {wf.max_failures}); "
                     f"most often: {self.failures.worst()}")
            self.log.error("stopping the run: " + error, errors=self.failures.summary())
            await self.event(events.RUN_FAILED, error=error, errors=self.failures.summary())
            self.stop(EX_RUN_FAILED)

    async def _fail_run(self, error: str) -> None:
        await self.event(events.RUN_FAILED, error=error, errors={})
        self.stop(EX_RUN_FAILED)

    def _record(self, ep: Episode) -> None:
        self.counters["tasks_done"] += 1
        self.generated.add(ep.tokens_generated)
        self.counters["groups_incomplete_dropped"] += ep.dropped_groups
        if ep.reward_errors:
            self.counters["samples_dropped_reward_error"] += len(ep.reward_errors)
            self.log.warning("samples dropped: the reward function failed", task=ep.task.task_id,
                             count=len(ep.reward_errors), reason=ep.reward_errors[0][:300])
        self.counters["turns_untrained"] += ep.untrained_turns
        warnings, stop = self.health.record(ep)
        for w in warnings:  # chorus up prints them; the dashboard's event list shows them
            self.log.warning(w["text"], model=w["model"], cause=w["cause"], setting=w["setting"])
            self.spawn(self.event(events.WARNING, **w), "warning")
        if stop is not None and not self.stopping:
            self.log.error("stopping the run: " + stop)
            self.spawn(self._fail_run(stop), "run-failed")
        for agent, rewards in ep.rewards.items():
            mean = sum(rewards) / max(1, len(rewards))
            prev = self.reward_ema.get(agent)
            self.reward_ema[agent] = mean if prev is None else (1 - EMA) * prev + EMA * mean
        rate = sum(ep.final_correct) / max(1, len(ep.final_correct))
        prev_fc = self.final_correct_ema
        self.final_correct_ema = rate if prev_fc is None else (1 - EMA) * prev_fc + EMA * rate

    # --- samples.jsonl ------------------------------------------------------------------
    async def _sample(self, ep: Episode, *, eval: bool = False) -> None:
        """Buffer the record of rollout 0 of ``ep`` when it is a sampled one: every ``logging.samples_every``-th
        task (the first included), and every held-out episode (``eval``). Never raises."""
        if self.sample_writer is None:
            return
        if not eval:
            self._sample_tasks += 1
            if (self._sample_tasks - 1) % self.cfg.logging.samples_every:
                return
        if len(self._samples) >= SAMPLES_BUFFER:
            self.counters["samples_not_written"] += 1
            return
        try:
            toks = {m: await self.tokenizers.get(m) for m in sorted({s.model for s in ep.samples})}
            records = episode_records(self.cfg, ep, (0,), eval=eval, decode=lambda m, ids: prompt_text(toks[m], ids))
            self._samples.extend(dumps(r) for r in records)
        except Exception as exc:  # a record that cannot be built costs that record, never the run
            self.counters["samples_write_errors"] += 1
            self.log.warning("sample record not built", task=ep.task.task_id, error=f"{type(exc).__name__}: {exc}")

    async def _flush_samples(self) -> None:
        lines, self._samples = self._samples, []
        if not lines or self.sample_writer is None:
            return
        # The same records for the watchers of the bus (chorus dashboard): JSON lines, batched under the payload cap.
        chunk: list[str] = []
        size = 0
        for line in [*lines, None]:
            if line is None or (chunk and size + len(line) > SAMPLES_MESSAGE_BYTES):
                await self.publish_quietly(self.names.samples(), "\n".join(chunk).encode())
                chunk, size = [], 0
            if line is not None:
                chunk.append(line)
                size += len(line) + 1
        try:
            await asyncio.to_thread(self.sample_writer.write, lines)
            self.counters["samples_written"] += len(lines)
        except OSError as exc:
            self.counters["samples_write_errors"] += 1
            self.log.warning("samples.jsonl write failed; these records are lost", count=len(lines),
                             path=str(self.sample_writer.path), error=f"{type(exc).__name__}: {exc}")

    async def _samples_loop(self) -> None:
        while True:
            await asyncio.sleep(SAMPLES_FLUSH_S)
            await self._flush_samples()

    async def _marft(self, ep: Episode) -> CriticBatch:
        """MARFT: the critic's values of every observation of the episode (one request), then GAE over each
        rollout in (round, position) order; writes rewards, advantages, values and returns into the samples."""
        layout = rollouts(self.cfg, ep)
        samples = [s for ro in layout for s in ro.samples]
        rows = critic_rows(samples, self.cfg.marft.variant)
        data = encode(CriticRequest(rows=rows))
        reply = await self.client.request(self.names.critic_values(), data, CRITIC_TIMEOUT_S, "critic")
        try:
            answer = decode(CriticValues, reply)
        except DecodeError as exc:
            self.counters["critic_bad_replies"] += 1
            raise Abandon(f"the critic's reply does not decode: {exc.reason}") from exc
        if answer.error is not None or [len(v) for v in answer.values] != [len(r.positions) for r in rows]:
            self.counters["critic_errors"] += 1
            raise Abandon(f"the critic could not value task {ep.task.task_id}: "
                          f"{answer.error or 'a value count that does not match the request'}")
        self.counters["critic_values"] += len(rows)
        return apply_gae(self.cfg, layout, answer.values, rows, f"critic-{ep.task.task_id}")

    async def _close_publishing(self) -> None:
        """Every model reached max_versions: once the samples being published are in, ``closed.coordinator`` says
        that nothing more comes (an mq started with --exit-when-done waits for it)."""
        while self._publishing:
            await asyncio.wait(set(self._publishing))
        budget = str(self.cfg.train.max_versions).encode()
        if await self.retried(lambda: self.kv.put(self.names.coordinator_closed_key(), budget),
                              "writing closed.coordinator") is not None:
            self.log.info("the run's samples are all published", samples=self.counters["samples_published"],
                          not_published_finished=self.counters["samples_not_published_finished"])

    async def _publish_critic(self, batch: CriticBatch) -> None:
        """The episode's critic samples, one message (its id deduplicates a repeat), before its policy samples."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                await self.js.publish(self.names.critic_samples(), encode(batch), timeout=PUBLISH_ACK_TIMEOUT_S,
                                      headers={"Nats-Msg-Id": batch.batch_id})
                self.counters["critic_samples_published"] += len(batch.samples)
                return
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters["critic_publish_retries"] += 1
                self.log.warning("critic samples publish failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(backoff(attempt))
        self.counters["critic_samples_lost"] += len(batch.samples)
        self.log.error("critic samples not published after retries", batch=batch.batch_id)

    async def _publish(self, ep: Episode, critic: CriticBatch | None = None) -> None:
        """Publish every sample with its id as ``Nats-Msg-Id``; failures are retried (the id dedups)."""
        if critic is not None:
            await self._publish_critic(critic)
        pending = list(ep.samples)
        for attempt in range(MAX_ATTEMPTS):
            futs = []
            for s in pending:
                try:
                    futs.append(await self.js.publish_async(self.names.traj(s.model), encode(s),
                                                            headers={"Nats-Msg-Id": s.sample_id}))
                except nats.errors.Error as exc:  # stalled or disconnected: counted as failed below
                    futs.append(_failed(exc))
            # A PubAck lost in a failover would leave its future pending forever: each waits a bounded time, and
            # a timed-out sample is published again (its id deduplicates a copy that did land).
            results = await asyncio.gather(*(asyncio.wait_for(f, PUBLISH_ACK_TIMEOUT_S) for f in futs),
                                           return_exceptions=True)
            failed = [s for s, r in zip(pending, results, strict=True) if isinstance(r, BaseException)]
            self.counters["samples_published"] += len(pending) - len(failed)
            if not failed:
                return
            self.counters["publish_retries"] += len(failed)
            first = next(r for r in results if isinstance(r, BaseException))
            self.log.warning("sample publish failed", count=len(failed), error=f"{type(first).__name__}: {first}")
            pending = failed
            await asyncio.sleep(backoff(attempt))
        self.counters["samples_lost"] += len(pending)
        self.log.error("samples not published after retries", task=ep.task.task_id, count=len(pending))

    # --- requests -----------------------------------------------------------------------
    @property
    def link_settle_s(self) -> float:
        """After this coordinator's own connection came back: the time the rollouters' load reports take to list
        them again (those missed while it was away expired them)."""
        return self.cfg.balance.report_interval_s * (self.cfg.balance.misses + 1)
