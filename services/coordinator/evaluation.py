"""Held-out evaluation: pass@1 per agent and of the workflow's final answer on a fixed task list.

Every evaluation plays the same tasks with the same settings (one rollout per task, ``eval.temperature``,
no reward shaping), so two evaluations differ only by the weights that served them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from services.coordinator.tasks import Task
from services.coordinator.workflows import Act, Generate, Tokenizers, Workflow, run_episode
from shared.config import ChorusConfig

CORRECT = 1.0 - 1e-9  # a turn counts as correct at full reward
EVAL_CONCURRENCY = 8  # held-out tasks in flight at once


def eval_config(cfg: ChorusConfig) -> ChorusConfig:
    """``cfg`` with one greedy-or-fixed-temperature rollout per task and raw (unshaped) rewards."""
    workflow = cfg.workflow.model_copy(update={"group_size": 1, "temperature": cfg.eval.temperature})
    reward = cfg.reward.model_copy(update={"shaping": "none"})
    return cfg.model_copy(update={"workflow": workflow, "reward": reward})


def pass_at_1(per_agent: dict[str, list[float]], finals: list[bool]) -> tuple[dict[str, float], float]:
    """Fraction of each agent's answers at full reward, and of final answers that were right."""
    pass1 = {a: sum(r >= CORRECT for r in rs) / len(rs) for a, rs in sorted(per_agent.items()) if rs}
    final = sum(finals) / len(finals) if finals else 0.0
    return pass1, final


async def evaluate(
    cfg: ChorusConfig,
    tasks: list[Task],
    workflow: Workflow,
    generate: Generate,
    act: Act,
    versions: Callable[[], dict[str, int]],
    tokenizers: Tokenizers,
) -> dict[str, Any]:
    """Play every held-out task once; the record written to metrics.jsonl (``"kind": "eval"``)."""
    ecfg = eval_config(cfg)
    gate = asyncio.Semaphore(EVAL_CONCURRENCY)
    t0 = time.monotonic()
    before = dict(versions())

    async def one(i: int, task: Task) -> Any:
        async with gate:
            return await run_episode(ecfg, task, i, workflow, generate, act, versions, tokenizers)

    results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)), return_exceptions=True)
    per_agent: dict[str, list[float]] = {}
    finals: list[bool] = []
    used: list[int] = []
    failed = 0
    for ep in results:
        if isinstance(ep, BaseException):
            failed += 1
            finals.append(False)  # a task that could not be played counts as wrong, never as skipped
            continue
        for s in ep.samples:
            per_agent.setdefault(s.agent, []).append(float(s.reward))
            used.append(s.version)
        finals.extend(ep.final_correct)
    pass1, final = pass_at_1(per_agent, finals)
    return {
        "kind": "eval",
        "version": min(used) if used else min(before.values(), default=0),
        "version_max": max(used) if used else max(before.values(), default=0),
        "versions": before,
        "n": len(tasks),
        "failed": failed,
        "temperature": cfg.eval.temperature,
        "pass1": pass1,
        "final": final,
        "seconds": round(time.monotonic() - t0, 3),
        "time": time.time(),
    }
