"""AT-GRPO on hand-computed examples: advantages per (env, agent, turn) group set at episode completion,
tree-structured sampling (best-of-N per agent step, the episode goes on from the best), and the trainer using a
given advantage or computing one within its micro-batch."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from services.actions.actions import score_answer
from services.coordinator.tasks import Task
from services.coordinator.workflows import (
    BUILTIN,
    Context,
    Episode,
    GenResult,
    Trajectory,
    Turn,
    run_episode,
    workflow_of,
)
from services.coordinator.workflows.api import best_of
from services.trainer.advantages import micro_batch_advantages
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Array, Sample
from shared.models.tokenizer import EOS_ID, ByteTokenizer
from shared.rlmath.advantages import group_advantages as np_group_advantages
from tests.conftest import ROOT
from tests.unit.test_workflows_builtin import ARITH, Actions, Script

TOK = ByteTokenizer()


def grpo_adv(rewards: Any, keys: list[Any]) -> torch.Tensor:
    return torch.from_numpy(np_group_advantages(rewards, keys)).to(torch.float32)
R2 = math.sqrt(2)  # a group of three with two equal rewards normalises to (1/sqrt2, 1/sqrt2, -sqrt2)
R32 = math.sqrt(1.5)  # (1, 0, 0.5) normalises to (sqrt1.5, -sqrt1.5, 0)


def config(workflow: dict[str, Any], agents: dict[str, str], group_size: int = 3, **sections: Any) -> ChorusConfig:
    """Agents on m1 (base) or m2 (LoRA, one adapter per agent); each agent's system prompt is ``<name>``."""
    data = {
        "run": {"id": "at"},
        "models": {"m1": {}, **({"m2": {"lora": {"r": 2}}} if "m2" in agents.values() else {})},
        "agents": {a: {"model": m, "prompt": f"<{a}>", **({"adapter": f"{a}x"} if m == "m2" else {})}
                   for a, m in agents.items()},
        "workflow": {"group_size": group_size, "max_new_tokens": 8, **workflow},
        "train": {"global_batch": group_size * 4, **sections.pop("train", {})},
        "reward": {"partial_credit": True, **sections.pop("reward", {})},  # the shipped arithmetic configs' shaping
        **sections,
    }
    return ChorusConfig(**yaml.safe_load(yaml.safe_dump(data)))


def by_member(ep: Episode) -> dict[tuple[str, int, int], Sample]:
    """(agent, turn, rollout or candidate) -> sample."""
    return {(s.agent, s.turn, s.rollout_idx): s for s in ep.samples}


# --- (a) grouping by (env, agent, turn) at episode completion ------------------------------------------------
# Given turn rewards of a 2-agent x 2-turn episode, per turn (a, b, a, b) and rollout 0..2.
GIVEN = {0: [1.0, 0.0, 0.5], 1: [0.0, 0.0, 1.0], 2: [1.0, 1.0, 0.0], 3: [0.5, 0.5, 0.5]}
AGENT_OF = {0: "a", 1: "b", 2: "a", 3: "b"}


async def given_rewards(ctx: Context, task: Task) -> Trajectory:
    """a, b, a, b; each turn earns its GIVEN reward for this rollout."""
    turns = []
    for tid, agent in AGENT_OF.items():
        (row,) = await ctx.generate(agent, [f"{task.question}{tid}"])
        turns.append(Turn(turn_id=tid, agent_index=0, agent_name=agent, agent_role=agent, agent_input=task.question,
                          agent_output=row.text, metadata={"gen_id": row.gen_id}, reward=GIVEN[tid][ctx.rollout]))
    return Trajectory(prompt=task.question, label=task.answer, trajectory=turns, final_reward=GIVEN[3][ctx.rollout])


