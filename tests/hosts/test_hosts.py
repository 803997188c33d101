"""The tiny run deployed on five hosts (network namespaces on one bridge) as deploy/systemd/ deploys it: the three-node
TLS NATS cluster of deploy/nats/ on three of them, every service from its unit's command and /etc/chorus/chorus.env,
each kind with its own password; then the network partitions of a real deployment, each on its own run, and the
ledger's invariants after each (tests/faults/ledger.py, watched from the machine's own namespace)."""

from __future__ import annotations

import contextlib
import time

import nats
import pytest

from shared.kernel.codec import DecodeError, decode
from shared.kernel.schemas import GenRequest, GenResponse
from shared.kernel.subjects import Names
from tests.faults.harness import HOST, Fault, FaultRun, describe, table
from tests.hosts.deployment import MODELS, PLACEMENT, HostDeployment
from tests.waits import wait_until

pytestmark = [pytest.mark.hosts, pytest.mark.e2e]
VERSIONS = 40
CUT_VERSIONS = 80  # the run goes on through a cut of 20 to 30 s, and on past the heal
CUT = pytest.mark.parametrize("hosts", [CUT_VERSIONS], indirect=True, ids=[f"{CUT_VERSIONS}-versions"])


def fault_run(hosts: HostDeployment, run_id: str, versions: int = VERSIONS) -> FaultRun:
    return FaultRun(hosts.tmp, run_id, hosts.broker, hosts.config, max_versions=versions, rollouters=2,  # type: ignore[arg-type]
                    cluster=hosts, ledger_url=hosts.observer_url, ledger_options=hosts.ledger_options())


def assert_held(outcome, fault_table, name: str) -> None:  # noqa: ANN001
    fault_table.append((name, outcome))
    print(table([(name, outcome)]))
    assert not outcome.problems, describe(outcome)
    assert not outcome.unexpected_exits, describe(outcome)
    for r in outcome.reports.values():
        assert r.trained > 0 and r.published > 0


async def test_the_tiny_run_finishes_across_five_hosts_with_tls_and_a_password_per_kind(hosts, run_id, fault_table):
    run = fault_run(hosts, run_id)
    outcome = await run.run([])
    assert_held(outcome, fault_table, "the tiny run on five hosts")
    # every service ran on its own host, through its unit, as its kind
    assert {hosts.host_of(k) for k in hosts.sup.children if k in hosts.where} == set(PLACEMENT)
    logs = hosts.logs(lines=400)
    assert "permission denied" not in logs and "nats refused this client's credentials" not in logs
    assert '"auth": "user actions, TLS"' in logs and '"auth": "user trainer, TLS"' in logs
    assert run.coordinator_status["balance"]["instances"].keys() == set(MODELS)


async def run_cut(hosts: HostDeployment, run_id: str, fault: Fault, fault_table, name: str):  # noqa: ANN001
    run = fault_run(hosts, run_id, CUT_VERSIONS)
    outcome = await run.run([fault])
    assert_held(outcome, fault_table, name)
    print("cut:", fault.name, "at", fault.landed_at, "healed at", fault.healed_at, "back after", fault.recovered_s)
    return run, outcome


@CUT
async def test_a_nats_node_cut_off_from_the_other_two_for_30_s(hosts, run_id, fault_table):
    # nats-3's routes (6222) dropped both ways: its clients stay connected to it, but it is in the minority; the
    # majority keeps every stream's quorum (replicas 3), and the node catches up once healed.
    fault = Fault(HOST, "cut", 8, host="h3", port=6222, down_s=30.0)
    run, _ = await run_cut(hosts, run_id, fault, fault_table, "a NATS node's routes cut for 30 s")
    assert all(fault.healed_at[m] > fault.landed_at[m] for m in MODELS), (fault.landed_at, fault.healed_at)
    await run.ledger.start()
    try:
        js = run.ledger.nc.jetstream(timeout=10)

        async def caught_up() -> bool:
            for stream in Names(run_id).streams(MODELS):
                replicas = (await js.stream_info(stream)).cluster.replicas or []
                if len(replicas) != 2 or not all(r.current for r in replicas):
                    return False
            return True

        await wait_until(caught_up, "every stream's replicas current again, nats-3's included")
    finally:
        await run.ledger.close()


