"""A two-agent critique workflow: a solver drafts an answer, a critic reviews it, the solver revises.

Chorus imports this file by path (``workflow.function: ../examples/my_workflow.py:critique`` in
configs/custom-workflow.yaml) and plays ``critique`` once per rollout: ``group_size`` of them run at once,
and their calls to ``ctx.generate`` / ``ctx.act`` are batched together.
"""

from __future__ import annotations

from typing import Any


def check_kind(ctx: Any) -> str:
    """The action that checks an answer of this run's tasks: the leading number of a compact ``3+4=``
    completion, else the reply's final answer."""
    task = ctx.cfg.task
    return "check_answer" if task.name == "arithmetic" and task.phrasing == "compact" else "check_math"


def turn(ctx: Any, turn_id: int, agent: str, role: str, text: str, row: Any, reward: float) -> dict[str, Any]:
    """One entry of the trajectory; ``gen_id`` ties it to the generation it trains on."""
    return {
        "turn_id": turn_id,
        "agent_index": ctx.agents.index(agent),
        "agent_name": agent,
        "agent_role": role,
        "agent_input": text,
        "agent_output": row.text,
        "metadata": {"gen_id": row.gen_id},
        "reward": reward,
    }


async def critique(ctx: Any, task: Any) -> dict[str, Any]:
    """Draft, critique, revise; the solver earns the check of each of its answers, the critic the final one."""
    solver, critic = ctx.agents[0], ctx.agents[1]
    question = task.question

    (draft,) = await ctx.generate(solver, [question])
    critic_input = f"{question}\nanswer: {draft.text.strip()}\n"
    (review,) = await ctx.generate(critic, [critic_input])
    revise_input = f"{critic_input}critic: {review.text.strip()}\n"
    (final,) = await ctx.generate(solver, [revise_input])

    kind = check_kind(ctx)
    shaped = ctx.cfg.reward.partial_credit  # reward.partial_credit: a near number earns part of the reward
    checks = await ctx.act(kind, [
        {"expected": task.answer, "response": row.text, "finished": row.finished, "partial_credit": shaped}
        for row in (draft, final)
    ])
    draft_reward, final_reward = (float(c.get("reward", 0.0)) for c in checks)
    return {
        "prompt": question,
        "label": task.answer,
        "trajectory": [
            turn(ctx, 0, solver, "solver", question, draft, draft_reward),
            # The critic is judged by what its review led to: the revised answer.
            turn(ctx, 1, critic, "critic", critic_input, review, final_reward),
            turn(ctx, 2, solver, "reviser", revise_input, final, final_reward),
        ],
        "final_reward": final_reward,
    }