async def test_episode_grouping_sets_advantages_per_env_agent_and_turn():
    cfg = config({"name": "chain", "agents": ["a", "b"], "rounds": 2}, {"a": "m1", "b": "m2"})
    ep = await run_episode(cfg, ARITH, 4, given_rewards, Script({"a": lambda u: "1", "b": lambda u: "2"}),
                           Actions(), dict)
    got = {(tid, i): by_member(ep)[(AGENT_OF[tid], tid, i)].advantage for tid in GIVEN for i in range(3)}
    # Hand-computed A_i = (r_i - mean) / std, population std, within each (env, agent, turn) group:
    expected = {
        0: [R32, -R32, 0.0],  # a, turn 0: mean .5, std sqrt(1/6)
        1: [-1 / R2, -1 / R2, R2],  # b, turn 1: mean 1/3, std sqrt(2/9)
        2: [1 / R2, 1 / R2, -R2],  # a, turn 2: mean 2/3, std sqrt(2/9)
        3: [0.0, 0.0, 0.0],  # b, turn 3: equal rewards carry no signal
    }
    assert got == {(t, i): pytest.approx(expected[t][i], rel=1e-4, abs=1e-9) for t in GIVEN for i in range(3)}
    assert sorted({s.group_key for s in ep.samples}) == ["t-1:a:0", "t-1:a:2", "t-1:b:1", "t-1:b:3"]

    # Plain GRPO groups by env only: all 12 rewards, mean .5, std sqrt(1/6) -> +-sqrt(1.5) or 0. Agent b's
    # right answer at turn 1 gets sqrt(1.5) there and sqrt(2) under AT-GRPO; its constant turn 3 stays 0 in both.
    rewards = [GIVEN[t][i] for t in GIVEN for i in range(3)]
    per_env = grpo_adv(rewards, ["env4"] * 12).view(4, 3)
    assert per_env[1].tolist() == pytest.approx([-R32, -R32, R32], rel=1e-4)
    assert per_env[2].tolist() == pytest.approx([R32, R32, -R32], rel=1e-4)
    # Grouping by (env, agent) only mixes a's turns 0 and 2: a different answer again.
    per_agent = grpo_adv(rewards, [AGENT_OF[t] for t in GIVEN for _ in range(3)]).view(4, 3)
    assert not torch.allclose(per_agent[0], torch.tensor(expected[0]), atol=1e-3)
    assert not torch.allclose(per_agent[1], torch.tensor(expected[1]), atol=1e-3)


async def test_env_advantage_group_is_plain_grpo_over_every_agent_and_turn_of_the_task():
    cfg = config({"name": "chain", "agents": ["a", "b"], "rounds": 2}, {"a": "m1", "b": "m2"},
                 train={"advantage_group": "env"})
    ep = await run_episode(cfg, ARITH, 4, given_rewards, Script({"a": lambda u: "1", "b": lambda u: "2"}),
                           Actions(), dict)
    got = {(tid, i): by_member(ep)[(AGENT_OF[tid], tid, i)].advantage for tid in GIVEN for i in range(3)}
    # all 12 rewards one group: mean .5, population std sqrt(1/6): +-sqrt(1.5) or 0 (hand-computed)
    expected = {0: [R32, -R32, 0.0], 1: [-R32, -R32, R32], 2: [R32, R32, -R32], 3: [0.0, 0.0, 0.0]}
    assert got == {(t, i): pytest.approx(expected[t][i], rel=1e-4, abs=1e-9) for t in GIVEN for i in range(3)}
    # dispatch is still by AT-GRPO group: mq sends whole (env, agent, turn) groups
    assert sorted({s.group_key for s in ep.samples}) == ["t-1:a:0", "t-1:a:2", "t-1:b:1", "t-1:b:3"]


@pytest.mark.parametrize("train", [{"grouping": "trainer"}, {"advantage": "reinforce_pp"}, {"loss": "marft"}])
def test_env_advantage_group_needs_the_coordinators_group_advantages(train: dict[str, Any]):
    with pytest.raises(ValueError, match="advantage_group: env"):
        config({"name": "chain", "agents": ["a", "b"]}, {"a": "m1", "b": "m1"},
               train={"advantage_group": "env", **train})


