"""The two-agent ``solve_verify`` workflow: plain async logic over ``generate`` and ``check`` callables.

A solver answers ``G`` times; a verifier sees each solver answer and gives the final one. Every turn of
every rollout becomes one :class:`Sample` of its agent's model, grouped AT-GRPO style by (env, agent, turn).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.coordinator.tasks import Task
from shared.config import ChorusConfig
from shared.schemas import Array, Sample
from shared.tokenizer import ByteTokenizer

SOLVER_TURN = 0
VERIFIER_TURN = 1
SOLVER_ECHO_CHARS = 4  # how much of the solver's answer the verifier sees


@dataclass
class GenResult:
    """One generated row: response ids (EOS included when it stopped), behaviour log-probs, the version."""

    ids: list[int]
    logprobs: list[float]
    finished: bool  # stopped on EOS (not by the length limit)
    version: int
    seconds: float = 0.0


class Generate(Protocol):
    async def __call__(
        self, model: str, adapter: str | None, prompts: list[list[int]], *,
        max_new_tokens: int, temperature: float, top_p: float,
    ) -> list[GenResult]: ...


Check = Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]]


@dataclass
class Episode:
    """The samples of one task (2G of them) and what the coordinator reports about it."""

    task: Task
    samples: list[Sample]
    rewards: dict[str, list[float]] = field(default_factory=dict)  # agent -> per-rollout reward
    final_correct: list[bool] = field(default_factory=list)  # verifier's answer, per rollout
    seconds: float = 0.0


def printable(text: str) -> str:
    """``text`` without non-printable characters (newlines, control bytes, replacement marks stay out)."""
    return "".join(c for c in text if c.isprintable() and c != "\ufffd")


def verifier_prompt(prefix: str, question: str, solver_text: str) -> str:
    """What the verifier reads: its prompt, the question, the start of the solver's answer, then ``|``."""
    return prefix + question + printable(solver_text[:SOLVER_ECHO_CHARS]) + "|"


def check_payloads(expected: str, rows: list[GenResult], tok: ByteTokenizer) -> list[dict[str, Any]]:
    return [{"expected": expected, "response": tok.decode(r.ids), "finished": r.finished} for r in rows]


def reward_of(result: dict[str, Any]) -> tuple[float, bool]:
    """(reward, correct) of one check result; a failed check scores 0 (clamped to [0, 1])."""
    reward = result.get("reward", 0.0)
    reward = float(reward) if isinstance(reward, int | float) else 0.0
    return min(1.0, max(0.0, reward)), bool(result.get("correct", False))


async def solve_verify(
    cfg: ChorusConfig,
    task: Task,
    env_idx: int,
    generate: Generate,
    check: Check,
    versions: Callable[[], dict[str, int]],
    tok: ByteTokenizer | None = None,
) -> Episode:
    """Run one task: G solver rollouts in one request, G verifier rollouts in one request, checked."""
    tok = tok or ByteTokenizer()
    wf = cfg.workflow
    G = wf.group_size
    solver_name, verifier_name = wf.solver, wf.verifier
    solver, verifier = cfg.agents[solver_name], cfg.agents[verifier_name]
    sampling = {"max_new_tokens": wf.max_new_tokens, "temperature": wf.temperature, "top_p": wf.top_p}
    t0 = time.monotonic()

    s_prompt = tok.encode(solver.prompt + task.question)
    s_rows = await generate(solver.model, solver.adapter, [s_prompt] * G, **sampling)
    s_gen_s = time.monotonic() - t0
    _expect_rows(s_rows, G, solver.model)
    s_texts = [tok.decode(r.ids) for r in s_rows]

    async def verifier_turn() -> tuple[list[list[int]], list[GenResult], list[dict[str, Any]], float]:
        prompts = [tok.encode(verifier_prompt(verifier.prompt, task.question, t)) for t in s_texts]
        t1 = time.monotonic()
        rows = await generate(verifier.model, verifier.adapter, prompts, **sampling)
        gen_s = time.monotonic() - t1
        _expect_rows(rows, G, verifier.model)
        return prompts, rows, await check(check_payloads(task.answer, rows, tok)), gen_s

    # The solver's check runs while the verifier generates.
    s_checks, (v_prompts, v_rows, v_checks, v_gen_s) = await asyncio.gather(
        check(check_payloads(task.answer, s_rows, tok)), verifier_turn()
    )
    _expect_rows(s_checks, G, "check_answer")
    _expect_rows(v_checks, G, "check_answer")
    snapshot = dict(versions())
    seconds = time.monotonic() - t0

    def samples(agent: str, model: str, adapter: str | None, turn: int, prompts: list[list[int]],
                rows: list[GenResult], checks: list[dict[str, Any]], gen_s: float) -> list[Sample]:
        return [
            Sample(
                run=cfg.run.id,
                episode=f"{task.task_id}/{i}",
                sample_id=Sample.make_id(task.task_id, turn, i),
                env_idx=env_idx,
                rollout_idx=i,
                agent=agent,
                model=model,
                adapter=adapter,
                turn=turn,
                prompt_ids=Array.of(prompts[i], "int32"),
                response_ids=Array.of(row.ids, "int32"),
                behavior_logprobs=Array.of(row.logprobs, "float32"),
                reward=reward_of(checks[i])[0],
                group_key=f"{task.task_id}:{agent}:{turn}",
                group_size=G,
                version=row.version,
                versions=snapshot,
                timings={"gen_s": gen_s, "episode_s": seconds},
            )
            for i, row in enumerate(rows)
        ]

    out = samples(solver_name, solver.model, solver.adapter, SOLVER_TURN, [s_prompt] * G, s_rows, s_checks, s_gen_s)
    out += samples(verifier_name, verifier.model, verifier.adapter, VERIFIER_TURN, v_prompts, v_rows, v_checks,
                   v_gen_s)
    return Episode(
        task=task,
        samples=out,
        rewards={solver_name: [reward_of(c)[0] for c in s_checks], verifier_name: [reward_of(c)[0] for c in v_checks]},
        final_correct=[reward_of(c)[1] for c in v_checks],
        seconds=seconds,
    )


def _expect_rows(rows: list[Any], n: int, what: str) -> None:
    if len(rows) != n:
        raise ValueError(f"{what}: expected {n} rows, got {len(rows)}")
