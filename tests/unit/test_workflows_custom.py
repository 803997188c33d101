"""User workflows: the shipped example played over a scripted policy, loading by path with clear errors,
MARTI trajectories turned into samples (matching, whole groups only, bad returns), the LLM judge and the
workflow section of the config."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.coordinator.tasks import Task
from services.coordinator.workflows import GenResult, WorkflowError, run_episode, workflow_of
from services.coordinator.workflows.api import Batcher
from services.coordinator.workflows.loader import load_workflow_function
from shared.kernel.config import ChorusConfig, ConfigError, config_from_yaml_text, load_config
from tests.conftest import ROOT
from tests.unit.test_workflows_builtin import ARITH, TOK, Actions, Script

EXAMPLE = ROOT / "examples" / "my_workflow.py"


def custom_config(function: str, agents: dict[str, str] | None = None, group_size: int = 2,
                  **sections: Any) -> ChorusConfig:
    agents = agents or {"solver": "m1", "critic": "m2"}
    data = {
        "run": {"id": "wf"},
        "models": {m: {} for m in sorted(set(agents.values()))},
        "agents": {a: {"model": m, "prompt": f"<{a}>"} for a, m in agents.items()},
        "workflow": {"name": "custom", "function": function, "agents": list(agents), "group_size": group_size},
        "train": {"global_batch": group_size * 2},
        "reward": {"partial_credit": True},  # the shipped arithmetic configs' shaping
        **sections,
    }
    return ChorusConfig(**yaml.safe_load(yaml.safe_dump(data)))


def write(tmp_path: Path, source: str, name: str = "wf.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


async def play(cfg: ChorusConfig, policy: Script, acts: Actions | None = None, task: Task = ARITH):
    return await run_episode(cfg, task, 0, workflow_of(cfg), policy, acts or Actions(), lambda: {"m1": 1, "m2": 2},
                             {m: TOK for m in cfg.models})


# --- the shipped example -------------------------------------------------------------------------------------
async def test_the_critique_example_drafts_reviews_and_revises_with_per_turn_rewards():
    cfg = custom_config(f"{EXAMPLE}:critique", group_size=3)
    policy = Script({"solver": lambda u: "5" if "critic:" not in u else "7",
                     "critic": lambda u: "too low"},
                    versions={"m1": 1, "m2": 2})
    acts = Actions()
    ep = await play(cfg, policy, acts)

    traj = ep.trajectories[0]["trajectory"]
    assert [(t["turn_id"], t["agent_name"], t["agent_role"]) for t in traj] == [
        (0, "solver", "solver"), (1, "critic", "critic"), (2, "solver", "reviser")]
    assert policy.seen["critic"] == ["3+4=\nanswer: 5\n"] * 3
    assert policy.seen["solver"][3:] == ["3+4=\nanswer: 5\ncritic: too low\n"] * 3
    # The draft "5" is 2 off (0.4); the revision is right, and the critic shares that reward.
    assert {(s.agent, s.turn): s.reward for s in ep.samples} == pytest.approx(
        {("solver", 0): 0.4, ("critic", 1): 1.0, ("solver", 2): 1.0})
    assert sorted({s.group_key for s in ep.samples}) == ["t-1:critic:1", "t-1:solver:0", "t-1:solver:2"]
    assert sorted(s.sample_id for s in ep.samples if s.turn == 2) == ["t-1_2_0", "t-1_2_1", "t-1_2_2"]
    assert {(s.agent, s.model, s.version) for s in ep.samples} == {("solver", "m1", 1), ("critic", "m2", 2)}
    assert ep.final_correct == [True] * 3 and ep.rewards["critic"] == [1.0] * 3
    # Three generation requests (draft, review, revision) and one check, each for all three rollouts.
    assert [len(c["texts"]) for c in policy.calls] == [3, 3, 3]
    assert [(k, len(p)) for k, p in acts.calls] == [("check_answer", 6)]


def test_the_shipped_custom_config_resolves_the_example_next_to_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative to the config file, not the working directory
    cfg = load_config(ROOT / "configs" / "custom-workflow.yaml")
    assert cfg.workflow.function == f"{EXAMPLE.resolve()}:critique"
    assert cfg.workflow.agents == ["solver", "critic"]
    assert workflow_of(cfg).__name__ == "critique"
    # The run's copy of the config (services read it from runs/<id>/) still finds the file.
    assert config_from_yaml_text(cfg.dump_yaml()).workflow.function == cfg.workflow.function


def test_a_relative_function_is_found_in_the_working_directory(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "flows").mkdir()
    write(tmp_path / "flows", "async def solo(ctx, task):\n    return {}\n")
    monkeypatch.chdir(tmp_path)
    cfg = custom_config("flows/wf.py:solo")
    assert cfg.workflow.function == f"{(tmp_path / 'flows' / 'wf.py').resolve()}:solo"
    assert workflow_of(cfg).__name__ == "solo"


# --- loading errors ------------------------------------------------------------------------------------------
def test_loading_a_missing_file_names_the_key_and_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"workflow\.function: file 'nope\.py' not found \(looked at .*nope\.py"):
        load_workflow_function("nope.py:critique", [tmp_path])


@pytest.mark.parametrize(("source", "spec_name", "message"), [
    ("async def critique(ctx, task):\n    return {}\n", "critic", r"has no function 'critic'.*\['critique'\]"),
    ("def critique(ctx, task):\n    return {}\n", "critique", r"must be an `async def \(ctx, task\)`"),
    ("async def critique(ctx):\n    return {}\n", "critique", r"must take \(ctx, task\)"),
    ("async def critique(ctx, task)\n", "critique", r"importing .* failed: SyntaxError"),
    ("import no_such_module_here\n", "critique", r"importing .* failed: ModuleNotFoundError"),
])
def test_a_bad_user_file_is_a_config_error(tmp_path: Path, source: str, spec_name: str, message: str) -> None:
    path = write(tmp_path, source)
    with pytest.raises(ConfigError, match=message):
        load_workflow_function(f"{path}:{spec_name}")


def test_the_user_file_is_imported_by_path_not_from_the_package(tmp_path: Path) -> None:
    a = write(tmp_path, "NAME = 'first'\nasync def f(ctx, task):\n    return NAME\n", "tasks.py")
    (tmp_path / "b").mkdir()
    b = write(tmp_path / "b", "NAME = 'second'\nasync def f(ctx, task):\n    return NAME\n", "tasks.py")
    fa, fb = load_workflow_function(f"{a}:f"), load_workflow_function(f"{b}:f")
    assert asyncio.run(fa(None, None)) == "first" and asyncio.run(fb(None, None)) == "second"  # type: ignore[arg-type]
    assert fa.__module__ != "services.coordinator.tasks" and fa.__module__ != fb.__module__


# --- trajectories to samples ---------------------------------------------------------------------------------
SOLO = '''
async def solo(ctx, task):
    (row,) = await ctx.generate("solver", [task.question])
    turns = [{"agent_name": "solver", "agent_role": "solver", "agent_input": task.question,
              "agent_output": row.text, "metadata": {}},
             {"agent_name": "critic", "agent_role": "note", "agent_input": "", "agent_output": "a scripted remark",
              "metadata": {}}]
    if ctx.rollout == 0:  # only one rollout takes an extra turn: its group can never be whole
        (more,) = await ctx.generate("solver", ["again " + task.question])
        turns.append({"turn_id": 5, "agent_name": "solver", "agent_role": "solver", "agent_input": "again",
                      "agent_output": more.text, "metadata": {"gen_id": more.gen_id}, "reward": 0.5})
    return {"prompt": task.question, "label": task.answer, "trajectory": turns, "final_reward": 0.25}
'''


async def test_turns_match_generations_by_output_incomplete_groups_and_scripted_turns_are_not_trained(
        tmp_path: Path) -> None:
    cfg = custom_config(f"{write(tmp_path, SOLO)}:solo", group_size=3)
    ep = await play(cfg, Script({"solver": lambda u: "7"}))
    # Turn 0 found its generation by agent and text; without its own reward it takes final_reward.
    assert sorted(s.sample_id for s in ep.samples) == ["t-1_0_0", "t-1_0_1", "t-1_0_2"]
    assert {s.reward for s in ep.samples} == {0.25}
    assert ep.samples[0].prompt_ids.tolist() == TOK.chat("<solver>", "3+4=")
    assert ep.untrained_turns == 3  # the critic's remark was never generated
    assert ep.dropped_groups == 1  # turn 5 exists in rollout 0 only
    assert ep.final_correct == [False] * 3


@pytest.mark.parametrize(("body", "message"), [
    ("return [1, 2]", r"returned list: expected a dict with a 'trajectory' list"),
    ("return {'trajectory': [{'agent_name': 'solver'}], 'final_reward': 1}", r"trajectory\[0\] needs string"),
    ("return {'trajectory': [], 'final_reward': 'high'}", r"final_reward: expected a finite number"),
    ("return {'trajectory': [{'agent_name': 'ghost', 'agent_output': 'x'}], 'final_reward': 0}",
     r"unknown agent 'ghost'"),
    ("return {'trajectory': [{'agent_name': 'solver', 'agent_output': 'x', 'turn_id': 1}, "
     "{'agent_name': 'solver', 'agent_output': 'y', 'turn_id': 1}], 'final_reward': 0}", r"turn_id values repeat"),
    ("raise KeyError('oops')", r"workflow bad failed: KeyError: 'oops'"),
    ("await ctx.generate('nobody', ['x'])", r"unknown agent 'nobody'"),
])
async def test_a_bad_trajectory_or_a_failing_workflow_is_a_workflow_error(tmp_path: Path, body: str,
                                                                          message: str) -> None:
    path = write(tmp_path, "async def bad(ctx, task):\n    " + body + "\n")
    cfg = custom_config(f"{path}:bad")
    with pytest.raises(WorkflowError, match=message):
        await play(cfg, Script({"solver": lambda u: "7"}))


async def test_a_failing_rollout_cancels_the_others_instead_of_leaving_them_waiting(tmp_path: Path) -> None:
    cancelled = tmp_path / "cancelled"
    source = ("import asyncio\nasync def half(ctx, task):\n    if ctx.rollout == 1:\n        raise RuntimeError('x')\n"
              "    try:\n        await asyncio.sleep(3600)\n    except asyncio.CancelledError:\n"
              f"        open({str(cancelled)!r}, 'w').close()\n        raise\n")
    cfg = custom_config(f"{write(tmp_path, source)}:half")
    with pytest.raises(WorkflowError, match="RuntimeError"):
        await asyncio.wait_for(play(cfg, Script({})), 300)  # left waiting, it would sleep for an hour
    assert cancelled.exists()  # the other rollout was cancelled, not awaited


# --- the judge -----------------------------------------------------------------------------------------------
async def test_a_judge_agent_scores_every_turn_and_is_not_trained():
    cfg = ChorusConfig(**yaml.safe_load("""
