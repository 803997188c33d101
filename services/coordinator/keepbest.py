"""The coordinator's side of keeping the best held-out version (:mod:`shared.models.best`).

Before an evaluation, the weights of the version each model serves are copied from the object store (where the
trainer committed them) to the run directory; after it, they become the best if the evaluation beat the best so
far on the final answer, else they are deleted. The object of a served version is the one its sync named
(``SyncDone.object_name``); a coordinator that started after that sync finds it by its name.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path
from typing import Any

import nats.errors
import structlog
from nats.js import JetStreamContext

from shared.kernel.bus import object_names, read_object
from shared.kernel.files import write_atomic
from shared.kernel.subjects import Names
from shared.models import best

log = structlog.get_logger("coordinator.best")
REMEMBERED = 32  # synced versions whose object name is remembered, per model


class BestKeeper:
    def __init__(self, js: JetStreamContext, names: Names, run_dir: Path, models: list[str]) -> None:
        self.js, self.names, self.run_dir, self.models = js, names, run_dir, models
        self.objects: dict[str, OrderedDict[int, str]] = {m: OrderedDict() for m in models}
        self.best = best.read_record(run_dir)  # a restarted coordinator goes on from the best it kept
        self.errors = 0
        for model in models:  # copies a coordinator killed mid-evaluation left behind
            for left in best.weights_path(run_dir, model).parent.glob(".eval-v*.weights"):
                left.unlink(missing_ok=True)

    def synced(self, model: str, version: int, object_name: str | None) -> None:
        if object_name and model in self.objects:
            seen = self.objects[model]
            seen[version] = object_name
            while len(seen) > REMEMBERED:
                seen.popitem(last=False)

    async def _object_of(self, model: str, version: int) -> str | None:
        name = self.objects[model].get(version)
        if name is not None:
            return name
        prefix = Names.weights_object(model, version)
        found = [n for n in await object_names(self.js, self.names.obj_bucket)
                 if n == prefix or n.startswith(prefix + "-")]
        return found[-1] if len(found) == 1 else None  # two: a fenced trainer's leftover; cannot tell which

    async def stage(self, served: dict[str, int]) -> dict[str, Path | None] | None:
        """Copy the served weights of every model to the run directory; None when one cannot be had (that
        evaluation then cannot become the best)."""
        staged: dict[str, Path | None] = {}
        try:
            for model in self.models:
                version = served.get(model, 0)
                if version == 0:
                    staged[model] = None  # the seeded start: nothing to copy
                    continue
                name = await self._object_of(model, version)
                if name is None:
                    raise LookupError(f"no unique weights object of {model} v{version}")
                data = await read_object(self.js, self.names.obj_bucket, name, verify_digest=False)
                path = best.staged_path(self.run_dir, model, version)
                await asyncio.to_thread(write_atomic, path, data)
                staged[model] = path
        except (LookupError, nats.errors.Error, TimeoutError, OSError) as exc:
            self.errors += 1
            log.warning("could not copy the evaluated weights; this evaluation cannot become the best",
                        error=f"{type(exc).__name__}: {exc}")
            await asyncio.to_thread(best.discard, staged)
            return None
        return staged

    async def settle(self, rec: dict[str, Any], staged: dict[str, Path | None] | None,
                     served: dict[str, int]) -> bool:
        """Keep the staged weights (of ``served``) if ``rec`` is the best evaluation so far; True if it is."""
        if staged is None:
            return False
        try:
            if not best.is_better(rec, self.best):
                await asyncio.to_thread(best.discard, staged)
                return False
            await asyncio.to_thread(best.keep, self.run_dir, rec, staged, {m: served.get(m, 0) for m in staged})
        except OSError as exc:  # a full or read-only disk: the run goes on without this best
            self.errors += 1
            log.warning("could not keep the best evaluated weights", error=f"{type(exc).__name__}: {exc}")
            return False
        self.best = best.read_record(self.run_dir)
        return True