@CUT
async def test_a_rollouters_host_cut_off_is_worked_around_and_rejoins_only_with_the_served_weights(
        hosts, run_id, fault_table):
    # h4 holds the second instance of both models; the cut lands while solver_lm's has requests in flight.
    fault = Fault(HOST, "cut", 8, "solver_lm", instance="1", host="h4", down_s=20.0, when="rollouter")
    replies: list[tuple[float, str, str, int]] = []  # (time, model, instance, version) of every generation reply
    watch = await nats.connect(hosts.observer_url.split(","), max_reconnect_attempts=-1, **hosts.ledger_options())

    async def on_reply(msg) -> None:  # noqa: ANN001 - the coordinator's replies, read off its inbox
        with contextlib.suppress(DecodeError):
            if msg.data:
                r = decode(GenResponse, msg.data)
                if r.instance and not r.error:
                    replies.append((time.time(), r.request_id, r.instance, r.version))

    requested: dict[str, float] = {}  # request id -> when it was first sent

    async def on_request(msg) -> None:  # noqa: ANN001
        with contextlib.suppress(DecodeError):
            requested.setdefault(decode(GenRequest, msg.data).request_id, time.time())

    await watch.subscribe("_INBOX.coordinator.>", cb=on_reply)
    for pattern in (f"chorus.{run_id}.rollout.*.gen", f"chorus.{run_id}.rollout.*.*.gen"):
        await watch.subscribe(pattern, cb=on_request)
    try:
        run, _ = await run_cut(hosts, run_id, fault, fault_table, "a rollouter's host cut off for 20 s")
    finally:
        await watch.close()
    counters = run.coordinator_status["counters"]
    balance = run.coordinator_status["balance"]
    assert counters.get("gen_peer_gone", 0) + counters.get("rollouters_expired", 0) >= 1, counters
    assert balance["counters"]["rerun_after_loss"] >= 1, balance  # its requests ran again on the other instance
    assert all("1" in balance["instances"][m] for m in MODELS), balance  # both back in routing
    # once back, never in routing below the served version of that moment
    await run.ledger.start()
    try:
        records = await run.ledger.records()
    finally:
        await run.ledger.close()
    joins = [r for r in records if r.get("kind") == "routing" and r.get("routing")
             and r.get("instance") == "1" and float(r.get("time") or 0) > fault.cut_at]
    assert joins, "the cut-off instances never joined routing again"
    for j in joins:
        assert j["version"] >= run.ledger.served_before(j["model"], float(j["time"]) - 1.0), (j, run.ledger.served_at)
    # and no answer from it to a request sent once healed with weights older than both models' served a second
    # before (a reply does not name its model; the two move in step, and weights from before the cut would be far
    # behind). A late reply to a request from before the cut, flushed on reconnecting, is one the coordinator
    # already ran elsewhere.
    healed = fault.cut_at + fault.down_s
    after = [(t, rid, v) for t, rid, inst, v in replies if inst == "1" and requested.get(rid, 0.0) > healed]
    assert after, "the healed instances answered nothing"
    stale = [(t, rid, v) for t, rid, v in after if v < min(run.ledger.served_before(m, t - 1.0) for m in MODELS)]
    assert not stale, stale[:5]


@CUT
async def test_the_trainers_host_cut_off_mid_commit_commits_no_version_twice(hosts, run_id, fault_table):
    # h2 (solver_lm's trainer, a rollouter, nats-2) cut off while the trainer is between its step and its commit
    # point: the ledger's invariants say no version was committed twice, no sample trained twice, none went back.
    fault = Fault(HOST, "cut", 8, "solver_lm", host="h2", down_s=20.0, when="committing")
    await run_cut(hosts, run_id, fault, fault_table, "the trainer's host cut off mid-commit for 20 s")
    # it was cut between the step and the commit point: committing the version after the one last committed. The
    # ledger reads trained versions from step records, which may be written before their commit point lands, so
    # the version being committed is the last one the ledger saw or the one after it.
    landed = fault.landed_at["solver_lm"]
    assert fault.busy in (f"committing={landed}", f"committing={landed + 1}"), (fault.busy, fault.landed_at)


@CUT
async def test_the_coordinators_host_cut_off_resumes_its_episodes_when_healed(hosts, run_id, fault_table):
    fault = Fault(HOST, "cut", 8, host="h5", down_s=20.0)
    run, outcome = await run_cut(hosts, run_id, fault, fault_table, "the coordinator's host cut off for 20 s")
    assert "coordinator-0" not in " ".join(outcome.unexpected_exits)  # the same process went on
    counters = run.coordinator_status["counters"]
    print("coordinator counters:", counters)
    # its episodes waited out the cut (and, at the start, the rollouters loading) instead of spending their
    # attempts on it: every task it started was done, none given up, none failed
    assert counters.get("tasks_abandoned", 0) == 0 and counters.get("tasks_failed", 0) == 0, counters
