"""Learning-rate schedules by hand, and the learner applying them by version."""

from __future__ import annotations

import math

import pytest

from shared.rlmath.schedules import lr_factor


def test_constant_is_one_after_its_warm_up() -> None:
    assert [lr_factor(k, 10, "constant") for k in (1, 5, 10, 11)] == [1.0] * 4
    assert [lr_factor(k, 10, "constant", warmup=4) for k in (1, 2, 4, 5)] == [0.25, 0.5, 1.0, 1.0]


def test_linear_and_cosine_decay_to_the_floor_by_hand() -> None:
    # T = 12, W = 2: p = (k - 2) / 10
    assert lr_factor(2, 12, "linear", warmup=2) == 1.0
    assert lr_factor(7, 12, "linear", warmup=2) == pytest.approx(0.5)
    assert lr_factor(12, 12, "linear", warmup=2) == 0.0
    assert lr_factor(7, 12, "cosine", warmup=2) == pytest.approx(0.5)
    assert lr_factor(4, 12, "cosine", warmup=2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_factor(12, 12, "cosine", warmup=2, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(6, 12, "cosine", min_ratio=0.2) == pytest.approx(0.2 + 0.8 * 0.5)  # p = 6 / 12
    assert lr_factor(40, 12, "linear", min_ratio=0.3) == pytest.approx(0.3)  # past the end: the floor


def test_the_learner_steps_with_the_scheduled_lr_and_records_it(tmp_path) -> None:
    from services.trainer.learner import Learner
    from tests.unit.test_learner import make_cfg, make_sample

    cfg = make_cfg(tmp_path, global_batch=4)
    cfg.models["m"].optim = cfg.models["m"].optim.model_copy(update={"schedule": "linear", "warmup_versions": 1})
    cfg.train.max_versions = 3
    learner = Learner(cfg, "m")
    lrs = []
    for step in range(3):
        learner.accumulate([make_sample(4 * step + i) for i in range(4)], [1.0, -1.0, 0.5, -0.5])
        result = learner.step()
        assert result is not None and not result.skipped
        lrs.append(result.stats["lr"])
        assert learner.optimizer.param_groups[0]["lr"] == result.stats["lr"]
    assert lrs == pytest.approx([0.01, 0.005, 0.0])  # warm-up to lr at v1, then linear to 0 at v3
