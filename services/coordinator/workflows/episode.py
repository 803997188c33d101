"""One task: G rollouts of a workflow at once, their trajectories checked, shaped and turned into Samples.

Every turn that names one of its rollout's generations becomes a Sample of its agent's model: id
``{task_id}_{turn}_{rollout}``, AT-GRPO group ``{task_id}:{agent}:{turn}`` (env, agent, turn), so a group is
the G rollouts of one agent at one turn. A group that not every rollout reached is dropped and counted.

Tree sampling (``workflow.sampling: tree``) plays the workflow once; a turn's group is then the G candidates of
its step, id ``{task_id}_{turn}_{candidate}``, each rewarded by the step's check. Under ``train.grouping:
episode`` every Sample leaves with its group's GRPO advantage.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.coordinator.rewards import shape
from services.coordinator.workflows.api import (
    Abandon,
    Act,
    Context,
    Generate,
    GenResult,
    Runtime,
    Tokenizers,
    TreeStep,
    Turn,
    Workflow,
    WorkflowError,
    WorkflowTimeout,
)
from services.coordinator.workflows.scoring import check
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Array, Sample
from shared.models.loading import Tokenizer
from shared.rlmath.advantages import GROUP_ESTIMATORS, estimate

if TYPE_CHECKING:
    from services.coordinator.tasks import Task

TURN_KEYS = ("agent_name", "agent_output")


@dataclass
class Episode:
    """The samples of one task and what the coordinator reports about it."""

    task: Task
    samples: list[Sample]
    rewards: dict[str, list[float]] = field(default_factory=dict)  # agent -> rewards of its samples
    final_correct: list[bool] = field(default_factory=list)  # per rollout: the final answer was right
    final_rewards: list[float] = field(default_factory=list)
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    dropped_groups: int = 0  # (agent, turn) groups that not every rollout reached
    untrained_turns: int = 0  # turns that name no generation of their rollout (scripted text, tool turns)
    seconds: float = 0.0
    reward_errors: list[str] = field(default_factory=list)  # why each sample without a reward was dropped
    tokens_generated: int = 0  # response tokens of every generation of the task's rollouts, trained or not


async def run_episode(
    cfg: ChorusConfig,
    task: Task,
    env_idx: int,
    workflow: Workflow,
    generate: Generate,
    act: Act,
    versions: Callable[[], dict[str, int]],
    tokenizers: Tokenizers | Mapping[str, Tokenizer] | None = None,
) -> Episode:
    """Play ``group_size`` rollouts of ``workflow`` on ``task`` concurrently (or one tree-sampled rollout); raise
    WorkflowError / Abandon if any fails (the task is then dropped whole: groups are never partial)."""
    if not isinstance(tokenizers, Tokenizers):
        tokenizers = Tokenizers(cfg, tokenizers)
    G = cfg.workflow.group_size
    # With one candidate per step (evaluation plays G = 1) a tree is a single rollout: play it as one.
    tree = cfg.workflow.sampling == "tree" and G > 1
    runtime = Runtime(cfg, task, generate, act, tokenizers, tree=step_rewards if tree else None)
    ctxs = [Context(runtime, i) for i in range(1 if tree else G)]
    t0 = time.monotonic()

    timeout_s = cfg.workflow.step_timeout_s

    async def rollout(ctx: Context) -> Any:
        try:
            async with asyncio.timeout(timeout_s) as limit:
                return await workflow(ctx, task)
        except TimeoutError:
            if not limit.expired():  # the workflow's own TimeoutError
                raise
            raise WorkflowTimeout(f"workflow {name_of(workflow)} did not return within workflow.step_timeout_s "
                                  f"{timeout_s:g}s (rollout {ctx.rollout} of task {task.task_id}); it was "
                                  "cancelled") from None
        finally:
            runtime.batcher.finish(ctx.rollout)

    tasks = [asyncio.create_task(rollout(c)) for c in ctxs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            exc = t.exception() if t.done() and not t.cancelled() else None
            if isinstance(exc, Abandon | ValueError):
                raise exc
            if exc is not None:
                raise WorkflowError(f"workflow {name_of(workflow)} failed: {type(exc).__name__}: {exc}") from exc
        results = [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runtime.batcher.close()
    seconds = time.monotonic() - t0
    trajectories = [checked(r, i, name_of(workflow)) for i, r in enumerate(results)]
    if tree:
        ep = tree_episode(cfg, task, env_idx, trajectories[0], ctxs[0], dict(versions()), seconds)
    else:
        ep = to_episode(cfg, task, env_idx, trajectories, ctxs, dict(versions()), seconds)
    if cfg.train.grouping == "episode" and not cfg.marft_on:  # MARFT's advantages are the critic's GAE
        with_advantages(ep.samples, cfg.train.advantage, by_env=cfg.train.advantage_group == "env")
    ep.tokens_generated = runtime.tokens_generated
    return ep


async def step_rewards(ctx: Context, task: Task, texts: list[str], finished: list[bool]) -> list[float]:
    """Tree sampling's score of each candidate of a step: the task's check (or the judge), in [0, 1]."""
    return [s.reward for s in await check(ctx, task, texts, finished)]


def with_advantages(samples: list[Sample], estimator: str = "grpo", *, by_env: bool = False) -> None:
    """Episode-complete dispatch: set every sample's advantage within its (env, agent, turn) group, or with
    ``by_env`` (plain GRPO) within its env, every agent and turn of the task together (a group estimator;
    reinforce_pp's are the trainer's, over its global batch)."""
    if estimator not in GROUP_ESTIMATORS:
        return
    keys = [s.env_idx if by_env else s.group_key for s in samples]
    adv = estimate([s.reward for s in samples], keys, estimator)
    for s, a in zip(samples, adv, strict=True):
        s.advantage = float(a)


def name_of(workflow: Workflow) -> str:
    return getattr(workflow, "__qualname__", None) or repr(workflow)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkflowError(f"{what}: expected a finite number, got {value!r}")
    return float(value)


def checked(result: Any, rollout: int, name: str) -> dict[str, Any]:
    """``result`` if it is a MARTI trajectory (turns with an agent and an output, numeric rewards), else a
    WorkflowError that says what is wrong."""
    where = f"workflow {name} (rollout {rollout})"
    if not isinstance(result, dict) or not isinstance(result.get("trajectory"), list):
        raise WorkflowError(f"{where} returned {type(result).__name__}: expected a dict with a 'trajectory' "
                            "list of turns, 'prompt', 'label' and 'final_reward'")
    result["final_reward"] = _number(result.get("final_reward", 0.0), f"{where}: final_reward")
    for i, turn in enumerate(result["trajectory"]):
        if not isinstance(turn, dict) or any(not isinstance(turn.get(k), str) for k in TURN_KEYS):
            raise WorkflowError(f"{where}: trajectory[{i}] needs string {' and '.join(TURN_KEYS)}, got {turn!r:.200}")
        turn.setdefault("turn_id", i)
        if isinstance(turn["turn_id"], bool) or not isinstance(turn["turn_id"], int) or turn["turn_id"] < 0:
            raise WorkflowError(f"{where}: trajectory[{i}].turn_id must be an int >= 0, got {turn['turn_id']!r}")
        if not isinstance(turn.setdefault("metadata", {}), dict):
            raise WorkflowError(f"{where}: trajectory[{i}].metadata must be a dict")
        for key in ("reward", "agent_reward"):  # MARTI's listing 2 names it agent_reward
            if key in turn:
                turn[key] = _number(turn[key], f"{where}: trajectory[{i}].{key}")
    ids = [t["turn_id"] for t in result["trajectory"]]
    if len(set(ids)) != len(ids):
        raise WorkflowError(f"{where}: turn_id values repeat ({ids}): each turn needs its own")
    return result


def generation_of(turn: Turn, ctx: Context, used: set[int]) -> GenResult | None:
    """The generation a turn came from: ``metadata.gen_id`` when given, else this rollout's first unused
    generation of the same agent with exactly that output."""
    gen_id = turn["metadata"].get("gen_id")
    if isinstance(gen_id, int) and 0 <= gen_id < len(ctx.generations):
        row = ctx.generations[gen_id]
        if row.agent != turn["agent_name"]:
            raise WorkflowError(f"turn {turn['turn_id']} of {turn['agent_name']!r} names gen_id {gen_id}, "
                                f"which {row.agent!r} generated")
        return row
    for row in ctx.generations:
        if row.gen_id not in used and row.agent == turn["agent_name"] and row.text == turn["agent_output"]:
            return row
    return None


def turn_rewards(cfg: ChorusConfig, trajectory: dict[str, Any]) -> dict[int, float]:
    """turn_id -> reward: the turn's own (``reward`` / ``agent_reward``), else the final reward; then MARTI
    shaping over each agent's turns in order when ``reward.shaping`` is set."""
    raw: dict[int, float] = {}
    for t in trajectory["trajectory"]:
        raw[t["turn_id"]] = t.get("reward", t.get("agent_reward", trajectory["final_reward"]))
    rc = cfg.reward
    if rc.shaping == "none":
        return raw
    by_agent: dict[str, list[int]] = {}
    for t in sorted(trajectory["trajectory"], key=lambda t: t["turn_id"]):
        by_agent.setdefault(t["agent_name"], []).append(t["turn_id"])
    out = dict(raw)
    for ids in by_agent.values():
        for tid, value in zip(ids, shape([raw[i] for i in ids], rc.shaping, rc.scope, rc.alpha), strict=True):
            out[tid] = value
    return out


