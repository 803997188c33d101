"""Held-out evaluation: the settings every evaluation shares, and pass@1."""

from __future__ import annotations

import pytest

from services.coordinator.evaluation import eval_config, pass_at_1
from shared.config import ChorusConfig


def config() -> ChorusConfig:
    return ChorusConfig(
        models={"m": {}}, agents={"solver": {"model": "m"}, "verifier": {"model": "m"}},
        workflow={"group_size": 8, "temperature": 1.0}, reward={"shaping": "quality", "alpha": 0.5},
        task={"heldout": 16}, eval={"every": 10, "tasks": 16, "temperature": 0.0},
    )


def test_evaluation_plays_one_unshaped_rollout_per_task_at_the_eval_temperature():
    cfg = config()
    ecfg = eval_config(cfg)
    assert (ecfg.workflow.group_size, ecfg.workflow.temperature, ecfg.reward.shaping) == (1, 0.0, "none")
    assert (cfg.workflow.group_size, cfg.workflow.temperature, cfg.reward.shaping) == (8, 1.0, "quality")


def test_pass_at_1_counts_only_full_rewards_and_every_final_answer():
    pass1, final = pass_at_1({"solver": [1.0, 0.45, 1.0, 0.0], "verifier": [1.0]}, [True, False, False, True])
    assert pass1 == {"solver": 0.5, "verifier": 1.0}
    assert final == 0.5


def test_evaluation_needs_enough_held_out_tasks():
    with pytest.raises(ValueError, match=r"task.heldout \(4\) must be at least eval.tasks \(16\)"):
        ChorusConfig(models={"m": {}}, agents={"solver": {"model": "m"}, "verifier": {"model": "m"}},
                     task={"heldout": 4}, eval={"every": 5, "tasks": 16})
