"""A run that learns nothing says so: flat groups make a warning naming the cause and the setting; a reward
function that fails on every row stops the run (services/coordinator/health.py)."""

from __future__ import annotations

from typing import Any

import yaml

from services.coordinator.health import RewardHealth
from services.coordinator.tasks import Task
from services.coordinator.workflows.episode import Episode
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Array, Sample


def config(**sections: Any) -> ChorusConfig:
    data = {"run": {"id": "h"}, "models": {"m": {}}, "agents": {"solver": {"model": "m"}, "verifier": {"model": "m"}},
            "workflow": {"group_size": 4, "max_new_tokens": 8}, "train": {"global_batch": 8},  # 2 groups a step
            **sections}
    return ChorusConfig(**yaml.safe_load(yaml.safe_dump(data)))


def episode(rewards: list[float], finished: bool = True, errors: int = 0, n: int = 0) -> Episode:
    ids = Array.of([1, 2], "int32")
    samples = [Sample(run="r", episode=f"e{n}", sample_id=f"e{n}_{i}", env_idx=0, rollout_idx=i, agent="solver",
                      model="m", turn=0, prompt_ids=ids, response_ids=ids,
                      behavior_logprobs=Array.of([-1.0, -1.0], "float32"), reward=r, group_key=f"e{n}:solver:0",
                      group_size=len(rewards), version=0) for i, r in enumerate(rewards)]
    turns = [{"agent_name": "solver", "metadata": {"finished": finished}} for _ in rewards]
    return Episode(task=Task(task_id=f"t{n}", question="q", answer="1"), samples=samples,
                   trajectories=[{"trajectory": turns}], reward_errors=["ValueError: boom"] * errors)


def test_flat_groups_for_n_steps_make_one_warning_naming_the_cause():
    health = RewardHealth(config(reward={"warn_after_steps": 3}))
    assert health.warn_groups == 6  # 3 steps of 2 groups
    out = [health.record(episode([0.0] * 4, n=i))[0] for i in range(8)]
    assert [len(w) for w in out] == [0] * 5 + [1, 0, 0]  # once, at the sixth flat group
    w = out[5][0]
    assert w["model"] == "m" and w["cause"] == "zero_reward" and "mean 0.000" in w["text"]
    # a group with a spread resets it; flat again, the warning comes again after as many groups
    assert health.record(episode([0.0, 1.0, 0.0, 0.0]))[0] == []
    assert [len(health.record(episode([0.0] * 4, n=i))[0]) for i in range(6)] == [0] * 5 + [1]


def test_the_warning_names_truncation_the_answer_tags_or_a_reward_that_does_not_vary():
    def first_warning(cfg: ChorusConfig, **kw: Any) -> dict[str, Any]:
        health = RewardHealth(cfg)
        for i in range(health.warn_groups):
            warnings, _ = health.record(episode(n=i, **kw))
        return warnings[0]

    cut = first_warning(config(reward={"warn_after_steps": 1}), rewards=[0.0] * 4, finished=False)
    assert cut["cause"] == "truncated" and cut["setting"] == "workflow.max_new_tokens" and "100% of its replies" in (
        cut["text"])
    tags = first_warning(config(reward={"warn_after_steps": 1}, task={"name": "reasoning_gym", "dataset": "chain_sum"}),
                         rewards=[0.0] * 4)
    assert tags["setting"] == "task.answer" and "task.answer: flexible" in tags["text"]
    same = first_warning(config(reward={"warn_after_steps": 1}), rewards=[0.5] * 4)
    assert same["cause"] == "constant_reward"
    easy = first_warning(config(reward={"warn_after_steps": 1}), rewards=[1.0] * 4)
    assert easy["cause"] == "full_reward" and "too easy" in easy["text"]


def test_reward_errors_in_a_row_stop_the_run_and_a_scored_sample_resets_the_count():
    health = RewardHealth(config(reward={"max_errors": 10}))
    failed = Episode(task=Task(task_id="t", question="q", answer="1"), samples=[], reward_errors=["ValueError: x"] * 4)
    assert health.record(failed)[1] is None and health.record(failed)[1] is None  # 8 in a row
    assert health.record(episode([1.0, 0.0]))[1] is None  # scored samples: the count starts again
    assert health.record(failed)[1] is None and health.record(failed)[1] is None
    stop = health.record(failed)[1]  # 12 >= 10
    assert stop is not None and stop.startswith("the reward function failed on 12 samples in a row (reward.max_errors "
                                                "10)") and "ValueError: x" in stop and "reward.function" in stop


def test_the_share_of_replies_cut_at_max_new_tokens_is_a_step_metric_and_in_the_final_table():
    from rich.console import Console

    from services.trainer.intake import StepBook
    from shared.launcher.views import summary_table
    from shared.results.plotting import summarize_steps

    ep = episode([0.0, 1.0, 0.0, 1.0])
    for s, cut in zip(ep.samples, (True, False, True, True), strict=True):
        s.truncated = cut
    book = StepBook()
    book.add(ep.samples, version=1)
    assert book.summary()["truncated"] == 0.75
    steps = {"m": [{"reward_mean": 0.5, "truncated": 0.75}, {"reward_mean": 0.5, "truncated": 0.25}],
             "old": [{"reward_mean": 0.1}]}  # a record from before the field: no share, shown as "-"
    summary = summarize_steps(steps)
    assert summary["m"]["truncated"] == 0.5 and "truncated" not in summary["old"]
    console = Console(width=120, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "cut at max_new_tokens" in text and "50%" in text


def test_the_coordinators_drops_are_in_the_progress_line_and_the_final_summary():
    from shared.launcher.progress import ProgressView, RunTracker

    tracker = RunTracker.for_models(["m"], 10)
    assert tracker.coordinator_line() is None
    tracker.on_metrics({"service": "trainer", "counters": {"samples_dropped_reward_error": 9}})  # not the coordinator's
    tracker.on_metrics({"service": "coordinator", "counters": {"samples_dropped_reward_error": 32,
                                                               "groups_incomplete_dropped": 4, "tasks_done": 7}})
    tracker.on_metrics({"service": "coordinator", "counters": {"samples_dropped_reward_error": 30}})  # an older one
    assert tracker.sample_lines() == [
        "m: 0 samples trained, none dropped",
        "coordinator: dropped 32 samples whose reward function failed (reward.function); 4 groups not every rollout "
        "reached (dropped whole)"]
    assert ProgressView(tracker).log_line() == ("progress: m 0/10 reward -; coordinator dropped 32 reward_error, "
                                                "4 groups_incomplete (waiting for the first version)")


def test_a_resumed_run_counts_every_sample_trained_since_the_run_started():
    from shared.launcher.progress import RunTracker

    tracker = RunTracker.for_models(["m"], 10)
    before = [{"model": "m", "version": v, "samples": 48} for v in (1, 2, 3, 4)] + [{"model": "m", "kind": "eval"}]
    tracker.seed(before, {"models": {"m": {"dropped": {"finished": 16}}},
                          "coordinator_dropped": {"samples_dropped_reward_error": 3}})
    tracker.on_event({"kind": "step", "model": "m", "version": 4, "samples": 48})  # already counted
    tracker.on_event({"kind": "step", "model": "m", "version": 5, "samples": 48})
    tracker.on_metrics({"service": "coordinator", "counters": {"samples_dropped_reward_error": 2}})
    lines = tracker.sample_lines()
    assert lines[0] == "m: 240 samples trained; 16 dropped: 16 arrived after the last version (train.max_versions)"
    assert lines[1].startswith("coordinator: dropped 5 samples whose reward function failed")
