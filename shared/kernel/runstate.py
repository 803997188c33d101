"""Whether a run has finished, read from its KV bucket: what `chorus status`, `chorus monitor` and services
started with ``--exit-when-done`` ask."""

from __future__ import annotations

from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared.kernel.bus import kv_get_int
from shared.kernel.config import ChorusConfig
from shared.kernel.subjects import Names


@dataclass(frozen=True)
class RunState:
    trained: dict[str, int]  # the committed version of every model (0 before its first step)
    all_trained: bool  # every model reached train.max_versions
    evaluated: bool  # the final weights were evaluated, or the run does not evaluate (no eval.every)

    @property
    def finished(self) -> bool:
        return self.all_trained and self.evaluated


async def trained_versions(kv: KeyValue, cfg: ChorusConfig) -> dict[str, int]:
    """The committed version of every model of the run (0 before its first step)."""
    return {m: await kv_get_int(kv, Names.trained_key(m)) for m in cfg.models}


async def final_eval_written(kv: KeyValue) -> bool:
    try:
        entry = await kv.get(Names.eval_final_key())
    except KeyNotFoundError:
        return False
    return bool(entry.value)


async def run_state(kv: KeyValue, cfg: ChorusConfig) -> RunState:
    """The trainers' ``trained.<model>`` keys and, once every model reached ``train.max_versions`` in a run that
    evaluates (``eval.every``), whether the coordinator wrote its evaluation of the final weights."""
    trained = await trained_versions(kv, cfg)
    all_trained = all(v >= cfg.train.max_versions for v in trained.values())
    evaluated = not cfg.eval.every or (all_trained and await final_eval_written(kv))
    return RunState(trained, all_trained, evaluated)


async def run_finished(kv: KeyValue, cfg: ChorusConfig) -> bool:
    """Every model reached ``train.max_versions`` and, when the run evaluates, its final weights were evaluated."""
    return (await run_state(kv, cfg)).finished


async def stage_closed(kv: KeyValue, cfg: ChorusConfig, key: str) -> bool:
    """The stage of ``key`` (:meth:`Names.coordinator_closed_key`, :meth:`Names.mq_closed_key`) sends nothing more
    to the run's training of ``train.max_versions`` versions; a key of a shorter run resumed longer does not count."""
    return await kv_get_int(kv, key) >= cfg.train.max_versions
