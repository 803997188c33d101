"""Whole runs with a DeepSpeed trainer group: `chorus up configs/tiny-chain.yaml` with the solver's model trained by
a 2-rank ZeRO-2 group and the verifier's by the torch learner (both learn); the group's ranks SIGKILLed mid-run; a
whole run killed and resumed.

Marked deepspeed (`make test-deepspeed`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.results.plotting import summarize
from tests.e2e.conftest import ROOT, chorus_up
from tests.faults.harness import Broker, Fault, FaultRun, describe, fault_config
from tests.faults.test_resume import MAX_VERSIONS, killed_and_resumed

pytestmark = [pytest.mark.deepspeed, pytest.mark.e2e]
MODELS = ["solver_lm", "verifier_lm"]


def deepspeed_config(tmp_path: Path, run_id: str, model: str = "solver_lm", stage: int = 2) -> Path:
    """configs/tiny-chain.yaml with ``model`` trained by a 2-rank DeepSpeed group, its run directory in tmp_path."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    cfg.pop("nats", None)
    cfg["train"]["checkpoint_every"] = 0
    cfg["metrics_interval_s"] = 0.5
    cfg["models"][model]["trainer"] = {"backend": "deepspeed", "deepspeed": {"ranks": 2, "zero_stage": stage}}
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_tiny_chain_with_a_deepspeed_group_on_one_model_and_torch_on_the_other_learns_on_both(
        nats_url, run_id, tmp_path):
    code, text = await chorus_up(deepspeed_config(tmp_path, run_id), nats_url, 840)
    assert code == 0, text[-4000:]
    run_dir = sorted((tmp_path / "runs").glob(f"{run_id}-*"))[-1]
    solver = "".join(p.read_text() for p in (run_dir / "logs").glob("trainer-solver_lm*.log"))
    verifier = "".join(p.read_text() for p in (run_dir / "logs").glob("trainer-verifier_lm*.log"))
    assert '"event": "trainer group"' in solver and '"ranks": 2' in solver
    assert '"event": "trainer group"' not in verifier
    assert list((run_dir / "checkpoints" / "solver_lm" / "zero").glob("v*"))  # DeepSpeed's own checkpoints
    summary = summarize(run_dir / "metrics.jsonl")
    print({m: {k: summary[m][k] for k in ("steps", "first", "last")} for m in MODELS})
    for m in MODELS:
        assert summary[m]["steps"] >= 300, summary
        assert summary[m]["last"] - summary[m]["first"] >= 0.3, summary


def with_group(config: Path, model: str = "solver_lm") -> Path:
    """``config`` with ``model`` trained by a 2-rank ZeRO-2 DeepSpeed group."""
    raw = yaml.safe_load(config.read_text())
    raw["models"][model]["trainer"] = {"backend": "deepspeed", "deepspeed": {"ranks": 2, "zero_stage": 2}}
    config.write_text(yaml.safe_dump(raw))
    return config


async def test_killing_rank_0_or_rank_1_of_a_deepspeed_trainer_loses_nothing_and_trains_nothing_twice(tmp_path,
                                                                                                       run_id):
    # rank 0 is the trainer service: SIGKILLed, its follower dies with it; rank 1 SIGKILLed: rank 0 sees it gone
    # and exits. Either way the harness starts the trainer again (as chorus up's supervisor does), and the whole
    # group comes back from the committed version.
    config = with_group(fault_config(tmp_path, run_id, max_versions=40))
    faults = [Fault("trainer", "kill", 8, "solver_lm", down_s=1.0),
              Fault("trainer", "kill", 20, "solver_lm", down_s=1.0, rank=1)]
    broker = Broker.single(tmp_path / "nats")
    try:
        fault_run = FaultRun(tmp_path, run_id, broker, config, max_versions=40)
        outcome = await fault_run.run(faults, timeout_s=700)
    finally:
        broker.stop()
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    assert all(f.landed_at for f in outcome.faults), describe(outcome)
    for m, r in outcome.reports.items():
        assert r.trained > 0 and r.published > 0, m
        assert r.versions == list(range(1, fault_run.max_versions + 1)), (m, r.versions)  # none back, none twice
        assert not r.trained_twice and not r.conflicting_versions, m


async def test_a_killed_run_with_a_deepspeed_trainer_resumes_from_its_last_commit(tmp_path, run_id):
    config = with_group(fault_config(tmp_path, run_id, max_versions=MAX_VERSIONS))
    await killed_and_resumed(tmp_path, run_id, config, services=12)  # the group's rank 1 is one more process