def known_agent(cfg: ChorusConfig, turn: Turn) -> str:
    agent = turn["agent_name"]
    if agent not in cfg.agents:
        raise WorkflowError(f"trajectory turn {turn['turn_id']} names unknown agent {agent!r}: expected one of "
                            f"{sorted(cfg.agents)}")
    return agent


def make_sample(cfg: ChorusConfig, task: Task, env_idx: int, agent: str, turn: int, index: int, rollout: int,
                row: GenResult, reward: float, snapshot: dict[str, int], seconds: float) -> Sample:
    """The Sample of ``row``: member ``index`` (rollout or tree candidate) of group (task, agent, turn)."""
    a = cfg.agents[agent]
    return Sample(
        run=cfg.run.id,
        episode=f"{task.task_id}/{rollout}",
        sample_id=Sample.make_id(task.task_id, turn, index),
        env_idx=env_idx,
        rollout_idx=index,
        agent=agent,
        model=a.model,
        adapter=a.adapter,
        turn=turn,
        prompt_ids=Array.of(row.prompt_ids, "int32"),
        response_ids=Array.of(row.ids, "int32"),
        behavior_logprobs=Array.of(row.logprobs, "float32"),
        reward=reward,
        truncated=not row.finished,
        group_key=f"{task.task_id}:{agent}:{turn}",
        group_size=cfg.workflow.group_size,
        version=row.version,
        token_versions=None if row.token_versions is None else Array.of(row.token_versions, "int32"),
        versions=snapshot,
        timings={"gen_s": row.seconds, "episode_s": seconds},
    )


