"""The training pool as a service (``chorus serve trainer`` without ``--model``, with ``train.pool.slots`` > 0): one
process that runs every model's trainer (:class:`~services.trainer.service.TrainerService`, each with its own NATS
connection, consumer, commits and status endpoint, exactly as a trainer process of its own would) as tenants of the
pool's slots (:class:`~services.trainer.pool.TrainingPool`), and reports the slots.

Crash-only as the trainers are: a slot worker killed mid-call is restarted and the call runs again from the stored
state; a trainer that stops (fenced, a step that failed on every attempt) stops the whole pool, and the supervisor
starts it again, every model from its committed version.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from services.trainer.pool import TrainingPool
from services.trainer.service import TrainerService
from shared.kernel.config import ConfigError
from shared.kernel.service import Service


class TrainPoolService(Service):
    """Every model's trainer in one process, sharing ``train.pool.slots`` slots."""

    name = "trainer"
    per_model = False

    async def setup(self) -> None:
        slots = self.cfg.train.pool.slots
        if not slots:
            raise ConfigError("`chorus serve trainer` without --model runs the training pool, but train.pool.slots "
                              "is 0: set it, or serve each model's trainer with --model")
        self.pool = await asyncio.to_thread(TrainingPool, self.cfg, log=self.log)
        snap = self.pool.snapshot()
        self.log.info("training pool", slots=slots, mode=self.pool.mode,
                      cores=[s["cores"] for s in snap["slots"]], models=sorted(self.cfg.models),
                      budget_mb=self.cfg.train.pool.budget_mb)
        self.trainers: list[TrainerService] = []
        for model in self.cfg.models:
            t = TrainerService(self.cfg, nats_url=self.nats_url, instance=self.instance, model=model)
            t.pool = self.pool
            self.trainers.append(t)
        await asyncio.gather(*(t.start() for t in self.trainers))
        self.spawn(self._watch(), "watch")

    async def _watch(self) -> None:
        """A trainer that stops takes the pool down (its supervisor restarts every model from its commit)."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for t in self.trainers:
                if t.stopping and not self.stopping:
                    self.counters["trainer_stops"] += 1
                    self.log.error("a trainer of the pool stopped: stopping the pool", model=t.model,
                                   exit_code=t.exit_code)
                    self.stop(t.exit_code or 1)
                    return

    async def teardown(self) -> None:
        for t in getattr(self, "trainers", []):
            t.stop()
        await asyncio.gather(*(self._drain(t) for t in getattr(self, "trainers", [])))
        if hasattr(self, "pool"):
            await asyncio.to_thread(self.pool.close)

    async def _drain(self, t: TrainerService) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(t.teardown(), timeout=25)
        with contextlib.suppress(Exception):
            await t._close()

    def extra_metrics(self) -> dict[str, Any]:
        pool = getattr(self, "pool", None)
        return {"pool": pool.snapshot()} if pool is not None else {}
