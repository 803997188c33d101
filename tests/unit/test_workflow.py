"""solve_verify over scripted generate/check functions: prompts, groups, ids, rewards and versions."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from services.actions.actions import check_answer
from services.coordinator.tasks import Task
from services.coordinator.workflows import GenResult, printable, solve_verify, verifier_prompt
from shared.kernel.config import ChorusConfig, TaskConfig
from shared.models.tokenizer import EOS_ID, ByteTokenizer

TOK = ByteTokenizer()


def config(group_size: int = 4) -> ChorusConfig:
    text = f"""
run: {{id: wf}}
models: {{m_solve: {{}}, m_verify: {{lora: {{r: 4}}}}}}
agents:
  solver: {{model: m_solve, prompt: "S:"}}
  verifier: {{model: m_verify, prompt: "V:", adapter: checker}}
workflow: {{group_size: {group_size}, max_new_tokens: 3, temperature: 0.7}}
train: {{global_batch: {group_size * 2}}}
reward: {{partial_credit: true}}
"""
    return ChorusConfig(**yaml.safe_load(text))


class ScriptedPolicy:
    """Solver answers wrong ("5"), the verifier copies the right answer; records every request."""

    def __init__(self, solver_reply: list[int], verifier_reply: list[int]) -> None:
        self.replies = {"m_solve": solver_reply, "m_verify": verifier_reply}
        self.versions = {"m_solve": 3, "m_verify": 8}
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, model: str, adapter: str | None, prompts: list[list[int]], *,
                       max_new_tokens: int, temperature: float, top_p: float) -> list[GenResult]:
        self.calls.append({"model": model, "adapter": adapter, "prompts": prompts, "temperature": temperature,
                           "max_new_tokens": max_new_tokens})
        ids = self.replies[model][:max_new_tokens]
        return [GenResult(ids=list(ids), logprobs=[-0.5] * len(ids), finished=EOS_ID in ids,
                          version=self.versions[model]) for _ in prompts]


async def check(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [check_answer(p) for p in payloads]


async def test_episode_has_one_group_per_agent_turn_with_ids_and_rewards():
    cfg = config(group_size=4)
    policy = ScriptedPolicy(TOK.encode("5", bos=False) + [EOS_ID], TOK.encode("7", bos=False) + [EOS_ID])
    task = Task("t-1", "3+4=", "7")
    ep = await solve_verify(cfg, task, 11, policy, check, lambda: {"m_solve": 3, "m_verify": 8})

    assert len(ep.samples) == 8
    solver = [s for s in ep.samples if s.turn == 0]
    verifier = [s for s in ep.samples if s.turn == 1]
    assert [s.sample_id for s in solver] == [f"t-1_0_{i}" for i in range(4)]
    assert [s.sample_id for s in verifier] == [f"t-1_1_{i}" for i in range(4)]
    assert {s.group_key for s in solver} == {"t-1:solver:0"}
    assert {s.group_key for s in verifier} == {"t-1:verifier:1"}
    assert all(s.group_size == 4 and s.env_idx == 11 for s in ep.samples)
    assert [s.episode for s in verifier] == [f"t-1/{i}" for i in range(4)]
    assert {(s.model, s.agent, s.version, s.adapter) for s in solver} == {("m_solve", "solver", 3, None)}
    assert {(s.model, s.agent, s.version, s.adapter) for s in verifier} == {("m_verify", "verifier", 8, "checker")}
    assert all(s.reward == pytest.approx(0.4) for s in solver) and all(s.reward == 1.0 for s in verifier)
    assert ep.final_correct == [True] * 4
    assert ep.rewards == {"solver": [pytest.approx(0.4)] * 4, "verifier": [1.0] * 4}
    assert all(s.versions == {"m_solve": 3, "m_verify": 8} for s in ep.samples)
    assert solver[0].response_ids.tolist() == [ord("5"), EOS_ID]
    assert solver[0].behavior_logprobs.numpy().dtype.name == "float32"
    assert solver[0].timings["gen_s"] >= 0


async def test_solver_prompts_go_in_one_request_and_verifier_sees_the_solver_answer():
    cfg = config(group_size=3)
    policy = ScriptedPolicy(TOK.encode("5\n9", bos=False), TOK.encode("7", bos=False))
    await solve_verify(cfg, Task("t-2", "3+4=", "7"), 0, policy, check, dict)
    solver_call, verifier_call = policy.calls
    assert solver_call["model"] == "m_solve" and solver_call["temperature"] == 0.7
    assert solver_call["prompts"] == [TOK.encode("S:3+4=")] * 3
    assert verifier_call["model"] == "m_verify" and verifier_call["adapter"] == "checker"
    # "5\n9" (no EOS) is cut to 4 chars and the newline removed.
    assert verifier_call["prompts"] == [TOK.encode("V:3+4=59|")] * 3


async def test_failed_checks_score_zero_not_crash():
    cfg = config(group_size=2)
    policy = ScriptedPolicy(TOK.encode("7", bos=False), TOK.encode("x", bos=False))

    async def flaky_check(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [check_answer(p) if p["response"] == "7" else {} for p in payloads]

    ep = await solve_verify(cfg, Task("t-3", "3+4=", "7"), 0, policy, flaky_check, dict)
    assert ep.rewards == {"solver": [1.0, 1.0], "verifier": [0.0, 0.0]}
    assert ep.final_correct == [False, False]


async def test_a_short_generation_reply_is_an_error():
    cfg = config(group_size=2)

    async def short(model: str, adapter: str | None, prompts: list[list[int]], **kw: Any) -> list[GenResult]:
        return [GenResult([1], [0.0], True, 0)]

    with pytest.raises(ValueError, match="expected 2 rows, got 1"):
        await solve_verify(cfg, Task("t-4", "1+1=", "2"), 0, short, check, dict)


def test_verifier_prompt_keeps_four_printable_chars():
    assert verifier_prompt("", "1+1=", "2\x00\x01abc") == "1+1=2a|"
    assert printable("a\ufffdb\tc") == "abc"


def test_admission_blocks_on_a_fresh_full_report_only():
    from services.coordinator.admission import Admission

    adm = Admission(models=["a", "b"], max_versions=3, stale_after_s=5.0)
    assert adm.blocked_by(now=0.0) == []
    adm.on_depth("a", depth=10, capacity=10, now=100.0)
    adm.on_depth("b", depth=3, capacity=10, now=100.0)
    adm.on_depth("other", depth=99, capacity=1, now=100.0)
    assert adm.blocked_by(now=101.0) == ["a"]
    assert adm.blocked_by(now=106.0) == []  # mq went quiet: its last word no longer holds the run
    adm.on_depth("a", depth=9, capacity=10, now=107.0)
    assert adm.blocked_by(now=107.0) == []


def test_a_report_taken_before_the_served_version_was_trained_no_longer_blocks():
    """In the on-policy modes the last report before a step counts the whole batch (depth = capacity): once the
    rollouters serve the version trained on it, that report no longer holds the next batch back."""
    from services.coordinator.admission import Admission

    adm = Admission(models=["a"], max_versions=9, stale_after_s=5.0)
    adm.on_served("a", 3)
    adm.on_depth("a", depth=64, capacity=64, now=100.0, trained_version=3)
    assert adm.saturated(now=100.1)  # the batch of version 3 -> 4 is waiting for its step
    adm.on_served("a", 4)  # SyncDone: version 4 is served, so the trainer stepped on that batch
    assert not adm.saturated(now=100.2) and adm.blocked_by(now=100.2) == []
    adm.on_depth("a", depth=64, capacity=64, now=100.3, trained_version=4)  # a new full report still counts
    assert adm.saturated(now=100.4)
    adm.on_served("a", 2)  # versions never go back
    assert adm.saturated(now=100.4)


def test_admission_budget_is_spent_when_every_model_reached_max_versions():
    from services.coordinator.admission import Admission

    adm = Admission(models=["a", "b"], max_versions=3, stale_after_s=5.0)
    adm.on_trained("a", 3)
    assert not adm.budget_spent
    adm.on_trained("b", 4)
    adm.on_trained("a", 1)  # versions never go back
    assert adm.budget_spent


def test_language_model_verifiers_read_the_question_and_the_proposed_answer():
    from services.coordinator.workflows.solve_verify import verifier_text

    task = Task("t-9", "Ann has 3 pens and buys 4 more. How many pens does she have now?", "7")
    word = TaskConfig(name="word")
    assert verifier_text(word, task, " 7 pens\n", None) == f"{task.question}\nProposed answer: 7 pens"
    assert verifier_text(word, task, "12345", 2).endswith("Proposed answer: 12")
    assert verifier_text(TaskConfig(), Task("t-8", "3+4=", "7"), "7", None) == "3+4=7|"
    asked = TaskConfig(phrasing="question")
    assert verifier_text(asked, Task("t-9", "What is 3 + 4?", "7"), "It is 7", None) == (
        "What is 3 + 4?\nProposed answer: It is 7")