async def test_trainer_grouping_leaves_advantages_to_the_trainer():
    cfg = config({"name": "chain", "agents": ["a", "b"], "rounds": 2}, {"a": "m1", "b": "m1"},
                 train={"grouping": "trainer"})
    ep = await run_episode(cfg, ARITH, 0, given_rewards, Script({"a": lambda u: "1", "b": lambda u: "2"}),
                           Actions(), dict)
    assert len(ep.samples) == 12 and all(s.advantage is None for s in ep.samples)


# --- (b) tree-structured sampling ----------------------------------------------------------------------------
class Candidates(Script):
    """A scripted policy whose k-th copy of a prompt within one request answers ``rules[agent](user, k)``."""

    def __init__(self, rules: dict[str, Callable[[str, int], str]]) -> None:
        super().__init__({})
        self.candidate_rules = rules

    async def __call__(self, model: str, adapter: str | None, prompts: list[list[int]], *, max_new_tokens: int,
                       temperature: float, top_p: float) -> list[GenResult]:
        texts = [TOK.decode(p) for p in prompts]
        self.calls.append({"model": model, "adapter": adapter, "texts": texts})
        copies: Counter[str] = Counter()
        rows = []
        for text in texts:
            agent = re.match(r"<(\w+)>", text)
            assert agent is not None, f"prompt without a system prompt: {text!r}"
            user = text[agent.end():]
            self.seen[agent[1]].append(user)
            ids = TOK.encode(self.candidate_rules[agent[1]](user, copies[text]), bos=False) + [EOS_ID]
            copies[text] += 1
            rows.append(GenResult(ids=ids, logprobs=[-0.25] * len(ids), finished=True, version=self.versions[model]))
        return rows


def pick(*answers: str) -> Callable[[str, int], str]:
    return lambda user, k: answers[k % len(answers)]


async def test_tree_sampling_on_solve_verify_continues_from_the_best_candidate():
    cfg = config({"sampling": "tree"}, {"solver": "m1", "verifier": "m2"})
    # 3+4=7. Solver: "5" and "9" are both 2 off (0.4), "3" is 4 off (0.3): a tie, the lowest index wins.
    # Verifier: "6" is 1 off (0.45), "7" and "7!" are right (1.0): again a tie, candidate 1 wins.
    policy = Candidates({"solver": pick("5", "9", "3"), "verifier": pick("6", "7", "7!")})
    acts = Actions()
    ep = await run_episode(cfg, ARITH, 4, BUILTIN["solve_verify"], policy, acts, lambda: {"m1": 3, "m2": 5})

    # One rollouter request per step, holding the 3 candidates; the verifier saw only the kept solver answer.
    assert [(c["model"], c["texts"]) for c in policy.calls] == [
        ("m1", ["<solver>3+4="] * 3), ("m2", ["<verifier>3+4=5|"] * 3)]
    traj = ep.trajectories
    assert len(traj) == 1 and [t["agent_output"] for t in traj[0]["trajectory"]] == ["5", "7"]
    assert ep.final_correct == [True] and ep.final_rewards == [1.0]

    s = by_member(ep)
    assert sorted(s) == [("solver", 0, c) for c in range(3)] + [("verifier", 1, c) for c in range(3)]
    for (agent, turn, c), sample in s.items():
        assert sample.sample_id == f"t-1_{turn}_{c}" and sample.group_key == f"t-1:{agent}:{turn}"
        assert sample.group_size == 3 and sample.env_idx == 4 and sample.episode == "t-1/0"
        assert TOK.decode(sample.response_ids.tolist()) == {"solver": "593", "verifier": ["6", "7", "7!"]}[agent][c]
    assert {s[("verifier", 1, c)].prompt_ids.tolist() == TOK.encode("<verifier>3+4=5|") for c in range(3)} == {True}
    assert s[("solver", 0, 0)].adapter is None and s[("verifier", 1, 2)].adapter == "verifierx"
    # Every member is rewarded by its own step score; advantages within each step's group, by hand.
    assert [s[("solver", 0, c)].reward for c in range(3)] == pytest.approx([0.4, 0.4, 0.3])
    assert [s[("verifier", 1, c)].reward for c in range(3)] == pytest.approx([0.45, 1.0, 1.0])
    assert [s[("solver", 0, c)].advantage for c in range(3)] == pytest.approx([1 / R2, 1 / R2, -R2], rel=1e-4)
    assert [s[("verifier", 1, c)].advantage for c in range(3)] == pytest.approx([-R2, 1 / R2, 1 / R2], rel=1e-4)
    # Checks: 3 solver candidates, 3 verifier candidates, then the workflow's own check of each kept answer.
    assert sorted(len(p) for _, p in acts.calls) == [1, 1, 3, 3]


