"""Held-out evaluation: the settings every evaluation shares, pass@1 (mean of n), pass@k, Maj@N, tokens."""

from __future__ import annotations

import re

import pytest

from services.coordinator.evaluation import (
    TaskOutcome,
    eval_config,
    evaluate,
    k_values,
    majority_correct,
    pass_at_k,
    scores,
)
from services.coordinator.tasks import Task
from services.coordinator.workflows import BUILTIN, Abandon
from shared.kernel.config import ChorusConfig
from shared.models.tokenizer import ByteTokenizer
from tests.unit.test_workflows_builtin import Actions, Script
from tests.unit.test_workflows_builtin import config as workflow_config

TOK = ByteTokenizer()


def config(**evaluation) -> ChorusConfig:
    return ChorusConfig(
        models={"m": {}}, agents={"solver": {"model": "m"}, "verifier": {"model": "m"}},
        workflow={"group_size": 8, "temperature": 1.0, "sampling": "tree"}, reward={"shaping": "quality", "alpha": 0.5},
        task={"heldout": 16}, eval={"every": 10, "tasks": 16, "temperature": 0.0, **evaluation},
    )


def test_evaluation_plays_n_unshaped_parallel_rollouts_per_task_at_the_eval_temperature():
    cfg = config()
    ecfg = eval_config(cfg)
    assert (ecfg.workflow.group_size, ecfg.workflow.temperature, ecfg.reward.shaping) == (1, 0.0, "none")
    assert (cfg.workflow.group_size, cfg.workflow.temperature, cfg.reward.shaping) == (8, 1.0, "quality")
    ecfg = eval_config(config(samples=4, temperature=0.6))
    assert (ecfg.workflow.group_size, ecfg.workflow.temperature, ecfg.workflow.sampling) == (4, 0.6, "parallel")


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3, 3) / C(5, 3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # every pair holds a right one
    assert pass_at_k(1, 1, 4) == 1.0 and pass_at_k(1, 0, 4) == 0.0  # fewer samples than k


def test_maj_at_n_votes_over_equal_answers_by_value():
    assert majority_correct([("3", False), ("3.0", False), ("4", True)]) is False  # 3 and 3.0 are one answer
    assert majority_correct([("4", True), ("3", False), ("", False), ("", False)]) is True  # tie: first seen
    assert majority_correct([("", False), ("", True)]) is False  # nobody answered


def test_k_values_default_to_powers_of_two_and_n():
    assert k_values(1, None) == [1]
    assert k_values(4, None) == [1, 2, 4]
    assert k_values(6, None) == [1, 2, 4, 6]
    assert k_values(8, [8, 1]) == [1, 8]


def test_scores_of_two_tasks_of_two_samples_by_hand():
    a = TaskOutcome(final=[("7", True), ("5", False)],
                    agents={("solver", 0): [("7", True), ("5", False)], ("verifier", 1): [("7", True), ("7", True)]},
                    tokens=[{"solver": 3, "verifier": 2}, {"solver": 5, "verifier": 2}])
    b = TaskOutcome(final=[("1", False), ("1", False)],
                    agents={("solver", 0): [("2", True), ("1", False)], ("verifier", 1): [("1", False), ("1", False)]},
                    tokens=[{"solver": 4, "verifier": 1}, {"solver": 4, "verifier": 1}])
    failed = TaskOutcome(final=[("", False)] * 2, failed=True)
    got = scores([a, b, failed], [1, 2])
    assert got["final"] == pytest.approx((0.5 + 0 + 0) / 3)  # a task that could not be played is wrong
    assert got["pass1"] == pytest.approx({"solver": 0.5, "verifier": 0.5})
    assert got["pass_at_k"]["final"] == pytest.approx({"1": 1 / 6, "2": 1 / 3})
    assert got["pass_at_k"]["solver"] == pytest.approx({"1": 0.5, "2": 1.0})
    # Maj@2: task a's tie goes to the first answer (7, right), task b's to 1 (wrong); the solver's tie in b: "2"
    assert got["maj"] == pytest.approx({"final": 1 / 3, "solver": 1.0, "verifier": 0.5})
    assert got["tokens_per_question"] == pytest.approx({"solver": 4.0, "verifier": 1.5, "total": 5.5})


def test_maj_at_n_of_the_final_answer_needs_the_workflow_to_report_it():
    custom = TaskOutcome(final=[("", True), ("", True)], has_final_answer=False)
    got = scores([custom], [1])
    assert got["final"] == 1.0 and "final" not in got["maj"]


@pytest.mark.parametrize(("evaluation", "key"), [
    ({"samples": 4, "temperature": 0.0}, "eval.samples"),  # four greedy rollouts are one
    ({"samples": 4, "temperature": 0.7, "pass_k": [8]}, "eval.pass_k"),
    ({"samples": 0}, "eval.samples"),
])
def test_meaningless_evaluation_settings_are_refused_naming_the_key(evaluation, key):
    from shared.kernel.config import ConfigError, load_config

    with pytest.raises(ConfigError) as exc:
        load_config(None, models={"m": {}}, agents={"solver": {"model": "m"}, "verifier": {"model": "m"}},
                    eval=evaluation)
    assert key in str(exc.value)


def test_evaluation_needs_enough_held_out_tasks():
    with pytest.raises(ValueError, match=r"task.heldout \(4\) must be at least eval.tasks \(16\)"):
        ChorusConfig(models={"m": {}}, agents={"solver": {"model": "m"}, "verifier": {"model": "m"}},
                     task={"heldout": 4}, eval={"every": 5, "tasks": 16})



async def test_a_held_out_task_that_fails_is_played_again_and_one_failing_every_time_counts_as_wrong():
    cfg = workflow_config({"name": "solve_verify"}, {"solver": "m1", "verifier": "m1"}, group_size=1)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"retries": 2})})
    tasks = [Task("flaky", "3+4=", "7"), Task("fine", "2+2=", "4"), Task("broken", "1+1=", "2")]
    sums = {t.question: t.answer for t in tasks}
    # the solver answers the sum it was asked; the verifier repeats the last number it read
    script = Script({"solver": lambda text: next(a for p, a in sums.items() if p in text),
                     "verifier": lambda text: re.findall(r"\d+", text)[-1]})
    failures = {"flaky": 1, "broken": 99}  # the solver's calls of each task that fail before it answers

    async def generate(model, adapter, prompts, **kw):
        text = TOK.decode(prompts[0])
        for task in tasks:
            if text.startswith("<solver>") and task.question in text and failures.get(task.task_id, 0) > 0:
                failures[task.task_id] -= 1
                raise Abandon(f"no rollouter answered for {task.task_id}")
        return await script(model, adapter, prompts, **kw)

    rec = await evaluate(cfg, tasks, BUILTIN["solve_verify"], generate, Actions(), lambda: {"m1": 3}, None)
    assert rec["n"] == 3 and rec["failed"] == 1 and rec["retried"] == 1 + 2  # flaky once, broken twice
    assert list(rec["errors"]) == ["broken"] and "no rollouter answered" in rec["errors"]["broken"]
    assert rec["final"] == pytest.approx(2 / 3)  # the two played tasks are right; the broken one counts as wrong
