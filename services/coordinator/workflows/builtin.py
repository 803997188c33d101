"""The built-in workflows on the turn-order state machine: debate, chain, mixture, solver_coder_refiner.

Each plays one rollout of a task and returns a MARTI trajectory; every turn's reward is the task's check of
that turn's answer, and ``final_reward`` is the check of the workflow's final answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.coordinator.workflows.api import Context, Trajectory, Turn
from services.coordinator.workflows.scoring import majority, run_code, score_turns, tool_text
from services.coordinator.workflows.turns import (
    Step,
    chain_order,
    clip,
    debate_order,
    mixture_order,
    play,
    solver_coder_refiner_order,
)

if TYPE_CHECKING:
    from services.coordinator.tasks import Task

DEFAULT_ROUNDS = {"debate": 2}


def rounds_of(ctx: Context) -> int:
    wf = ctx.cfg.workflow
    return wf.rounds if wf.rounds is not None else DEFAULT_ROUNDS.get(wf.name, 1)


def trajectory(task: Task, turns: list[Turn], final: Turn) -> Trajectory:
    return Trajectory(prompt=task.question, label=task.answer, trajectory=turns,
                      final_reward=final.get("reward", 0.0), final_answer=final["metadata"].get("answer", ""))


async def _played(ctx: Context, task: Task, order: Sequence[Step], question: str | None = None) -> list[Turn]:
    async def tools(ctx: Context, stage: list[Step], turns: list[Turn]) -> None:
        coded = [t for s, t in zip(stage, turns, strict=True) if s.tool == "run_code"]
        if coded:
            results = await run_code(ctx, task, [t["agent_output"] for t in coded])
            for t, result in zip(coded, results, strict=True):
                t["metadata"]["tool_result"] = result
                t["metadata"]["tool_output"] = tool_text(result)

    turns = await play(ctx, task.question if question is None else question, order, chars=ctx.cfg.workflow.echo_chars, after_stage=tools)
    await score_turns(ctx, task, turns)
    return turns


async def debate(ctx: Context, task: Task) -> Trajectory:
    """Multi-agent debate: N agents x R rounds, the final answer by majority vote over the last round."""
    rounds = rounds_of(ctx)
    turns = await _played(ctx, task, debate_order(ctx.agents, rounds))
    last = [t for t in turns if t["metadata"]["round"] == rounds - 1]
    final = majority(last)
    for t in last:
        t["metadata"]["voted"] = t is final
    return trajectory(task, turns, final)


async def chain(ctx: Context, task: Task) -> Trajectory:
    """Chain-of-agents: each agent refines the answer of the agent before it; the last answer is final. With
    ``workflow.feedback`` a round is played only while the answers are wrong (:func:`chain_with_feedback`)."""
    if ctx.cfg.workflow.feedback:
        return await chain_with_feedback(ctx, task)
    turns = await _played(ctx, task, chain_order(ctx.agents, rounds_of(ctx)))
    return trajectory(task, turns, turns[-1])


def feedback_text(question: str, turn: Turn, chars: int | None) -> str:
    """What the first agent of the next round is shown after a wrong answer: the question, the answer, and that
    it was wrong."""
    answer = str(turn["metadata"].get("answer", "")) or clip(turn["agent_output"], chars)
    return f"{question}\n{turn['agent_name']}: {clip(turn['agent_output'], chars)}\nfeedback: {answer} is wrong.\n"


async def chain_with_feedback(ctx: Context, task: Task) -> Trajectory:
    """An environment of ``workflow.rounds`` time steps (MARFT's horizon): each round the agents act in order,
    the last one answering; a right answer ends the episode, a wrong one is shown, marked wrong, to the next
    round's first agent. Every turn's metadata carries its ``round``; the final answer is the last round's."""
    chars = ctx.cfg.workflow.echo_chars
    turns: list[Turn] = []
    question = task.question
    for r in range(rounds_of(ctx)):
        played = await _played(ctx, task, chain_order(ctx.agents, 1), question)
        offset = len(turns)
        for t in played:
            t["turn_id"] += offset
            meta = t["metadata"]
            meta["round"], meta["stage"] = r, meta["stage"] + offset
            meta["seen"] = [i + offset for i in meta["seen"]]
        turns += played
        last = played[-1]
        if last.get("reward", 0.0) >= 1.0:
            break
        question = feedback_text(task.question, last, chars)
    return trajectory(task, turns, turns[-1])


async def mixture(ctx: Context, task: Task) -> Trajectory:
    """Mixture-of-agents: the proposers answer independently, the aggregator (last agent) gives the answer."""
    turns = await _played(ctx, task, mixture_order(ctx.agents, rounds_of(ctx)))
    return trajectory(task, turns, turns[-1])


async def solver_coder_refiner(ctx: Context, task: Task) -> Trajectory:
    """The solver reasons, the coder's program is run (against the task's tests for a code task), the refiner
    sees the reasoning, the code and its result and gives the final answer (or code)."""
    turns = await _played(ctx, task, solver_coder_refiner_order(ctx.agents))
    return trajectory(task, turns, turns[-1])
