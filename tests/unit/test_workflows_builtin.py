"""debate, chain, mixture and solver_coder_refiner over a scripted policy and the real check actions: turn
order, what each agent saw, the vote, group keys, per-turn rewards and how the G rollouts were batched."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from services.actions.actions import REGISTRY
from services.coordinator.tasks import Task
from services.coordinator.workflows import BUILTIN, Episode, GenResult, run_episode
from services.coordinator.workflows.scoring import majority
from shared.kernel.config import ChorusConfig
from shared.models.tokenizer import EOS_ID, ByteTokenizer

TOK = ByteTokenizer()
ARITH = Task("t-1", "3+4=", "7")


def config(workflow: dict[str, Any], agents: dict[str, str], group_size: int = 3, task: str = "arithmetic",
           reward: dict[str, Any] | None = None) -> ChorusConfig:
    """Agents on m1 (base) or m2 (LoRA, one adapter per agent); each agent's system prompt is ``<name>``."""
    data = {
        "run": {"id": "wf"},
        "models": {"m1": {}, **({"m2": {"lora": {"r": 2}}} if "m2" in agents.values() else {})},
        "agents": {a: {"model": m, "prompt": f"<{a}>", **({"adapter": f"{a}x"} if m == "m2" else {})}
                   for a, m in agents.items()},
        "workflow": {"group_size": group_size, "max_new_tokens": 8, **workflow},
        "task": {"name": task},
        "train": {"global_batch": group_size * 4},
        "reward": {"partial_credit": True, **(reward or {})},  # the shipped arithmetic configs' shaping
    }
    return ChorusConfig(**yaml.safe_load(yaml.safe_dump(data)))


class Script:
    """A scripted policy: each agent (known by its system prompt ``<name>``) answers by a rule of the text it
    was given; records every request and what each agent saw."""

    def __init__(self, rules: dict[str, Callable[[str], str]], versions: dict[str, int] | None = None) -> None:
        self.rules = rules
        self.versions = versions or {"m1": 3, "m2": 5}
        self.calls: list[dict[str, Any]] = []
        self.seen: dict[str, list[str]] = defaultdict(list)

    async def __call__(self, model: str, adapter: str | None, prompts: list[list[int]], *, max_new_tokens: int,
                       temperature: float, top_p: float) -> list[GenResult]:
        texts = [TOK.decode(p) for p in prompts]
        self.calls.append({"model": model, "adapter": adapter, "texts": texts})
        rows = []
        for text in texts:
            agent = re.match(r"<(\w+)>", text)
            assert agent is not None, f"prompt without a system prompt: {text!r}"
            user = text[agent.end():]
            self.seen[agent[1]].append(user)
            ids = TOK.encode(self.rules[agent[1]](user), bos=False) + [EOS_ID]
            rows.append(GenResult(ids=ids, logprobs=[-0.25] * len(ids), finished=True, version=self.versions[model]))
        return rows


