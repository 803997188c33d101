"""The two-agent ``solve_verify`` workflow: a solver answers; a verifier sees the start of that answer and
gives the final one. Both answers are checked with ``check_answer``; the solver's check runs while the
verifier generates."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from services.coordinator.workflows.api import Context, Generate, GenResult, Tokenizers, Trajectory, Turn
from services.coordinator.workflows.episode import Episode, run_episode
from services.coordinator.workflows.scoring import answer_check, check_request, reward_error, unclamped
from shared.kernel.config import ChorusConfig, TaskConfig
from shared.models.loading import Tokenizer

if TYPE_CHECKING:
    from services.coordinator.tasks import Task

SOLVER_TURN = 0
VERIFIER_TURN = 1
SOLVER_ECHO_CHARS = 4  # how much of the solver's answer the verifier sees

Check = Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]]


def printable(text: str) -> str:
    """``text`` without non-printable characters (newlines, control bytes, replacement marks stay out)."""
    return "".join(c for c in text if c.isprintable() and c != "\ufffd")


def verifier_prompt(prefix: str, question: str, solver_text: str) -> str:
    """What the verifier reads: its prompt, the question, the start of the solver's answer, then ``|``."""
    return prefix + question + printable(solver_text[:SOLVER_ECHO_CHARS]) + "|"


def verifier_text(task_cfg: TaskConfig, task: Task, solver_text: str, echo_chars: int | None) -> str:
    """The verifier's user message: ``3+4=7|`` on compact arithmetic (the tiny byte models' task);
    otherwise the question and the solver's proposed answer (cut to ``workflow.echo_chars`` if set)."""
    if answer_check(task_cfg) == "check_answer":
        return verifier_prompt("", task.question, solver_text)
    shown = solver_text if echo_chars is None else solver_text[:echo_chars]
    return f"{task.question}\nProposed answer: {shown.strip()}"


def reward_of(result: dict[str, Any]) -> tuple[float, bool]:
    """(reward, correct) of one check result; a failed check scores 0 (clamped to [0, 1])."""
    reward = result.get("reward", 0.0)
    reward = float(reward) if isinstance(reward, int | float) else 0.0
    return min(1.0, max(0.0, reward)), bool(result.get("correct", False))


def _turn(turn_id: int, agent: str, role: str, text: str, row: GenResult, result: dict[str, Any],
          kind: str) -> Turn:
    reward, correct = reward_of(result)
    own = unclamped(kind, result)
    reward = reward if own is None else own
    meta = {"gen_id": row.gen_id, "correct": correct, "answer": result.get("answer", "")}
    error = reward_error(kind, result)
    if error is not None:
        meta["reward_error"] = error
    return Turn(turn_id=turn_id, agent_index=turn_id, agent_name=agent, agent_role=role, agent_input=text,
                agent_output=row.text, reward=0.0 if error else reward, metadata=meta)


async def solve_verify_workflow(ctx: Context, task: Task) -> Trajectory:
    """One rollout: the solver's answer, the verifier's answer after the solver's first characters."""
    solver, verifier = ctx.cfg.workflow.solver, ctx.cfg.workflow.verifier
    (s_row,) = await ctx.generate(solver, [task.question])

    async def verify() -> tuple[str, GenResult, dict[str, Any]]:
        # The verifier's system prompt comes first, as `chat(prompt, text)` puts it.
        text = verifier_text(ctx.cfg.task, task, s_row.text, ctx.cfg.workflow.echo_chars)
        (v_row,) = await ctx.generate(verifier, [text])
        (v_check,) = await ctx.act(check_kind, [check_request(ctx.cfg, task, v_row.text, v_row.finished)[1]])
        return text, v_row, v_check

    check_kind, s_payload = check_request(ctx.cfg, task, s_row.text, s_row.finished)
    (s_check,), (v_text, v_row, v_check) = await asyncio.gather(ctx.act(check_kind, [s_payload]), verify())
    turns = [_turn(SOLVER_TURN, solver, "solver", task.question, s_row, s_check, check_kind),
             _turn(VERIFIER_TURN, verifier, "verifier", v_text, v_row, v_check, check_kind)]
    return Trajectory(prompt=task.question, label=task.answer, trajectory=turns,
                      final_reward=turns[-1].get("reward", 0.0), final_answer=str(v_check.get("answer", "")))


async def solve_verify(
    cfg: ChorusConfig,
    task: Task,
    env_idx: int,
    generate: Generate,
    check: Check,
    versions: Callable[[], dict[str, int]],
    tokenizers: Tokenizers | Mapping[str, Tokenizer] | None = None,
) -> Episode:
    """Run one task: G solver rollouts in one request, G verifier rollouts in one request, checked."""

    async def act(kind: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        own = check_request(cfg, task, "", True)[0]
        if kind != own:
            raise ValueError(f"solve_verify on this task runs only {own}, not {kind!r}")
        return await check(payloads)

    return await run_episode(cfg, task, env_idx, solve_verify_workflow, generate, act, versions, tokenizers)
