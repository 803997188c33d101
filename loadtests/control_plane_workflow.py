"""The workflow of ``bench_control_plane.py``: one generation per rollout, by the agent the task falls to.

Tasks spread over the run's agents (one per model) by a hash of the question, so every model gets episodes and a
task's group is one agent's. The reward is read from the generated text (its first character's parity), so the
rewards of a group differ and training has something to do; it measures the control plane, not learning.
"""

from __future__ import annotations

import zlib
from typing import Any


async def one_call(ctx: Any, task: Any) -> dict[str, Any]:
    agent = ctx.agents[zlib.crc32(f"{task.question}|{task.answer}".encode()) % len(ctx.agents)]
    (row,) = await ctx.generate(agent, [task.question])
    reward = float(ord(row.text[0]) % 2) if row.text else 0.0
    return {
        "prompt": task.question,
        "label": task.answer,
        "trajectory": [{
            "turn_id": 0, "agent_index": ctx.agents.index(agent), "agent_name": agent, "agent_role": "solver",
            "agent_input": task.question, "agent_output": row.text, "metadata": {"gen_id": row.gen_id},
            "reward": reward,
        }],
        "final_reward": reward,
    }