async def test_tree_sampling_on_a_chain_hands_the_best_answer_to_the_next_agent():
    cfg = config({"name": "chain", "agents": ["a", "b"], "rounds": 2, "sampling": "tree"},
                 {"a": "m1", "b": "m1"}, group_size=2)
    # Round 0: a offers 3 (0.3) or 6 (0.45) -> 6; b offers 6+0 or 6+1 -> 7. Round 1: a keeps or breaks it.
    policy = Candidates({
        "a": lambda u, k: ("3", "6")[k] if u == "3+4=" else ("7", "1")[k],
        "b": lambda u, k: str(int(re.findall(r"(\d+)\n", u)[-1]) + k),
    })
    ep = await run_episode(cfg, ARITH, 0, BUILTIN["chain"], policy, Actions(), dict)

    assert policy.seen["b"] == ["3+4=\na: 6\n"] * 2 + ["3+4=\na: 7\n"] * 2
    assert policy.seen["a"] == ["3+4="] * 2 + ["3+4=\nb: 7\n"] * 2
    assert [t["agent_output"] for t in ep.trajectories[0]["trajectory"]] == ["6", "7", "7", "7"]
    rewards = {(s.turn, s.rollout_idx): s.reward for s in ep.samples}
    # a's second step: 7 (1.0) or 1 (6 off: 0.2); b's: 7+0 = 7 (1.0) or 7+1 = 8 (0.45).
    assert rewards == pytest.approx({(0, 0): 0.3, (0, 1): 0.45, (1, 0): 0.45, (1, 1): 1.0,
                                     (2, 0): 1.0, (2, 1): 0.2, (3, 0): 1.0, (3, 1): 0.45})
    # A group of two normalises to -1, +1 (ties would give 0).
    assert {(s.turn, s.rollout_idx): s.advantage for s in ep.samples} == pytest.approx(
        {(0, 0): -1, (0, 1): 1, (1, 0): -1, (1, 1): 1, (2, 0): 1, (2, 1): -1, (3, 0): 1, (3, 1): -1}, rel=1e-4)


async def test_tree_step_rewards_are_shaped_against_the_agents_kept_path():
    cfg = config({"name": "chain", "agents": ["a"], "rounds": 2, "sampling": "tree"}, {"a": "m1"}, group_size=2,
                 reward={"shaping": "margin", "scope": "all", "alpha": 0.5})
    policy = Candidates({"a": lambda u, k: ("3", "6")[k] if u == "3+4=" else ("7", "1")[k]})
    ep = await run_episode(cfg, ARITH, 0, BUILTIN["chain"], policy, Actions(), dict)
    # Step 0 keeps "6" (0.45); step 1's candidates 7 (1.0) and 1 (0.2) are both shaped against Q = 0.45:
    # R~ = R + 0.5 * (R - 0.45).
    assert {(s.turn, s.rollout_idx): s.reward for s in ep.samples} == pytest.approx(
        {(0, 0): 0.3, (0, 1): 0.45, (1, 0): 1.0 + 0.5 * 0.55, (1, 1): 0.2 - 0.5 * 0.25})


