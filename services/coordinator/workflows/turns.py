"""A turn-order state machine: a declared order of (agent, role) turns over rounds, each turn seeing a chosen
view of the turns before it. Turns of one stage run concurrently and see only earlier stages."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.coordinator.workflows.api import Context, Turn

# What a turn is shown of the turns before it:
#   question               nothing, only the question
#   previous               the turn just before it (chain-of-agents)
#   previous_stage         every turn of the stage before (mixture-of-agents aggregator)
#   others_previous_round  the other agents' turns of the previous round (debate)
#   all                    every earlier turn
View = Literal["question", "previous", "previous_stage", "others_previous_round", "all"]
VIEWS: tuple[View, ...] = ("question", "previous", "previous_stage", "others_previous_round", "all")


@dataclass(frozen=True)
class Step:
    """One declared turn: who speaks, in which role, when, what it sees, and an optional tool run after it."""

    agent: str
    role: str
    round: int
    stage: int  # steps of one stage generate concurrently
    view: View = "question"
    tool: Literal["run_code"] | None = None  # run the turn's code; the output is shown to later turns


# A hook run on each stage's finished turns (e.g. the code tool); it may add to their metadata.
StageHook = Callable[[Context, list[Step], list[Turn]], Awaitable[None]]


def seen_turns(history: Sequence[Turn], step: Step) -> list[Turn]:
    """The earlier turns ``step`` is shown, in order."""
    meta = [t["metadata"] for t in history]
    if step.view == "question" or not history:
        return []
    if step.view == "previous":
        return [history[-1]]
    if step.view == "previous_stage":
        last = max(m["stage"] for m in meta)
        return [t for t in history if t["metadata"]["stage"] == last]
    if step.view == "others_previous_round":
        return [t for t in history
                if t["metadata"]["round"] == step.round - 1 and t["agent_name"] != step.agent]
    if step.view == "all":
        return list(history)
    raise ValueError(f"unknown view {step.view!r}: expected one of {VIEWS}")


def clip(text: str, chars: int | None) -> str:
    """``text`` without control characters (newlines and tabs stay), cut to ``chars`` when set."""
    kept = "".join(c for c in text if (c.isprintable() or c in "\n\t") and c != "\ufffd").strip()
    return kept if chars is None else kept[:chars]


def render(question: str, seen: Sequence[Turn], chars: int | None) -> str:
    """The user text of a turn: the question, then each seen turn as ``name: output`` (and its tool result).

    Short on purpose: the agents' system prompts say what to do with it, and tiny byte-level models have a
    short context.
    """
    if not seen:
        return question
    lines = [question]
    for t in seen:
        lines.append(f"{t['agent_name']}: {clip(t['agent_output'], chars)}")
        tool = t["metadata"].get("tool_output")
        if tool is not None:
            lines.append(f"result: {clip(str(tool), chars)}")
    return "\n".join(lines) + "\n"


def stages(order: Sequence[Step]) -> list[list[Step]]:
    """The steps grouped by stage, stages in increasing order."""
    by: dict[int, list[Step]] = {}
    for s in order:
        by.setdefault(s.stage, []).append(s)
    return [by[k] for k in sorted(by)]


async def play(ctx: Context, question: str, order: Sequence[Step], *, chars: int | None = None,
               after_stage: StageHook | None = None) -> list[Turn]:
    """Play ``order`` for one rollout; returns its turns (rewards not set), ``turn_id`` = position in order."""
    agents = ctx.agents
    history: list[Turn] = []
    for stage in stages(order):
        seen = [seen_turns(history, s) for s in stage]
        inputs = [render(question, shown, chars) for shown in seen]
        rows = await asyncio.gather(*(ctx.generate(s.agent, [text]) for s, text in zip(stage, inputs, strict=True)))
        turns: list[Turn] = []
        for s, text, (row,), shown in zip(stage, inputs, rows, seen, strict=True):
            meta: dict[str, Any] = {"round": s.round, "stage": s.stage, "gen_id": row.gen_id,
                                    "seen": [t["turn_id"] for t in shown], "finished": row.finished}
            index = agents.index(s.agent) if s.agent in agents else -1
            turns.append(Turn(turn_id=len(history) + len(turns), agent_index=index, agent_name=s.agent,
                              agent_role=s.role, agent_input=text, agent_output=row.text, metadata=meta))
        if after_stage is not None:
            await after_stage(ctx, stage, turns)
        history.extend(turns)
    return history


# --- the built-in orders -------------------------------------------------------------------------------------
def debate_order(agents: Sequence[str], rounds: int) -> list[Step]:
    """N agents x R rounds; round 0 answers alone, round r > 0 sees the others' answers of round r - 1."""
    return [Step(a, "debater", r, r, "question" if r == 0 else "others_previous_round")
            for r in range(rounds) for a in agents]


def chain_order(agents: Sequence[str], rounds: int) -> list[Step]:
    """Each agent refines the answer of the one before it; ``rounds`` passes over the chain."""
    steps: list[Step] = []
    for r in range(rounds):
        for i, a in enumerate(agents):
            first = r == 0 and i == 0
            steps.append(Step(a, "generator" if first else "refiner", r, len(steps), "question" if first else "previous"))
    return steps


def mixture_order(agents: Sequence[str], rounds: int) -> list[Step]:
    """Proposers (all but the last agent) answer in ``rounds`` layers, each layer seeing the one before; the
    aggregator (the last agent) sees the last layer and answers."""
    *proposers, aggregator = agents
    steps = [Step(a, "proposer", r, r, "question" if r == 0 else "previous_stage") for r in range(rounds)
             for a in proposers]
    return [*steps, Step(aggregator, "aggregator", rounds, rounds, "previous_stage")]


def solver_coder_refiner_order(agents: Sequence[str]) -> list[Step]:
    """The solver reasons, the coder writes code that is run, the refiner sees both and the code's result."""
    solver, coder, refiner = agents
    return [Step(solver, "solver", 0, 0), Step(coder, "coder", 0, 1, "previous", tool="run_code"),
            Step(refiner, "refiner", 0, 2, "all")]
