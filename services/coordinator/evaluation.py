"""Held-out evaluation as the papers report it: pass@1 averaged over n samples per question, pass@k, Maj@N and the
tokens generated per question, for every agent and for the workflow's final answer, on a fixed task list.

Every evaluation plays the same tasks with the same settings (``eval.samples`` rollouts per task at
``eval.temperature``, parallel sampling, no reward shaping), so two evaluations differ only by the weights that
served them. An agent's "question" is one of its turns in one task (its answers at that turn across the n
rollouts); the final answer's is the task.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.coordinator.tasks import Task
from services.coordinator.workflows import Act, Generate, Tokenizers, Workflow, run_episode
from services.coordinator.workflows.episode import Episode
from services.coordinator.workflows.scoring import plurality
from shared.kernel.config import ChorusConfig

CORRECT = 1.0 - 1e-9  # a turn counts as correct at full reward
EVAL_CONCURRENCY = 8  # held-out tasks in flight at once
FINAL = "final"  # the key of the workflow's final answer beside the agents' names

Answer = tuple[str, bool]  # (the answer as extracted, "" when none; whether it was right)


def eval_config(cfg: ChorusConfig) -> ChorusConfig:
    """``cfg`` with ``eval.samples`` parallel rollouts per task at ``eval.temperature`` and raw (unshaped) rewards."""
    workflow = cfg.workflow.model_copy(update={"group_size": cfg.eval.samples, "temperature": cfg.eval.temperature,
                                               "sampling": "parallel"})
    reward = cfg.reward.model_copy(update={"shaping": "none"})
    return cfg.model_copy(update={"workflow": workflow, "reward": reward})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are right (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k); with fewer than k samples, whether any is right."""
    if n <= 0:
        return 0.0
    if n < k:
        return float(c > 0)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[Answer]) -> bool:
    """Maj@N of one question: the most common answer (equal by value: ``math_equal``) is right. Empty answers do
    not vote; ties go to the answer seen first; no answer at all is wrong."""
    return bool(plurality(answers))  # None: nobody answered, wrong


def k_values(n: int, configured: Sequence[int] | None) -> list[int]:
    """The k of pass@k: ``eval.pass_k`` when set, else 1, 2, 4, ... up to n, and n."""
    if configured:
        return sorted(set(configured))
    ks = {1, n}
    k = 2
    while k < n:
        ks.add(k)
        k *= 2
    return sorted(ks)


@dataclass
class TaskOutcome:
    """What one held-out task's n rollouts answered."""

    final: list[Answer]  # per rollout
    has_final_answer: bool = True  # the workflow reports its final answer (Maj@N of the final answer needs it)
    agents: dict[tuple[str, int], list[Answer]] = field(default_factory=dict)  # (agent, turn) -> per rollout
    tokens: list[dict[str, int]] = field(default_factory=list)  # per rollout: response tokens of each agent
    failed: bool = False