@pytest.mark.parametrize("name, agents", [
    ("debate", ["a", "b"]), ("chain", ["a", "b"]), ("mixture", ["a", "b", "c"]),
    ("solver_coder_refiner", ["a", "b", "c"]), ("custom", ["a", "b"]),
])
async def test_tree_sampling_makes_one_group_of_g_candidates_per_step_for_every_workflow(name: str,
                                                                                        agents: list[str]):
    G = 3
    extra = {"function": f"{ROOT / 'examples' / 'my_workflow.py'}:critique"} if name == "custom" else {}
    cfg = config({"name": name, "agents": agents, "sampling": "tree", **extra}, dict.fromkeys(agents, "m1"), G)
    policy = Candidates(dict.fromkeys(agents, pick("5", "7", "9")))
    ep = await run_episode(cfg, ARITH, 2, workflow_of(cfg), policy, Actions(), dict)
    turns = ep.trajectories[0]["trajectory"]
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in ep.samples:
        groups[s.group_key].append(s)
    assert sorted(groups) == sorted(f"t-1:{t['agent_name']}:{t['turn_id']}" for t in turns)
    for members in groups.values():
        turn = turns[members[0].turn]
        assert sorted(s.rollout_idx for s in members) == list(range(G))
        assert {s.sample_id for s in members} == {f"t-1_{turn['turn_id']}_{c}" for c in range(G)}
        # One state per step: every candidate answered the same prompt, the one the kept path led to.
        assert {tuple(s.prompt_ids.tolist()) for s in members} == {tuple(TOK.chat(f"<{turn['agent_name']}>",
                                                                                  turn["agent_input"]))}
        texts = [TOK.decode(s.response_ids.tolist()) for s in members]
        # Each candidate earned the check of its own text; the best one ("7") is what the workflow went on with.
        assert [s.reward for s in members] == [score_answer("7", t, partial_credit=True)["reward"] for t in texts]
        assert texts == ["5", "7", "9"] and turn["agent_output"] == "7"
    # Every prompt a step generated for went out G times in one request.
    assert all(len(c["texts"]) % G == 0 for c in policy.calls)
    assert ep.untrained_turns == 0


async def test_tree_sampling_asks_the_judge_plainly_and_trains_only_the_agents():
    cfg = config({"name": "debate", "agents": ["a", "b"], "rounds": 1, "sampling": "tree"},
                 {"a": "m1", "b": "m1", "j": "m1"}, group_size=2, reward={"judge": "j"})
    policy = Candidates({"a": pick("7", "3"), "b": pick("2", "7"),
                         "j": lambda u, k: "Score: 9/10" if "Answer: 7" in u else "Score: 2/10"})
    acts = Actions()
    ep = await run_episode(cfg, ARITH, 0, BUILTIN["debate"], policy, acts, dict)
    assert {(s.agent, s.rollout_idx): s.reward for s in ep.samples} == pytest.approx(
        {("a", 0): 0.9, ("a", 1): 0.2, ("b", 0): 0.2, ("b", 1): 0.9})
    assert [t["agent_output"] for t in ep.trajectories[0]["trajectory"]] == ["7", "7"]
    # The judge read each step's 2 candidates, then each kept answer once: never tree-sampled itself.
    assert sum(t.startswith("<j>") for c in policy.calls for t in c["texts"]) == 2 + 2 + 2
    assert acts.calls == []


def test_best_of_takes_the_highest_reward_and_the_lowest_index_on_a_tie():
    assert best_of([0.2, 0.9, 0.9, 0.1]) == 1
    assert best_of([0.0, 0.0]) == 0
    assert best_of([0.1, 0.2, 0.3]) == 2
    with pytest.raises(ValueError):
        best_of([])


