"""The actions service: ActionRequest -> ActionResult over NATS, every payload run in a worker subprocess."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.msg import Msg

from services.actions.actions import REGISTRY
from services.actions.coderun import isolation
from services.actions.pool import Outcome, WorkerPool
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.config import ConfigError
from shared.kernel.peers import accept
from shared.kernel.schemas import ActionRequest, ActionResult
from shared.kernel.service import Service

QUEUE_GROUP = "actions"
# modules a task's grader imports that take seconds to import: every worker imports them before it is ready, so that
# a fresh worker's first grade does not spend its time budget importing (and time out, on a loaded machine)
PRELOAD: dict[str, tuple[str, ...]] = {"reasoning_gym": ("reasoning_gym",)}


class ActionsService(Service):
    """Request/reply on ``actions.submit`` (queue group ``actions``), FCFS over ``actions.cores`` workers."""

    name = "actions"

    async def setup(self) -> None:
        acfg = self.cfg.actions
        # Tried here once (a trial sandbox) so that a host without namespaces is said at start, not hidden in a
        # worker: code actions then run unisolated (docs/sandbox.md).
        self.isolation = await asyncio.to_thread(isolation)
        mode, reason = self.isolation
        if mode == "none" and acfg.isolation == "namespaces":
            raise ConfigError(
                f"actions.isolation is namespaces, but code cannot run in Linux namespaces here: {reason}. In a "
                "container, allow them (docker: --security-opt seccomp=unconfined --security-opt "
                "systempaths=unconfined, as docker-compose.yml does for actions; docs/sandbox.md); or set "
                "actions.isolation: best_effort to run code without isolation")
        if mode == "none":
            self.log.warning(f"code actions run WITHOUT namespace isolation: {reason}")
        else:
            self.log.info("code actions run in Linux namespaces", isolation=reason)
        self.pool = WorkerPool(acfg.cores, acfg.memory_mb, policy=acfg.scheduler, malleable=acfg.malleable,
                               age_s=acfg.age_s, preload=PRELOAD.get(self.cfg.task.name, ()))
        await self.pool.start()
        self._inflight: set[asyncio.Task[None]] = set()
        self._sub = await self.nc.subscribe(
            self.names.actions_submit(), queue=QUEUE_GROUP, cb=self._on_request, pending_msgs_limit=100_000
        )

    async def teardown(self) -> None:
        await self._sub.unsubscribe()
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=self.cfg.actions.timeout_s + 2)
        for t in list(self._inflight):
            t.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        await self.pool.close()

    def extra_metrics(self) -> dict[str, Any]:
        pool = getattr(self, "pool", None)
        if pool is None:
            return {}
        return {
            "in_flight": len(self._inflight),
            "queued": pool.queued,
            "busy_cores": pool.busy,
            "cores": pool.size,
            "scheduler": pool.policy,
            "age_s": pool.settings.age_s if pool.policy == "chorus" else None,
            "queue_len": pool.queued,
            "queued_kinds": pool.queued_kinds,
            # ACT = queue + execution + overhead, per kind (mean, p50, p99) and per resource
            "act": pool.acts.summary(),
            "pool": dict(pool.counters),
            "isolation": self.isolation[0],
        }

    def periodic_metrics(self) -> dict[str, Any]:
        """Each action since the last metrics message (kind, cores, queue / exec / overhead seconds), batched."""
        pool = getattr(self, "pool", None)
        return {"acts": pool.acts.drain()} if pool is not None else {}

    async def _on_request(self, msg: Msg) -> None:
        # Callbacks of one subscription run one after another: each request gets its own task so that
        # FCFS happens in the scheduler, not in the client's delivery loop.
        await accept(self.nc, msg, self.status_subject)
        task = asyncio.create_task(self._handle(msg), name="actions:request")
        self._inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["handler_failures"] += 1
            self.log.error("action request failed", error=repr(task.exception()))

    async def _handle(self, msg: Msg) -> None:
        self.counters["requests"] += 1
        try:
            req = decode(ActionRequest, msg.data)
        except DecodeError as exc:
            await self._reject(msg, "", f"malformed ActionRequest: {exc.reason}")
            return
        if req.kind not in REGISTRY:
            await self._reject(msg, req.action_id, f"unknown action kind {req.kind!r}; known: {sorted(REGISTRY)}")
            return
        t0 = time.monotonic()
        timeout_s = min(req.timeout_s, self.cfg.actions.timeout_s)

        async def one(i: int, payload: dict[str, Any]) -> Outcome:
            outcome = await self.pool.run(req.kind, payload, timeout_s)
            if req.stream and msg.reply:  # this payload's answer, now: it does not wait for the others
                await self.publish_quietly(msg.reply, encode(ActionResult(
                    action_id=req.action_id, index=i, results=[outcome.result or {}], errors=[outcome.error],
                    seconds=time.monotonic() - t0)))
            return outcome

        outcomes = await asyncio.gather(*(one(i, p) for i, p in enumerate(req.payloads)))
        errors = [o.error for o in outcomes]
        self.counters["actions"] += len(outcomes)
        self.counters["action_errors"] += sum(e is not None for e in errors)
        self.counters["action_timeouts"] += sum(e is not None and e.startswith("timeout after") for e in errors)
        # Results that report their own failure (code that timed out or crashed in run_code).
        self.counters["result_errors"] += sum(bool(o.result and o.result.get("error")) for o in outcomes)
        result = ActionResult(
            action_id=req.action_id,
            results=[o.result or {} for o in outcomes],
            errors=errors,
            seconds=time.monotonic() - t0,
        )
        if msg.reply and not req.stream:
            await msg.respond(encode(result))

    async def _reject(self, msg: Msg, action_id: str, reason: str) -> None:
        await self.to_dlq(msg.subject, msg.data, reason)
        self.counters["rejected"] += 1
        if msg.reply:
            await msg.respond(encode(ActionResult(action_id=action_id, error=reason)))
