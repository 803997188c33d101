"""Every service started alone with `chorus serve` against an external nats-server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import Any

import nats

from shared.kernel.bus import kv_get_int
from shared.kernel.codec import decode
from shared.kernel.schemas import GenResponse, Sample
from shared.kernel.subjects import Names
from shared.launcher.supervisor import Supervisor
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import CHORUS, small_run_config
from tests.waits import wait_until

MODELS = ["solver_lm", "verifier_lm"]


async def wait_for_bucket(js, names: Names, cluster: Cluster, timeout_s: float = 180.0) -> Any:
    """The run's KV bucket, once a service created it (they do on start, after their imports: seconds on a loaded
    machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return await js.key_value(names.kv_bucket)
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError(f"no KV bucket {names.kv_bucket} within {timeout_s:.0f}s\n{cluster.logs()}")


async def wait_for_versions(kv, cluster: Cluster, target: int, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    versions: dict[str, int] = {}
    while time.monotonic() < deadline:
        versions = {m: await kv_get_int(kv, Names.trained_key(m)) for m in MODELS}
        if all(v >= target for v in versions.values()):
            return versions
        dead = cluster.dead()
        assert not dead, f"service died: {[p.key for p in dead]}\n{cluster.logs()}"
        await asyncio.sleep(0.5)
    raise AssertionError(f"versions {versions} did not reach {target} in {timeout_s}s\n{cluster.logs()}")


async def test_every_service_runs_alone_and_bad_messages_go_to_dlq(nats_url, run_id, tmp_path):
    """... and once the run has finished, `chorus status` says so at once, `chorus monitor` ends with it, and a
    service started with --exit-when-done exits 0 by itself."""
    cfg = small_run_config(tmp_path, run_id, max_versions=4, global_batch=8, micro_batch=8)
    names = Names(run_id)
    cluster = Cluster(cfg, nats_url, tmp_path / "logs")
    watcher = Supervisor(tmp_path / "watcher-logs")  # apart: the cluster's checks take no exit of it as a death
    nc = await nats.connect(nats_url)
    try:
        done_watch = watcher.start("actions-done", [CHORUS, "serve", "actions", "--config", str(cfg), "--nats",
                                                    nats_url, "--instance", "done", "--exit-when-done"])
        dlq: dict[str, list] = {"mq": [], "rollouter": []}

        def collector(svc: str):
            async def collect(msg) -> None:
                dlq[svc].append(msg)
            return collect

        for svc in dlq:
            await nc.subscribe(names.dlq(svc), cb=collector(svc))
        cluster.start_all(MODELS)
        js = nc.jetstream()
        kv = await wait_for_bucket(js, names, cluster)
        await wait_for_versions(kv, cluster, 1, 180)

        # Malformed messages on the data plane are rejected with a reason; nothing dies.
        await js.publish(names.traj("solver_lm"), b"\xc1 not msgpack", headers={"Nats-Msg-Id": "garbage-1"})
        reply = await nc.request(names.gen("verifier_lm"), b"\x93\x01\x02", timeout=30)
        assert decode(GenResponse, reply.data).error
        await wait_until(lambda: dlq["mq"] and dlq["rollouter"], "both DLQ messages", interval_s=0.1)
        assert dlq["mq"] and dlq["mq"][0].headers["Chorus-Reason"]
        assert dlq["rollouter"] and dlq["rollouter"][0].headers["Chorus-Reason"]

        # Every kind of service answers the NATS micro service API.
        pings: list[dict] = []
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.PING", b"", reply=inbox)
        t_end = time.monotonic() + 2
        while time.monotonic() < t_end:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:
                continue
            pings.append(json.loads(msg.data))
        kinds = {p["name"] for p in pings if p.get("metadata", {}).get("run") == run_id}
        assert kinds >= {f"chorus-{s}" for s in ("coordinator", "rollouter", "mq", "trainer", "paramsync", "actions")}

        await wait_for_versions(kv, cluster, 4, 180)
        served = {m: await kv_get_int(kv, names.version_key(m)) for m in MODELS}
        assert all(v >= 1 for v in served.values()), served

        code = await asyncio.to_thread(done_watch.popen.wait, 20)
        assert code == 0, f"--exit-when-done: exit {code}\n{done_watch.tail()}"
        t0 = time.monotonic()
        status = await asyncio.to_thread(subprocess.run, [CHORUS, "status", "--config", str(cfg), "--nats", nats_url],
                                         capture_output=True, text=True, timeout=60)
        print(f"chorus status of the finished run: {time.monotonic() - t0:.1f}s")
        assert status.returncode == 0, status.stderr
        assert f"run {run_id} finished" in status.stdout, status.stdout
        monitor = await asyncio.to_thread(subprocess.run, [CHORUS, "monitor", "--config", str(cfg), "--nats",
                                                           nats_url, "--duration-s", "60"],
                                          capture_output=True, text=True, timeout=90)
        assert monitor.returncode == 0 and f"run {run_id} finished" in monitor.stdout, monitor.stdout + monitor.stderr
        assert "monitor: " in monitor.stdout  # stdout is a pipe: summary lines, not a live table
    finally:
        await watcher.stop_all()
        codes = await cluster.stop_all()
        await nc.close()
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}\n{cluster.logs()}"