run: {id: wf}
models: {m1: {}}
agents: {a: {model: m1, prompt: "<a>"}, b: {model: m1, prompt: "<b>"}, j: {model: m1, prompt: "<j>"}}
workflow: {name: debate, agents: [a, b], rounds: 1, group_size: 2}
train: {global_batch: 4}
reward: {judge: j}
"""))
    policy = Script({"a": lambda u: "7", "b": lambda u: "3",
                     "j": lambda u: "Score: 9/10" if "Answer: 7" in u else "Score: 2/10"})
    acts = Actions()
    ep = await run_episode(cfg, ARITH, 0, workflow_of(cfg), policy, acts, dict)
    assert {(s.agent, s.reward) for s in ep.samples} == {("a", 0.9), ("b", 0.2)}
    assert "Question: 3+4=" in policy.seen["j"][0]
    assert acts.calls == []  # no rule-based check ran


# --- the batcher ---------------------------------------------------------------------------------------------
async def test_a_batch_waits_for_every_rollout_but_not_for_one_busy_elsewhere():
    batcher = Batcher(3, window_s=0.05)
    sizes: list[int] = []

    async def run(items: list[Any]) -> list[Any]:
        sizes.append(len(items))
        return [i * 10 for i in items]

    async def rollout(r: int, delay: float) -> list[Any]:
        await asyncio.sleep(delay)
        try:
            return await batcher.call(r, "k", [r], run)
        finally:
            batcher.finish(r)

    assert await asyncio.gather(rollout(0, 0), rollout(1, 0), rollout(2, 0)) == [[0], [10], [20]]
    assert sizes == [3]
    await asyncio.gather(*(rollout(r, 0) for r in (0, 1)), rollout(2, 0.5))
    # Rollouts 0 and 1 went out after the window together instead of waiting for 2's sleep; 2 went alone.
    assert sizes[1:] == [2, 1]


# --- the workflow section of the config ----------------------------------------------------------------------
BASE = {"run": {"id": "c"}, "models": {"m": {}},
        "agents": {"a": {"model": "m"}, "b": {"model": "m"}, "c": {"model": "m"}, "solver": {"model": "m"},
                   "verifier": {"model": "m"}}}


@pytest.mark.parametrize(("workflow", "message"), [
    ({"name": "custom"}, r"workflow\.function: required when workflow\.name is 'custom'"),
    ({"name": "custom", "function": "flow.py"}, r"workflow\.function: expected 'path/to/file\.py:function_name'"),
    ({"name": "debate", "agents": ["a", "b"], "function": "x.py:f"}, r"workflow\.function: only read when"),
    ({"name": "solver_coder_refiner", "agents": ["a", "b"]}, r"workflow\.agents: solver_coder_refiner takes "
                                                             r"exactly 3 agents, got 2"),
    ({"name": "mixture", "agents": ["a"]}, r"workflow\.agents: mixture takes at least 2 agents, got 1"),
    ({"name": "debate", "agents": []}, r"workflow\.agents: debate takes at least 2 agents, got 0"),
    ({"name": "debate", "agents": ["a", "a"]}, r"debate agents must be distinct"),
    ({"name": "chain", "agents": ["a", "zz"]}, r"workflow\.agents\[1\]: agent 'zz' is not one of agents"),
    ({"name": "solver_coder_refiner", "agents": ["a", "b", "c"], "rounds": 2}, r"workflow\.rounds: .* one round"),
    ({"name": "solve_verify", "agents": ["a", "b"]}, r"workflow\.agents: solve_verify takes its agents from"),
    ({"name": "quorum"}, r"workflow\.name: Input should be"),
])
def test_workflow_config_errors_name_the_key(tmp_path: Path, workflow: dict[str, Any], message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**BASE, "workflow": workflow}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_participants_default_per_workflow(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert load_config(path).workflow.agents == ["solver", "verifier"]  # solve_verify: its two roles
    write(tmp_path, "async def f(ctx, task):\n    return {}\n")
    path.write_text(yaml.safe_dump({**BASE, "workflow": {"name": "custom", "function": "wf.py:f"}}))
    cfg = load_config(path)
    assert cfg.workflow.agents == ["a", "b", "c", "solver", "verifier"]  # custom: every agent, in order
    assert cfg.workflow.function == f"{(tmp_path / 'wf.py').resolve()}:f"
    assert os.path.isabs(cfg.workflow.function.rsplit(":", 1)[0])


async def test_token_id_prompts_go_unchanged_and_stop_strings_and_sampling_reach_the_request(tmp_path: Path) -> None:
    source = ("async def ids(ctx, task):\n"
              "    (row,) = await ctx.generate('solver', [[257, 51, 43]], stop=['\\n'], temperature=0.0)\n"
              "    return {'trajectory': [{'agent_name': 'solver', 'agent_output': row.text,\n"
              "                            'metadata': {'gen_id': row.gen_id}}], 'final_reward': 1.0}\n")
    cfg = custom_config(f"{write(tmp_path, source)}:ids")
    requests: list[dict[str, Any]] = []

    async def generate(model: str, adapter: str | None, prompts: list[list[int]], **kw: Any) -> list[Any]:
        requests.append({"prompts": prompts, **kw})
        return [GenResult(ids=[55, 258], logprobs=[-1.0, -0.5], finished=True, version=0) for _ in prompts]

    ep = await run_episode(cfg, ARITH, 0, workflow_of(cfg), generate, Actions(), dict, {"m1": TOK, "m2": TOK})
    assert requests == [{"prompts": [[257, 51, 43]] * 2, "max_new_tokens": cfg.workflow.max_new_tokens,
                         "temperature": 0.0, "top_p": 1.0, "stop": ["\n"]}]
    assert [s.prompt_ids.tolist() for s in ep.samples] == [[257, 51, 43]] * 2
    assert ep.trajectories[0]["trajectory"][0]["agent_output"] == "7"
