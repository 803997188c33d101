"""The benchmark's workload: one agent answers a task, with a response length drawn from a long-tail
(Pareto) distribution, so a few rollouts of a batch run many times longer than most (the straggler effect).

Referenced from the benchmark's config as ``workflow.function: loadtests/longtail_workflow.py:longtail``.
"""

from __future__ import annotations

import math
import random
from typing import Any

SHORTEST = 4  # tokens
LONGEST = 96
ALPHA = 1.1  # Pareto shape: P(length > x) = (SHORTEST / x) ** ALPHA


def long_tail_length(rng: random.Random) -> int:
    """A response length in [SHORTEST, LONGEST]; about 1 in 10 rollouts is over 30 tokens, 1 in 25 over 64."""
    return min(LONGEST, math.ceil(SHORTEST * rng.paretovariate(ALPHA)))


async def longtail(ctx: Any, task: Any) -> dict[str, Any]:
    """One turn of the first agent, checked against the task; its length is fixed by (task, rollout)."""
    agent = ctx.agents[0]
    rng = random.Random(f"{task.task_id}/{ctx.rollout}")
    (row,) = await ctx.generate(agent, [task.question], max_new_tokens=long_tail_length(rng))
    (check,) = await ctx.act("check_answer", [{"expected": task.answer, "response": row.text,
                                               "finished": row.finished}])
    reward = float(check.get("reward", 0.0))
    return {
        "prompt": task.question,
        "label": task.answer,
        "trajectory": [{"turn_id": 0, "agent_index": 0, "agent_name": agent, "agent_role": "solver",
                        "agent_input": task.question, "agent_output": row.text,
                        "metadata": {"gen_id": row.gen_id}, "reward": reward}],
        "final_reward": reward,
    }