# --- (c) the trainer: a given advantage, or GRPO within the micro-batch ------------------------------------------
def sample(key: str, i: int, reward: float, advantage: float | None = None) -> Sample:
    ids = Array.of([1, 2], "int32")
    return Sample(run="r", episode="e", sample_id=f"{key}_{i}", env_idx=0, rollout_idx=i, agent="a", model="m",
                  turn=0, prompt_ids=ids, response_ids=ids, behavior_logprobs=Array.of([-1.0, -1.0], "float32"),
                  reward=reward, group_key=key, group_size=2, advantage=advantage, version=0)


def test_micro_batch_advantages_use_the_given_ones_and_compute_the_rest_within_the_batch():
    # g1 came with the coordinator's advantages (computed over its whole group); g2 and g3 did not.
    adv = micro_batch_advantages([1.0, 0.0, 1.0, 0.0, 0.0, 0.5], ["g1", "g1", "g2", "g2", "g3", "g3"],
                                 [0.3, -0.3, None, None, None, None])
    assert adv.tolist() == pytest.approx([0.3, -0.3, 1.0, -1.0, -1.0, 1.0], abs=1e-5)
    # Without given advantages: exactly the per-micro-batch GRPO the trainer always computed.
    rewards, keys = [1.0, 0.0, 0.25, 0.5, 3.0], ["x", "x", "y", "y", "z"]
    assert torch.equal(micro_batch_advantages(rewards, keys, [None] * 5), grpo_adv(rewards, keys))
    with pytest.raises(ValueError, match="finite"):
        micro_batch_advantages([1.0], ["x"], [math.nan])
    with pytest.raises(ValueError, match="one of each"):
        micro_batch_advantages([1.0], ["x"], [])


def test_trainer_accumulate_passes_given_and_computed_advantages_of_the_kept_rows():
    from services.trainer.learner import Learner

    got: list[tuple[list[str], list[float]]] = []
    learner = SimpleNamespace(batch_level=False, kl_reward=False,
                              accumulate=lambda s, a: got.append(([x.sample_id for x in s], list(a))) or 0.0)
    samples = [sample("g1", 0, 1.0, 0.7), sample("g1", 1, 0.0, -0.7), sample("g2", 0, 1.0), sample("g2", 1, 0.0)]
    # Row 3 was dropped (stale): it still counts for its group's mean and std, as before.
    Learner.micro_batch(learner, samples, [0, 1, 2], "grpo")  # type: ignore[arg-type]
    (ids, adv), = got
    assert ids == ["g1_0", "g1_1", "g2_0"] and adv == pytest.approx([0.7, -0.7, 1.0], abs=1e-5)


# --- generated tokens: the budget that compares a team with a single agent -----------------------------------


async def test_an_episode_counts_the_tokens_of_every_row_generated_for_it():
    cfg = config({"name": "debate", "agents": ["a", "b"], "rounds": 2}, {"a": "m1", "b": "m2"})
    ep = await run_episode(cfg, ARITH, 0, BUILTIN["debate"], Script({"a": lambda u: "7", "b": lambda u: "12"}),
                           Actions(), dict)
    # 3 rollouts x 2 rounds: a's "7"+EOS (2 tokens) and b's "12"+EOS (3 tokens) each round
    assert ep.tokens_generated == 3 * 2 * (2 + 3) == sum(len(s.response_ids) for s in ep.samples)
    tree = config({"sampling": "tree"}, {"solver": "m1", "verifier": "m2"})
    policy = Candidates({"solver": pick("5", "9", "3"), "verifier": pick("6", "7", "7!")})
    ep = await run_episode(tree, ARITH, 4, BUILTIN["solve_verify"], policy, Actions(), lambda: {"m1": 3, "m2": 5})
    # every candidate counts, the ones not kept too: 3 x ("5", "9", "3") + ("6", "7", "7!"), each with its EOS
    assert ep.tokens_generated == 3 * 2 + (2 + 2 + 3) == sum(len(s.response_ids) for s in ep.samples)