def to_episode(cfg: ChorusConfig, task: Task, env_idx: int, trajectories: list[dict[str, Any]],
               ctxs: list[Context], snapshot: dict[str, int], seconds: float) -> Episode:
    G = cfg.workflow.group_size
    candidates: dict[tuple[str, int], list[Sample]] = {}
    untrained = 0
    errors: list[str] = []
    for i, (traj, ctx) in enumerate(zip(trajectories, ctxs, strict=True)):
        rewards = turn_rewards(cfg, traj)
        used: set[int] = set()
        for turn in traj["trajectory"]:
            agent, tid = known_agent(cfg, turn), turn["turn_id"]
            row = generation_of(turn, ctx, used)
            if row is None:
                untrained += 1
                continue
            used.add(row.gen_id)
            error = turn["metadata"].get("reward_error")
            if error:  # the reward function failed on it: no reward to train on (its group is then short)
                errors.append(str(error))
                continue
            candidates.setdefault((agent, tid), []).append(
                make_sample(cfg, task, env_idx, agent, tid, i, i, row, rewards[tid], snapshot, seconds))
    samples: list[Sample] = []
    dropped = 0
    for _, group in sorted(candidates.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(group) == G:
            samples.extend(group)
        elif cfg.marft_on:  # MARFT needs no groups: a turn that only some rollouts reached is kept, in a smaller one
            for s in group:
                s.group_size = len(group)
            samples.extend(group)
        else:
            dropped += 1
    ep = _episode(task, samples, trajectories, dropped, untrained, seconds)
    ep.reward_errors = errors
    return ep


def tree_episode(cfg: ChorusConfig, task: Task, env_idx: int, trajectory: dict[str, Any], ctx: Context,
                 snapshot: dict[str, int], seconds: float) -> Episode:
    """The samples of one tree-sampled rollout: for every turn whose generation was a tree step, the step's G
    candidates as one group, each rewarded by its own step score (shaped over the agent's kept path)."""
    steps: list[tuple[Turn, TreeStep]] = []
    untrained = 0
    used: set[int] = set()
    for turn in trajectory["trajectory"]:
        known_agent(cfg, turn)
        row = generation_of(turn, ctx, used)
        step = None if row is None else ctx.tree_steps.get(row.gen_id)
        if row is None or step is None:  # scripted text, a tool turn, or a judge's (never tree-sampled) row
            untrained += 1
            continue
        used.add(row.gen_id)
        steps.append((turn, step))
    steps.sort(key=lambda ts: (ts[0]["turn_id"], ts[0]["agent_name"]))
    samples: list[Sample] = []
    for (turn, step), rewards in zip(steps, tree_rewards(cfg, steps), strict=True):
        agent, tid = turn["agent_name"], turn["turn_id"]
        samples.extend(make_sample(cfg, task, env_idx, agent, tid, c, 0, row, reward, snapshot, seconds)
                       for c, (row, reward) in enumerate(zip(step.candidates, rewards, strict=True)))
    return _episode(task, samples, [trajectory], 0, untrained, seconds)


def tree_rewards(cfg: ChorusConfig, steps: list[tuple[Turn, TreeStep]]) -> list[list[float]]:
    """Each step's candidate rewards: the step scores, with MARTI shaping (when set) against the same history
    for every candidate, the agent's earlier kept steps. ``steps`` in turn order."""
    rc = cfg.reward
    path: dict[str, list[float]] = {}
    out = []
    for turn, step in steps:
        history = path.setdefault(turn["agent_name"], [])
        if rc.shaping == "none":
            out.append(list(step.rewards))
        else:
            out.append([shape([*history, r], rc.shaping, rc.scope, rc.alpha)[-1] for r in step.rewards])
        history.append(step.rewards[step.best])
    return out


def _episode(task: Task, samples: list[Sample], trajectories: list[dict[str, Any]], dropped: int,
             untrained: int, seconds: float) -> Episode:
    agent_rewards: dict[str, list[float]] = {}
    for s in samples:
        agent_rewards.setdefault(s.agent, []).append(s.reward)
    finals = [t["final_reward"] for t in trajectories]
    return Episode(task=task, samples=samples, rewards=agent_rewards, final_correct=[f >= 1.0 for f in finals],
                   final_rewards=finals, trajectories=trajectories, dropped_groups=dropped,
                   untrained_turns=untrained, seconds=seconds)
