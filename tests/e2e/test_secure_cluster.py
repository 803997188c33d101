"""A tiny two-model run on a three-node NATS cluster with TLS and the shipped least-privilege authorization config."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
import structlog

from shared.kernel.bus import connect, ensure_run, kv_get_int
from shared.kernel.config import load_config
from shared.kernel.credentials import KINDS, password_env
from shared.kernel.runbus import run_exists
from shared.kernel.service import Service
from shared.kernel.subjects import SERVICES, Names
from shared.launcher.natsserver import NatsCluster
from tests.conftest import ROOT
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import small_run_config
from tests.natstls import make_tls
from tests.waits import wait_until

MODELS = ["solver_lm", "verifier_lm"]
AUTH = ROOT / "deploy" / "nats" / "auth.conf"


@pytest.fixture
def secure_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsCluster]:
    """Three routed nodes on loopback tagged `chorus`, TLS for clients and routes, deploy/nats/auth.conf with a test
    password per kind in the environment (the servers and every client read the same variables)."""
    for kind in KINDS:
        monkeypatch.setenv(password_env(kind), f"test-{kind}-secret")
    cluster = NatsCluster(tmp_path / "nats", 3, tls=make_tls(tmp_path / "tls"), include=AUTH, tags=("chorus",))
    cluster.start()
    yield cluster
    cluster.stop()


async def wait_trained(kv, cluster: Cluster, target: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all([await kv_get_int(kv, Names.trained_key(m)) >= target for m in MODELS]):
            return
        assert not cluster.dead(), f"a service died\n{cluster.logs()}"
        await asyncio.sleep(0.5)
    raise AssertionError(f"the models did not reach version {target} in {timeout_s} s\n{cluster.logs()}")


class Intruder(Service):
    """A trainer-kind service (the trainer's credentials) that publishes where only the coordinator may."""

    name = "trainer"
    per_model = True


async def test_run_completes_on_a_tls_cluster_with_per_kind_credentials_and_denials_are_counted(
        secure_cluster, run_id, tmp_path):
    tls = secure_cluster.nodes[0].tls
    assert tls is not None and secure_cluster.url.startswith("tls://")
    nats_section = {"replicas": 3, "placement_tags": ["chorus"], "max_age_s": 3600, "user": "{service}",
                    "tls_ca": str(tls.ca)}
    config = small_run_config(tmp_path, run_id, sections={"nats": nats_section}, max_versions=2, global_batch=8,
                              micro_batch=8)
    cfg = load_config(config)
    # Every service's metrics as the run goes, through an observer's own credentials.
    counters: dict[str, dict[str, int]] = {}

    async def on_metrics(msg) -> None:
        m = json.loads(msg.data)
        counters[msg.subject.split(".", 3)[3]] = m["counters"]

    observer = await connect(secure_cluster.url, "test-observer", nats_cfg=cfg.nats, kind="observer")
    await observer.subscribe(f"chorus.{run_id}.metrics.>", cb=on_metrics)
    names = Names(run_id)
    # What `chorus up` does first, as the supervisor: check that the run id is new, create the run.
    supervisor = await connect(secure_cluster.url, "test-supervisor", nats_cfg=cfg.nats, kind="supervisor")
    for _ in range(100):  # the cluster elects its JetStream meta leader after it starts
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await supervisor.jetstream(timeout=1.0).account_info()
            break
        await asyncio.sleep(0.2)
    assert not await run_exists(supervisor.jetstream(timeout=10.0), run_id)
    await ensure_run(supervisor.jetstream(timeout=10.0), cfg)
    assert await run_exists(supervisor.jetstream(timeout=10.0), run_id)
    await supervisor.close()

    # Every service as its own process (`chorus serve <kind>`), each connecting as its kind's user.
    cluster = Cluster(config, secure_cluster.url, tmp_path / "logs")
    admin = await connect(secure_cluster.url, "test-admin", nats_cfg=cfg.nats, kind="admin")
    js = admin.jetstream(timeout=10.0)
    try:
        cluster.start_all(MODELS)
        kv = await js.key_value(names.kv_bucket)
        await wait_trained(kv, cluster, 2, 180)
    finally:
        await cluster.stop_all()

    # The run's state is replicated on the three nodes, placed on the tagged servers.
    for stream in names.streams(MODELS):
        info = await js.stream_info(stream)
        assert info.config.num_replicas == 3, stream
        assert info.config.placement is not None and info.config.placement.tags == ["chorus"], stream
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2, stream
    assert (await js.stream_info(names.events_stream())).config.max_age == 3600
    # Every service kind took part with its own user (MARFT's critic runs only with train.loss marft), and none was
    # refused anything.
    assert {key.split(".")[0] for key in counters} == set(SERVICES) - {"critic"}, counters
    assert not {k: c for k, c in counters.items() if c.get("permission_denied")}, counters

    # A service publishing outside its permissions: denied by the server, logged and counted, and it lives on.
    intruder = Intruder(cfg, nats_url=secure_cluster.url, model=MODELS[0], instance="intruder")
    await intruder.start()
    last_seq = (await js.stream_info(names.traj_stream(MODELS[0]))).state.last_seq
    try:
        with structlog.testing.capture_logs() as logs:
            await intruder.publish_quietly(names.traj(MODELS[0]), b"forged sample")
            await intruder.nc.flush()
            await wait_until(lambda: intruder.counters["permission_denied"], "the refusal counted", interval_s=0.1)
        assert intruder.counters["permission_denied"] == 1
        assert intruder.counters["permission_denied_publish"] == 1
        assert {"event": "nats permission denied", "operation": "publish", "subject": names.traj(MODELS[0]),
                "kind": "trainer"}.items() <= next(e for e in logs if e["event"] == "nats permission denied").items()
        assert (await js.stream_info(names.traj_stream(MODELS[0]))).state.last_seq == last_seq  # nothing got in
        # still connected, and its metrics (its status endpoint, asked by the observer) carry the count
        assert intruder.nc.is_connected
        status = await observer.request(intruder.status_subject, b"", timeout=5.0)
        assert json.loads(status.data)["counters"]["permission_denied"] == 1
    finally:
        intruder.stop()
        await intruder._close()
        await observer.close()
        await admin.close()

    # `chorus status` reads the run as an observer; `chorus clean` removes it from the three nodes as admin.
    from shared.launcher.cli import _clean, _status

    assert await _status(cfg, secure_cluster.url) is not None
    removed = await _clean(cfg, secure_cluster.url, run_id)
    assert sorted(removed) == sorted(names.streams(MODELS))
    assert await _clean(cfg, secure_cluster.url, run_id) == []