class Actions:
    """The registered actions, run in-process; a row that raises scores as an empty result (as in the service)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []

    async def __call__(self, kind: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls.append((kind, payloads))
        out = []
        for p in payloads:
            try:
                out.append(REGISTRY[kind](p))
            except ValueError:
                out.append({})
        return out


async def play(cfg: ChorusConfig, policy: Script, acts: Actions, task: Task = ARITH) -> Episode:
    return await run_episode(cfg, task, 4, BUILTIN[cfg.workflow.name], policy, acts, lambda: {"m1": 3, "m2": 5})


def turns_of(ep: Episode, rollout: int = 0) -> list[tuple[int, str, str, int]]:
    return [(t["turn_id"], t["agent_name"], t["agent_role"], t["metadata"].get("round", 0))
            for t in ep.trajectories[rollout]["trajectory"]]


def rewards_by_turn(ep: Episode) -> dict[int, set[float]]:
    out: dict[int, set[float]] = defaultdict(set)
    for s in ep.samples:
        out[s.turn].add(round(s.reward, 6))
    return dict(out)


def assert_groups(ep: Episode, cfg: ChorusConfig, expected: list[tuple[str, int]]) -> None:
    """One whole group of G rollouts per (agent, turn), with ids, keys, models and the prompts sent."""
    G = cfg.workflow.group_size
    groups: dict[str, list[int]] = defaultdict(list)
    for s in ep.samples:
        groups[s.group_key].append(s.rollout_idx)
        agent = cfg.agents[s.agent]
        assert (s.model, s.adapter, s.group_size, s.env_idx) == (agent.model, agent.adapter, G, 4)
        assert s.sample_id == f"t-{s.group_key.split(':')[0][2:]}_{s.turn}_{s.rollout_idx}"
        assert s.version == {"m1": 3, "m2": 5}[s.model] and s.versions == {"m1": 3, "m2": 5}
        turn = ep.trajectories[s.rollout_idx]["trajectory"][s.turn]
        assert turn["agent_name"] == s.agent
        assert s.prompt_ids.tolist() == TOK.chat(agent.prompt, turn["agent_input"])
        assert TOK.decode(s.response_ids.tolist()) == turn["agent_output"]
    task_id = ep.task.task_id
    assert {k: sorted(v) for k, v in groups.items()} == {f"{task_id}:{a}:{t}": list(range(G)) for a, t in expected}


# --- debate --------------------------------------------------------------------------------------------------
async def test_debate_rounds_see_the_others_last_answers_and_the_majority_decides():
    cfg = config({"name": "debate", "agents": ["a", "b", "c"], "rounds": 2},
                 {"a": "m1", "b": "m1", "c": "m2"})
    policy = Script({
        "a": lambda u: "3" if u == "3+4=" else "7",  # changes its mind after seeing the others
        "b": lambda u: "7",
        "c": lambda u: "7" if u == "3+4=" else "5",
    })
    acts = Actions()
    ep = await play(cfg, policy, acts)

    assert turns_of(ep) == [(0, "a", "debater", 0), (1, "b", "debater", 0), (2, "c", "debater", 0),
                            (3, "a", "debater", 1), (4, "b", "debater", 1), (5, "c", "debater", 1)]
    G = 3
    assert policy.seen["a"] == ["3+4="] * G + ["3+4=\nb: 7\nc: 7\n"] * G
    assert policy.seen["b"] == ["3+4="] * G + ["3+4=\na: 3\nc: 7\n"] * G
    assert policy.seen["c"] == ["3+4="] * G + ["3+4=\na: 3\nb: 7\n"] * G
    traj = ep.trajectories[0]
    assert [t["metadata"]["seen"] for t in traj["trajectory"]] == [[], [], [], [1, 2], [0, 2], [0, 1]]
    # Last round: a=7, b=7, c=5 -> 7 by two votes to one; a's turn holds it first.
    assert traj["final_answer"] == "7" and traj["final_reward"] == 1.0
    assert [t["metadata"].get("voted") for t in traj["trajectory"][3:]] == [True, False, False]
    assert ep.final_correct == [True] * G
    # check_answer: "3" is 4 off (0.3), "5" is 2 off (0.4).
    assert rewards_by_turn(ep) == {0: {0.3}, 1: {1.0}, 2: {1.0}, 3: {1.0}, 4: {1.0}, 5: {0.4}}
    assert ep.rewards["c"] == [1.0] * G + [0.4] * G
    assert_groups(ep, cfg, [("a", 0), ("b", 1), ("c", 2), ("a", 3), ("b", 4), ("c", 5)])
    # Per round one request per (model, adapter), holding every rollout's prompts; one batched check.
    assert [(c["model"], c["adapter"], len(c["texts"])) for c in policy.calls] == [
        ("m1", None, 2 * G), ("m2", "cx", G), ("m1", None, 2 * G), ("m2", "cx", G)]
    assert [(kind, len(p)) for kind, p in acts.calls] == [("check_answer", 6 * G)]


async def test_debate_tie_goes_to_the_earliest_answer():
    cfg = config({"name": "debate", "agents": ["a", "b"], "rounds": 1}, {"a": "m1", "b": "m1"}, group_size=2)
    ep = await play(cfg, Script({"a": lambda u: "3", "b": lambda u: "7"}), Actions())
    assert ep.trajectories[0]["final_answer"] == "3"
    assert ep.trajectories[0]["final_reward"] == pytest.approx(0.3)
    assert ep.final_correct == [False, False]


def test_majority_counts_equal_values_together_and_skips_turns_without_an_answer():
    def t(i: int, out: str) -> Any:
        return {"turn_id": i, "agent_name": f"x{i}", "agent_output": out, "metadata": {}}

    turns = [t(0, "no idea"), t(1, "5"), t(2, "so 7.0"), t(3, "\\boxed{7}"), t(4, "5"), t(5, "7")]
    assert majority(turns)["turn_id"] == 2  # 7.0, 7 and 7 are one answer: three votes to two
    assert majority(turns[:5])["turn_id"] == 1  # two votes each: the answer given first wins
    assert majority([t(0, "hmm"), t(1, "what")])["turn_id"] == 0
    with pytest.raises(ValueError):
        majority([])


# --- chain ---------------------------------------------------------------------------------------------------
def plus_two(user: str) -> str:
    """Start at 1; otherwise the previous answer + 2."""
    numbers = re.findall(r": (\d+)", user)
    return str(int(numbers[-1]) + 2) if numbers else "1"


async def test_chain_each_agent_refines_the_previous_answer():
    cfg = config({"name": "chain", "agents": ["a", "b", "c"], "rounds": 2}, {"a": "m1", "b": "m2", "c": "m1"})
    policy = Script({"a": plus_two, "b": plus_two, "c": plus_two})
    ep = await play(cfg, policy, Actions())

    assert turns_of(ep) == [(0, "a", "generator", 0), (1, "b", "refiner", 0), (2, "c", "refiner", 0),
                            (3, "a", "refiner", 1), (4, "b", "refiner", 1), (5, "c", "refiner", 1)]
    outputs = [t["agent_output"] for t in ep.trajectories[0]["trajectory"]]
    assert outputs == ["1", "3", "5", "7", "9", "11"]
    assert policy.seen["b"][:3] == ["3+4=\na: 1\n"] * 3 and policy.seen["a"][3:] == ["3+4=\nc: 5\n"] * 3
    assert [t["metadata"]["seen"] for t in ep.trajectories[0]["trajectory"]] == [[], [0], [1], [2], [3], [4]]
    # Each turn is checked on its own; the last answer is the final one.
    assert rewards_by_turn(ep) == {0: {0.2}, 1: {0.3}, 2: {0.4}, 3: {1.0}, 4: {0.4}, 5: {0.3}}
    assert ep.trajectories[0]["final_reward"] == pytest.approx(0.3) and ep.final_correct == [False] * 3
    assert_groups(ep, cfg, [("a", 0), ("b", 1), ("c", 2), ("a", 3), ("b", 4), ("c", 5)])
    assert [len(c["texts"]) for c in policy.calls] == [3] * 6  # one request per turn for all rollouts


async def test_chain_with_margin_shaping_adjusts_an_agents_later_turns_by_its_history():
    cfg = config({"name": "chain", "agents": ["a", "b"], "rounds": 2}, {"a": "m1", "b": "m1"},
                 reward={"shaping": "margin", "scope": "all", "alpha": 0.5})
    ep = await play(cfg, Script({"a": plus_two, "b": plus_two}), Actions())
    # a answers 1 then 5, b answers 3 then 7: R = 0.2, 0.4 for a and 0.3, 1.0 for b.
    raw = {t["turn_id"]: t["reward"] for t in ep.trajectories[0]["trajectory"]}
    assert raw == pytest.approx({0: 0.2, 1: 0.3, 2: 0.4, 3: 1.0})
    shaped = {s.turn: s.reward for s in ep.samples}
    # R~_t = R_t + alpha * (R_t - Q_t), Q_t the mean of the agent's earlier turns.
    assert shaped == pytest.approx({0: 0.2, 1: 0.3, 2: 0.4 + 0.5 * (0.4 - 0.2), 3: 1.0 + 0.5 * (1.0 - 0.3)})


# --- mixture -------------------------------------------------------------------------------------------------
async def test_mixture_aggregator_sees_every_proposal_and_gives_the_final_answer():
    cfg = config({"name": "mixture", "agents": ["p", "q", "r", "agg"]},
                 {"p": "m1", "q": "m1", "r": "m2", "agg": "m2"}, group_size=2)
    policy = Script({"p": lambda u: "5", "q": lambda u: "7", "r": lambda u: "7",
                     "agg": lambda u: max(set(re.findall(r": (\d+)", u)), key=u.count)})
    ep = await play(cfg, policy, Actions())

    assert turns_of(ep) == [(0, "p", "proposer", 0), (1, "q", "proposer", 0), (2, "r", "proposer", 0),
                            (3, "agg", "aggregator", 1)]
    assert set(policy.seen["p"]) == {"3+4="}
    assert policy.seen["agg"] == ["3+4=\np: 5\nq: 7\nr: 7\n"] * 2
    assert ep.trajectories[1]["final_answer"] == "7" and ep.final_correct == [True, True]
    assert rewards_by_turn(ep) == {0: {0.4}, 1: {1.0}, 2: {1.0}, 3: {1.0}}
    assert_groups(ep, cfg, [("p", 0), ("q", 1), ("r", 2), ("agg", 3)])
    # Proposers in one stage: m1 gets p and q of both rollouts at once, m2 gets r; then the aggregator.
    assert [(c["model"], c["adapter"], len(c["texts"])) for c in policy.calls] == [
        ("m1", None, 4), ("m2", "rx", 2), ("m2", "aggx", 2)]


async def test_mixture_layers_see_only_the_layer_before():
    cfg = config({"name": "mixture", "agents": ["p", "q", "agg"], "rounds": 2},
                 {"p": "m1", "q": "m1", "agg": "m1"}, group_size=2)
    policy = Script({"p": lambda u: "5" if u == "3+4=" else "7", "q": lambda u: "6" if u == "3+4=" else "7",
                     "agg": lambda u: "7"})
    ep = await play(cfg, policy, Actions())
    assert turns_of(ep) == [(0, "p", "proposer", 0), (1, "q", "proposer", 0), (2, "p", "proposer", 1),
                            (3, "q", "proposer", 1), (4, "agg", "aggregator", 2)]
    assert policy.seen["p"][2:] == ["3+4=\np: 5\nq: 6\n"] * 2
    assert policy.seen["agg"] == ["3+4=\np: 7\nq: 7\n"] * 2  # layer 0 is not shown again
    assert_groups(ep, cfg, [("p", 0), ("q", 1), ("p", 2), ("q", 3), ("agg", 4)])


# --- solver_coder_refiner ------------------------------------------------------------------------------------
CODE_TASK = Task("t-9", "Write a Python function inc(x) that returns x + 1.", "def inc(x):\n    return x + 1\n",
                 tests="assert inc(1) == 2\nassert inc(5) == 6\n", kind="code")


async def test_solver_coder_refiner_runs_the_code_against_the_tests_and_the_refiner_sees_the_result():
    cfg = config({"name": "solver_coder_refiner", "agents": ["s", "c", "r"]}, {"s": "m1", "c": "m2", "r": "m1"},
                 group_size=2, task="code")
    policy = Script({
        "s": lambda u: "add one to x",
        "c": lambda u: "```python\ndef inc(x):\n    return x + 2\nprint(inc(1))\n```",
        "r": lambda u: "```python\ndef inc(x):\n    return x + 1\n```" if "AssertionError" in u else "no",
    })
    acts = Actions()
    ep = await play(cfg, policy, acts, CODE_TASK)

    assert turns_of(ep) == [(0, "s", "solver", 0), (1, "c", "coder", 0), (2, "r", "refiner", 0)]
    q = CODE_TASK.question
    assert policy.seen["c"] == [f"{q}\ns: add one to x\n"] * 2
    # The coder's program ran against the task's tests; the refiner saw reasoning, code and result.
    kind, payloads = acts.calls[0]
    assert kind == "run_code" and len(payloads) == 2
    assert payloads[0] == {"code": "def inc(x):\n    return x + 2\nprint(inc(1))", "tests": CODE_TASK.tests}
    refiner_saw = policy.seen["r"][0]
    assert refiner_saw.startswith(f"{q}\ns: add one to x\nc: ```python\ndef inc(x):")
    assert "result: 3\nerror: AssertionError in `assert inc(1) == 2`" in refiner_saw
    coder_turn = ep.trajectories[0]["trajectory"][1]
    assert coder_turn["metadata"]["tool_result"]["tests_passed"] == 0
    # Rewards: the solver's prose is no program (0), the coder passed 0 of 2, the refiner's code passes both.
    assert rewards_by_turn(ep) == {0: {0.0}, 1: {0.0}, 2: {1.0}}
    assert ep.final_correct == [True, True]
    assert [(k, len(p)) for k, p in acts.calls] == [("run_code", 2), ("run_code", 4)]
    assert_groups(ep, cfg, [("s", 0), ("c", 1), ("r", 2)])


async def test_solver_coder_refiner_on_a_math_task_scores_the_coder_by_what_its_program_prints():
    cfg = config({"name": "solver_coder_refiner", "agents": ["s", "c", "r"]}, {"s": "m1", "c": "m1", "r": "m1"},
                 group_size=2, task="word")
    task = Task("t-w", "Tom has 3 apples and buys 4 more. How many apples does Tom have now?", "7")
    policy = Script({"s": lambda u: "I think 60", "c": lambda u: "print(3 + 4)",
                     "r": lambda u: "The answer is 7" if "result: 7" in u else "6"})
    acts = Actions()
    ep = await play(cfg, policy, acts, task)
    assert rewards_by_turn(ep) == {0: {0.0}, 1: {1.0}, 2: {1.0}}
    assert ep.trajectories[0]["trajectory"][1]["metadata"]["tool_output"] == "7"
    assert [k for k, _ in acts.calls] == ["run_code", "check_math"]
