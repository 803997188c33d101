"""docs/algorithms.md documents every loss and advantage option the config schema accepts."""

from __future__ import annotations

import typing
from pathlib import Path

from shared.kernel.config import TrainConfig
from shared.rlmath.advantages import ESTIMATORS
from shared.rlmath.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def _choices(field: str) -> tuple[str, ...]:
    return typing.get_args(TrainConfig.model_fields[field].annotation)


def test_every_loss_and_aggregation_of_the_schema_is_implemented_and_documented():
    text = DOC.read_text()
    # train.loss names a registered policy loss (marft_token is train.loss marft with marft.variant token)
    losses = sorted(set(POLICY_LOSSES) - {"marft_token"})
    assert set(_choices("loss_agg")) == set(AGGREGATIONS)
    assert set(_choices("advantage")) == set(ESTIMATORS) and set(_choices("kl_estimator")) == set(KL_ESTIMATORS)
    for option in (*losses, *_choices("loss_agg"), *_choices("advantage"), *_choices("kl_estimator"),
                   *_choices("kl_in")):
        assert f"`{option}`" in text, f"docs/algorithms.md does not document {option!r}"
    for key in ("clip_eps", "clip_ratio_c", "behav_imp_weight_cap", "loss_agg", "advantage", "entropy_coef",
                "kl_coef", "kl_estimator", "kl_in"):
        assert f"train.{key}" in text, key
    assert "models.<m>.train" in text
