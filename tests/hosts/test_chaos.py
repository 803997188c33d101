"""`make chaos` (MINUTES=30, SEED=): continuous chaos on the five-host deployment (tests/hosts): every 10-40 s a
random SIGKILL, or SIGSTOP for a few seconds, of a random service process or NATS node, or a random short partition
(a host, or a NATS node's routes); at the end the ledger's invariants over the whole run, and the table of what was
done when (printed, and written to runs/chaos/report.md). `make test-long` runs it for five minutes.
CHAOS_DEPLOY=local runs it on one machine's processes and a three-node cluster on loopback instead (no partitions)."""

from __future__ import annotations

import os
import random

import pytest

from shared.launcher.natsserver import NatsCluster
from tests.conftest import ROOT
from tests.faults.chaos import ChaosRun, chaos_table
from tests.faults.harness import Broker, describe, fault_config
from tests.hosts.conftest import deploy
from tests.hosts.deployment import PLACEMENT

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]
UNBOUNDED = 100_000  # train.max_versions while the chaos lasts; the end sets the real one
# Tasks in flight (CHAOS_CONCURRENCY): chaos lasts its minutes however fast the run trains, so a run of two tasks at a
# time (every agent's rollouts of each still in flight when a fault lands) costs a quarter of the tiny run's CPU.
CONCURRENCY = int(os.environ.get("CHAOS_CONCURRENCY", "2"))


async def test_continuous_chaos_keeps_every_invariant(tmp_path, run_id):
    minutes = float(os.environ.get("CHAOS_MINUTES", "30"))
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    where = os.environ.get("CHAOS_DEPLOY", "hosts")
    print(f"chaos: {minutes:g} minutes, seed {seed} (CHAOS_SEED={seed} repeats the draw), on {where}, "
          f"{CONCURRENCY} tasks in flight")
    if where == "hosts":
        hosts = deploy(tmp_path, run_id, UNBOUNDED, concurrency=CONCURRENCY)
        try:
            run = ChaosRun(tmp_path, run_id, hosts.broker, hosts.config, max_versions=UNBOUNDED, seed=seed,
                           rollouters=2, cluster=hosts, ledger_url=hosts.observer_url,
                           ledger_options=hosts.ledger_options(), hosts=sorted(PLACEMENT),
                           routes={0: "h1", 1: "h2", 2: "h3"})
            outcome, chaos = await run.run_chaos(minutes)
        finally:
            hosts.close()
    else:
        cluster = NatsCluster(tmp_path / "nats", 3).start()
        broker = Broker(cluster.nodes, cluster)
        try:
            config = fault_config(tmp_path, run_id, max_versions=UNBOUNDED, replicas=3, concurrency=CONCURRENCY)
            run = ChaosRun(tmp_path, run_id, broker, config, max_versions=UNBOUNDED, seed=seed, rollouters=2)
            outcome, chaos = await run.run_chaos(minutes)
        finally:
            broker.stop()
    report = chaos_table(chaos, outcome)
    print(report)
    out = ROOT / "runs" / "chaos"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(f"seed {seed}, {minutes:g} minutes on {where}\n\n{report}\n")
    assert chaos.faults, "no fault was injected"
    assert not outcome.problems, describe(outcome)