def task_outcome(ep: Episode) -> TaskOutcome:
    """The answers of a played task: its final answers, each agent's answer at each of its trained turns, and the
    tokens each agent generated in each rollout."""
    final = [(str(t.get("final_answer") or ""), bool(ok)) for t, ok in zip(ep.trajectories, ep.final_correct,
                                                                             strict=True)]
    answers: dict[tuple[int, int], str] = {}
    for i, traj in enumerate(ep.trajectories):
        for turn in traj["trajectory"]:
            answers[(i, int(turn["turn_id"]))] = str(turn.get("metadata", {}).get("answer") or "")
    agents: dict[tuple[str, int], list[Answer]] = {}
    tokens: list[dict[str, int]] = [{} for _ in ep.trajectories]
    for s in ep.samples:
        agents.setdefault((s.agent, s.turn), []).append((answers.get((s.rollout_idx, s.turn), ""),
                                                         float(s.reward) >= CORRECT))
        if 0 <= s.rollout_idx < len(tokens):
            per = tokens[s.rollout_idx]
            per[s.agent] = per.get(s.agent, 0) + int(s.response_ids.shape[0])
    return TaskOutcome(final=final, has_final_answer=all("final_answer" in t for t in ep.trajectories),
                       agents=agents, tokens=tokens)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def scores(outcomes: Sequence[TaskOutcome], ks: Sequence[int]) -> dict[str, Any]:
    """pass@1 (mean over the n samples of each question, then over questions), pass@k, Maj@N and tokens per
    question, for each agent and the final answer (``"final"``). A task that could not be played counts as
    wrong for the final answer (never skipped) and has no agent answers or tokens."""
    questions: dict[str, list[list[Answer]]] = {}
    for o in outcomes:
        questions.setdefault(FINAL, []).append(o.final)
        for (agent, _turn), answers in sorted(o.agents.items()):
            questions.setdefault(agent, []).append(answers)
    pass1: dict[str, float] = {}
    at_k: dict[str, dict[str, float]] = {}
    maj: dict[str, float] = {}
    for name, qs in questions.items():
        pass1[name] = _mean([sum(ok for _, ok in q) / len(q) for q in qs if q])
        at_k[name] = {str(k): _mean([pass_at_k(len(q), sum(ok for _, ok in q), k) for q in qs]) for k in ks}
        if name != FINAL or all(o.has_final_answer or o.failed for o in outcomes):
            maj[name] = _mean([float(majority_correct(q)) for q in qs])
    rollouts = [r for o in outcomes if not o.failed for r in o.tokens]
    names = sorted({a for r in rollouts for a in r})
    tokens = {a: _mean([float(r.get(a, 0)) for r in rollouts]) for a in names}
    tokens["total"] = _mean([float(sum(r.values())) for r in rollouts])
    final = pass1.pop(FINAL, 0.0)
    return {"pass1": dict(sorted(pass1.items())), "final": final, "pass_at_k": at_k, "maj": maj,
            "tokens_per_question": tokens}


async def evaluate(
    cfg: ChorusConfig,
    tasks: list[Task],
    workflow: Workflow,
    generate: Generate,
    act: Act,
    versions: Callable[[], dict[str, int]],
    tokenizers: Tokenizers,
    on_episode: Callable[[Episode], Awaitable[None]] | None = None,
    concurrency: int = EVAL_CONCURRENCY,
) -> dict[str, Any]:
    """Play every held-out task ``eval.samples`` times; the record written to metrics.jsonl (``"kind": "eval"``).

    A task whose episode fails (a request nobody answered in time, a workflow error or time-out) is played again,
    up to ``eval.retries`` times: a busy machine does not lower the score. One that fails every time counts as
    wrong; ``failed`` counts those, ``retried`` the replays, ``errors`` the last error of each failed task."""
    ecfg = eval_config(cfg)
    n = cfg.eval.samples
    gate = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    before = dict(versions())
    retried = 0

    async def one(i: int, task: Task) -> Episode:
        nonlocal retried
        for attempt in range(cfg.eval.retries + 1):
            try:
                async with gate:
                    ep = await run_episode(ecfg, task, i, workflow, generate, act, versions, tokenizers)
                if on_episode is not None:  # e.g. the coordinator's samples.jsonl record of it
                    await on_episode(ep)
                return ep
            except Exception:
                if attempt == cfg.eval.retries:
                    raise
                retried += 1
        raise AssertionError("unreachable")

    results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)), return_exceptions=True)
    outcomes: list[TaskOutcome] = []
    used: list[int] = []
    errors: dict[str, str] = {}
    for task, ep in zip(tasks, results, strict=True):
        if isinstance(ep, BaseException):
            errors[task.task_id] = f"{type(ep).__name__}: {ep}"[:300]
            outcomes.append(TaskOutcome(final=[("", False)] * n, failed=True))
            continue
        used.extend(s.version for s in ep.samples)
        outcomes.append(task_outcome(ep))
    return {
        "kind": "eval",
        "version": min(used) if used else min(before.values(), default=0),
        "version_max": max(used) if used else max(before.values(), default=0),
        "versions": before,
        "n": len(tasks),
        "samples": n,
        "failed": len(errors),
        "retried": retried,
        "errors": errors,
        # per held-out task, in its fixed order: the share of its n final answers that were right (what flips)
        "final_by_task": [round(sum(ok for _, ok in o.final) / len(o.final), 4) if o.final else 0.0
                          for o in outcomes],
        "temperature": cfg.eval.temperature,
        **scores(outcomes, k_values(n, cfg.eval.pass_k)),
        "seconds": round(time.monotonic() - t0, 3),
        "time": time.time(),
    }
