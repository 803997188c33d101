"""SIGTERM at random moments of a service's work: every service kind exits 0 (before a supervisor's grace period
would SIGKILL it), and nothing is lost or trained twice."""

from __future__ import annotations

import random

import pytest

from tests.faults.harness import (
    EVERYTHING,
    LAGGING,
    PER_MODEL_KINDS,
    Broker,
    Fault,
    FaultRun,
    describe,
    fault_config,
    table,
)

VERSIONS = 60
KINDS = ("paramsync", "trainer", "rollouter", "mq", "coordinator", "actions")


# in `make test-long` (CI) and `make faults`
@pytest.mark.full
async def test_sigterm_in_the_middle_of_a_sync_a_step_or_a_batch_ends_every_service_within_its_grace(
        tmp_path, run_id, fault_table):
    # Each kind twice (paramsync three times: a sync is short, and its stop was the one that hung), each while
    # busy (inside a sync, with micro-batches accumulated, samples held, rows generating, episodes or actions in
    # flight) and after a random delay; each restarted at once, as a supervisor would.
    rng = random.Random(7)
    plan = [k for k in KINDS for _ in range(3 if k == "paramsync" else 2)]
    rng.shuffle(plan)
    # a per-model kind on whichever model is behind, so that it lands while that model still trains
    faults = [Fault(kind, "term", 3 + 3 * i, LAGGING if kind in PER_MODEL_KINDS else "solver_lm", down_s=0.0)
              for i, kind in enumerate(plan)]
    broker = Broker.single(tmp_path / "nats")
    try:
        config = fault_config(tmp_path, run_id, max_versions=VERSIONS)
        outcome = await FaultRun(tmp_path, run_id, broker, config, max_versions=VERSIONS, seed=7).run(faults)
    finally:
        broker.stop()
    fault_table.append(("SIGTERM of every kind while it is busy", outcome))
    print(table([("sigterm", outcome)]))
    print("stops:", [(f.name, f.model if f.per_model else "", f.busy, f.stop_s, f.exit_code) for f in outcome.faults])
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    assert all(f.exit_code == 0 for f in outcome.faults), describe(outcome)


@pytest.mark.full
async def test_every_service_stopped_at_once_in_the_middle_of_a_sync_exits_within_its_grace(tmp_path, run_id,
                                                                                            fault_table):
    # The whole deployment SIGTERMed at once (chorus up's end, `docker compose down`, a node's shutdown) while a
    # paramsync is inside a sync, three times, then started again: it was a paramsync in this state that once
    # never stopped (its rollouters gone mid-sync). Two rollouter instances per model.
    faults = [Fault(EVERYTHING, "term", at, model) for at, model in ((4, "solver_lm"), (11, "verifier_lm"),
                                                                    (18, "solver_lm"))]
    broker = Broker.single(tmp_path / "nats")
    try:
        config = fault_config(tmp_path, run_id, max_versions=30)
        outcome = await FaultRun(tmp_path, run_id, broker, config, max_versions=30, seed=11, rollouters=2).run(faults)
    finally:
        broker.stop()
    fault_table.append(("SIGTERM of every process at once mid-sync", outcome))
    print("stops:", [(f.name, f.model, f.stop_s, f.exit_code) for f in outcome.faults])
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