async def test_mq_killed_mid_run_loses_no_sample(nats_url, run_id, tmp_path):
    """SIGKILL mq mid-run and start it again: every published sample is trained or counted as dropped."""
    cfg = small_run_config(tmp_path, run_id, max_versions=10_000, global_batch=8, micro_batch=8, max_staleness=2)
    names = Names(run_id)
    cluster = Cluster(cfg, nats_url, tmp_path / "logs")
    nc = await nats.connect(nats_url)
    published: dict[str, set[str]] = {m: set() for m in MODELS}
    version_of: dict[str, int] = {}
    trained: dict[str, set[str]] = {m: set() for m in MODELS}
    dropped: dict[str, set[str]] = {m: set() for m in MODELS}
    staleness_violations: list[str] = []

    async def on_traj(msg) -> None:
        s = decode(Sample, msg.data)
        published[s.model].add(s.sample_id)
        version_of[s.sample_id] = s.version

    async def on_event(msg) -> None:
        ev = json.loads(msg.data)
        if ev.get("kind") == "step":
            trained[ev["model"]].update(ev["sample_ids"])
            for sid in ev["sample_ids"]:
                if sid in version_of and (ev["version"] - 1) - version_of[sid] > 2:
                    staleness_violations.append(sid)
        elif ev.get("kind") == "drop":
            dropped[ev["model"]].update(ev["sample_ids"])

    try:
        for m in MODELS:
            await nc.subscribe(names.traj(m), cb=on_traj)
        await nc.subscribe(names.events("trainer"), cb=on_event)
        await nc.subscribe(names.events("mq"), cb=on_event)
        cluster.start_all(MODELS)
        js = nc.jetstream()
        kv = await wait_for_bucket(js, names, cluster)
        await wait_for_versions(kv, cluster, 2, 180)

        cluster.kill("mq-solver_lm-0")
        await asyncio.sleep(3)  # samples keep arriving while mq is down
        cluster.start("mq", "solver_lm")
        before = await kv_get_int(kv, names.trained_key("solver_lm"))
        await wait_for_versions(kv, cluster, before + 3, 180)

        cluster.kill("coordinator-0", sig=15)  # graceful: no new samples after this
        for m in MODELS:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if published[m] <= trained[m] | dropped[m]:
                    break
                await asyncio.sleep(0.5)
        for m in MODELS:
            missing = published[m] - trained[m] - dropped[m]
            assert not missing, f"{m}: {len(missing)} of {len(published[m])} samples lost\n{cluster.logs()}"
            assert len(published[m]) > 0
        assert not staleness_violations
    finally:
        await cluster.stop_all()
        await nc.close()
