"""Fault injection: kill or freeze any one process or broker node mid-run; the run completes, nothing is lost.

``make test`` runs the short form: one run in which every service kind and the nats-server are SIGKILLed in
turn, each while its model is still training. ``make faults`` runs every case on its own run: SIGKILL and
SIGSTOP of each service kind, of the nats-server, and SIGKILL of one node of a three-node cluster with
``nats.replicas: 3``; it prints the table of cases and writes it to ``runs/faults/report.md``.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.faults.harness import (
    LAGGING,
    MARFT_MODELS,
    MODELS,
    POOL_MODELS,
    SERVICE_KINDS,
    SLOT,
    Broker,
    Fault,
    FaultRun,
    describe,
    fault_config,
    marft_fault_config,
    pool_fault_config,
    table,
)

GAUNTLET_VERSIONS = 45
MARFT_VERSIONS = 20
POOL_VERSIONS = 20
FREEZE_S = 20.0  # longer than every timeout of the fault config (requests 10 s, ack waits 10 and 15 s)


@pytest.mark.full  # in make test-long (CI), out of make test's 20 minutes
async def test_marfts_critic_killed_twice_mid_run_loses_nothing_and_trains_nothing_twice(tmp_path, run_id,
                                                                                        fault_table):
    # MARFT's critic (configs/marft-tiny.yaml: agent-by-agent steps on two models) is SIGKILLed twice, once with a
    # pause before its restart (the coordinator's value requests find no critic and back off, or give the task up)
    # and once restarted at once. Its commits hold: its step versions run 1..N with no gap or repeat, every critic
    # sample it was sent is trained once or still waits in its stream; the policy samples keep the run's books.
    broker = Broker.single(tmp_path / "nats")
    try:
        config = marft_fault_config(tmp_path, run_id, max_versions=MARFT_VERSIONS)
        fault_run = FaultRun(tmp_path, run_id, broker, config, max_versions=MARFT_VERSIONS, models=MARFT_MODELS,
                             critic=True)
        faults = [Fault("critic", "kill", 4, down_s=2.0), Fault("critic", "kill", 11, down_s=0.0)]
        outcome = await fault_run.run(faults)
    finally:
        broker.stop()
    fault_table.append(("MARFT's critic killed twice", outcome))
    print(table([("critic", outcome)]))
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    critic = fault_run.critic_report
    assert critic is not None and critic.trained > 0 and critic.published == critic.trained + critic.pending, critic
    # the last restart loaded the committed head: its versions went on from there
    assert fault_run.critic_status["counters"].get("restored") == 1, fault_run.critic_status
    assert fault_run.critic_status["version"] == len(critic.versions) > 0
    # its steps read the features its value requests computed (the frozen base runs once per observation)
    assert fault_run.critic_status["counters"].get("feature_rows_reused", 0) > 0, fault_run.critic_status
    for r in outcome.reports.values():
        assert r.trained > 0 and r.published > 0


@pytest.mark.full  # in make test-long (CI), out of make test's 20 minutes
async def test_a_training_pool_slot_killed_mid_micro_batch_loses_nothing(tmp_path, run_id, fault_table):
    # configs/pool-tiny.yaml: four models' trainers share two slots. A slot worker is SIGKILLed while it runs a
    # micro-batch, twice: the pool starts a fresh worker and runs the call again from the model's stored state.
    # Every model reaches max_versions, every sample is trained once or dropped with a reason.
    broker = Broker.single(tmp_path / "nats")
    try:
        config = pool_fault_config(tmp_path, run_id, max_versions=POOL_VERSIONS)
        fault_run = FaultRun(tmp_path, run_id, broker, config, max_versions=POOL_VERSIONS, models=POOL_MODELS,
                             pool=True)
        outcome = await fault_run.run([Fault(SLOT, "kill", 4), Fault(SLOT, "kill", 10)])
    finally:
        broker.stop()
    fault_table.append(("a training pool's slot killed mid-micro-batch, twice", outcome))
    print(table([("slot", outcome)]))
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    swap = fault_run.pool_status["pool"]["swap"]
    assert swap["lost"] >= 2 and swap["starts"] >= 4, fault_run.pool_status  # both calls ran again on fresh workers
    for r in outcome.reports.values():
        assert r.trained > 0 and r.published > 0


@pytest.mark.full  # in make test-long (CI), out of make test's 20 minutes
async def test_every_service_kind_and_the_broker_killed_in_one_run(tmp_path, run_id, fault_table):
    # Restarted 2 s later. The faults that stop both models come first; then each per-model kind, on whichever
    # model is behind (the other races ahead while one is down): every fault must land while its model (for a
    # shared one: both) is still training. Two rollouter instances per model: the requests in flight on the
    # killed one run again on the other (the rollout manager's re-run), and nothing is trained twice.
    faults = [Fault(kind, "kill", at, model, down_s=2.0) for kind, at, model in (
        ("coordinator", 3, MODELS[0]), ("actions", 6, MODELS[0]), ("nats", 9, MODELS[0]),
        ("paramsync", 12, LAGGING), ("rollouter", 15, LAGGING), ("trainer", 18, LAGGING), ("mq", 24, LAGGING))]
    broker = Broker.single(tmp_path / "nats")
    try:
        config = fault_config(tmp_path, run_id, max_versions=GAUNTLET_VERSIONS)
        fault_run = FaultRun(tmp_path, run_id, broker, config, max_versions=GAUNTLET_VERSIONS, rollouters=2)
        outcome = await fault_run.run(faults)
    finally:
        broker.stop()
    fault_table.append(("every kind and nats-server killed in turn in one run", outcome))
    print(table([("gauntlet", outcome)]))
    print("trained versions at each fault:", [(f.name, f.model, f.landed_at) for f in outcome.faults])
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    for r in outcome.reports.values():
        assert r.trained > 0 and r.published > 0
    balance = fault_run.coordinator_status["balance"]
    counters = fault_run.coordinator_status["counters"]
    # the rollouter killed with requests in flight: the coordinator saw it gone, by a request's probe of it or by
    # its missing heartbeats (whichever a loaded machine lets come first), and ran them on the other instance
    gone = counters.get("gen_peer_gone", 0) + counters.get("rollouters_expired", 0)
    assert gone >= 1 and balance["counters"]["rerun_after_loss"] >= 1, \
        json.dumps(fault_run.coordinator_status, indent=1)
    # the restarted one is back: every instance started is routed (the balancer may have moved one to the other model)
    assert sum(len(insts) for insts in balance["instances"].values()) >= 2 * len(MODELS), balance


CASES = [*((kind, action) for kind in SERVICE_KINDS for action in ("kill", "stop")),
         ("nats", "kill"), ("nats", "stop"), ("cluster-node", "kill")]


@pytest.mark.full
@pytest.mark.parametrize(("target", "action"), CASES, ids=[f"{a}-{t}" for t, a in CASES])
async def test_one_fault_at_a_random_point(target, action, tmp_path, run_id, fault_table):
    rng = random.Random(f"{target}-{action}")
    max_versions = 30
    model = rng.choice(MODELS)
    at = rng.randint(4, 16)
    clustered = target == "cluster-node"
    broker = Broker.three(tmp_path / "nats") if clustered else Broker.single(tmp_path / "nats")
    if clustered:  # one node goes for good: the other two keep the quorum of every stream
        fault = Fault("nats", "kill", at, node=rng.randrange(3), down_s=-1)
    elif target == "nats":
        fault = Fault("nats", action, at, down_s=5.0 if action == "kill" else FREEZE_S)
    else:
        fault = Fault(target, action, at, model, down_s=5.0 if action == "kill" else FREEZE_S)
    try:
        config = fault_config(tmp_path, run_id, max_versions=max_versions, replicas=3 if clustered else 1)
        outcome = await FaultRun(tmp_path, run_id, broker, config, max_versions=max_versions,
                                 seed=at).run([fault])
    finally:
        broker.stop()
    name = f"{action} {target}" + (f" ({fault.model})" if fault.per_model else "")
    fault_table.append((name, outcome))
    print(table([(name, outcome)]))
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
