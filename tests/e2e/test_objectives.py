"""The tiny two-model run learns under the other objectives: AReaL's decoupled loss (with an importance-weight cap,
token-mean aggregation, a k3 KL term to the frozen start and an entropy bonus) and REINFORCE++ advantages, each
through `chorus up`."""

from __future__ import annotations

import json

import pytest

from shared.plotting import summarize
from tests.e2e.conftest import chorus_up, small_run_config

MODELS = ["solver_lm", "verifier_lm"]
VERSIONS = 100
STEP_METRICS = ("loss", "grad_norm", "tokens", "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl_mu",
                "is_weight_mean", "is_weight_max", "entropy")


@pytest.mark.parametrize(("train", "extra_metrics"), [
    ({"loss": "decoupled", "behav_imp_weight_cap": 5.0, "loss_agg": "token-mean", "entropy_coef": 0.001,
      "kl_coef": 0.01, "kl_estimator": "k3"},
     ("approx_kl_prox", "is_weight_capped_frac", "kl_ref")),
    ({"advantage": "reinforce_pp"}, ()),
], ids=["decoupled", "reinforce_pp"])
async def test_the_tiny_run_learns_with_the_objective(nats_url, run_id, tmp_path, train, extra_metrics):
    cfg = small_run_config(tmp_path, run_id, max_versions=VERSIONS, **train)
    code, text = await chorus_up(cfg, nats_url, 300)
    assert code == 0, text[-4000:]
    run_dir = sorted((tmp_path / "runs").glob(f"{run_id}-*"))[-1]
    summary = summarize(run_dir / "metrics.jsonl")
    for m in MODELS:
        assert summary[m]["steps"] >= VERSIONS, summary
        assert summary[m]["last"] - summary[m]["first"] >= 0.3, summary
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"reward_mean"' in line]
    for key in (*STEP_METRICS, *extra_metrics):
        assert all(key in s for s in steps), key
    assert all(s["tokens"] > 0 and s["is_weight_max"] >= s["is_weight_mean"] > 0 for s in steps)
    if "kl_ref" in extra_metrics:  # k3 >= 0, and 0 only while the policy is its reference
        assert all(s["kl_ref"] >= 0 for s in steps) and steps[-1]["kl_ref"] > 0
