"""Whether a run has finished, read from its KV bucket: what `chorus status`, `chorus monitor` and services
started with ``--exit-when-done`` ask."""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared.bus import kv_get_int
from shared.config import ChorusConfig
from shared.subjects import Names


async def trained_versions(kv: KeyValue, cfg: ChorusConfig) -> dict[str, int]:
    """The committed version of every model of the run (0 before its first step)."""
    return {m: await kv_get_int(kv, Names.trained_key(m)) for m in cfg.models}


async def final_eval_written(kv: KeyValue) -> bool:
    try:
        entry = await kv.get(Names.eval_final_key())
    except KeyNotFoundError:
        return False
    return bool(entry.value)


async def run_finished(kv: KeyValue, cfg: ChorusConfig) -> bool:
    """Every model reached ``train.max_versions`` (the trainers' ``trained.<model>`` keys) and, when the run
    evaluates (``eval.every``), the coordinator wrote its evaluation of the final weights."""
    trained = await trained_versions(kv, cfg)
    if any(v < cfg.train.max_versions for v in trained.values()):
        return False
    return not cfg.eval.every or await final_eval_written(kv)
