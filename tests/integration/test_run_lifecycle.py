"""A run's footprint on the server: `chorus up` refuses an existing run id, `chorus clean` removes a run; the
embedded server listens on loopback only; the shipped server configs are valid."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nats
import pytest
import yaml

from shared.kernel.bus import ensure_run
from shared.kernel.config import load_config
from shared.kernel.credentials import KINDS, password_env
from shared.kernel.subjects import Names
from shared.launcher.natsserver import NatsServer, free_port, nats_server_binary
from tests.conftest import ROOT
from tests.natstls import make_tls
from tests.waits import connect

CHORUS = str(Path(sys.executable).parent / "chorus")


def _config(tmp_path: Path, run_id: str, url: str) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs")}
    cfg["nats"] = {"url": url, "max_age_s": 600}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _chorus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHORUS, *args], capture_output=True, text=True, timeout=60, env={**os.environ})


async def test_up_refuses_an_existing_run_id_and_clean_removes_the_run(nats_url, run_id, tmp_path):
    config = _config(tmp_path, run_id, nats_url)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_run(js, load_config(config))  # the run exists: its services created it
        assert (await js.stream_info(names.events_stream())).config.max_age == 600

        up = _chorus("up", str(config), "--run", run_id, "--timeout-s", "30")
        assert up.returncode == 1, up.stdout + up.stderr
        assert f"run {run_id} already exists on the NATS server" in up.stdout and "--resume" in up.stdout
        assert not (tmp_path / "runs" / run_id / "logs").exists()  # no service was started
        assert not (tmp_path / "runs" / run_id / "config.yaml").exists()  # a run's config.yaml is never replaced
        assert (await js.stream_info(names.events_stream())).state.messages == 0  # nothing of it was touched

        clean = _chorus("clean", run_id, "--config", str(config))
        assert clean.returncode == 0, clean.stdout + clean.stderr
        removed = re.findall(r"^removed (.+)$", clean.stdout, re.MULTILINE)
        assert sorted(removed) == sorted([f"KV bucket {names.kv_bucket}", f"object store {names.obj_bucket}",
                                          *(f"stream {s}" for s in names.streams(["solver_lm", "verifier_lm"])
                                            if not s.startswith(("KV_", "OBJ_")))]), clean.stdout
        assert {s.config.name for s in await js.streams_info()}.isdisjoint(names.streams(["solver_lm", "verifier_lm"]))

        again = _chorus("clean", run_id, "--config", str(config))
        assert again.returncode == 1 and f"run {run_id} has no stream or bucket" in again.stderr
    finally:
        await nc.close()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, /proc/net/tcp{,6}) of the sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                out.append(local.rsplit(":", 1)[0])
    return out


def test_the_embedded_server_listens_on_loopback_only(tmp_path):
    server = NatsServer(tmp_path / "nats", monitor_port=free_port()).start()
    try:
        assert server.monitor_port is not None
        for port in (server.port, server.monitor_port):
            assert _listening(port) == ["0100007F"], port  # 127.0.0.1, nothing on 0.0.0.0 or ::
    finally:
        server.stop()


def test_the_shipped_cluster_and_single_node_configs_are_valid(tmp_path, monkeypatch):
    """deploy/nats/*.conf with the certificate and store paths moved into tmp_path: nats-server -t accepts each."""
    make_tls(tmp_path / "tls")  # the file names of deploy/nats: ca.pem, server.pem, server-key.pem
    conf = tmp_path / "conf"
    conf.mkdir()
    for f in (ROOT / "deploy" / "nats").glob("*.conf"):
        text = f.read_text().replace("/etc/nats/tls/", f"{tmp_path}/tls/").replace("/var/lib/nats/", f"{tmp_path}/")
        (conf / f.name).write_text(text)
    for kind in KINDS:
        monkeypatch.setenv(password_env(kind), f"test-{kind}")
    for name in ("nats-1.conf", "nats-2.conf", "nats-3.conf", "single.conf"):
        check = subprocess.run([nats_server_binary(), "-t", "-c", str(conf / name)], capture_output=True, text=True,
                               timeout=30, env={**os.environ})
        assert check.returncode == 0 and "is valid" in check.stdout + check.stderr, (name, check.stderr)
    monkeypatch.delenv(password_env("trainer"))  # a missing password stops the server, never an open user
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(conf / "nats-1.conf")], capture_output=True,
                           text=True, timeout=30, env={**os.environ})
    assert check.returncode != 0 and password_env("trainer") in check.stderr + check.stdout


@pytest.mark.parametrize("sync_always", [False, True])
async def test_nats_sync_always_creates_the_runs_streams_on_a_server_that_fsyncs_every_write(tmp_path, sync_always):
    """nats.sync_always: the embedded server runs with JetStream's sync_interval: always (its /varz says so), the
    run's streams are created on it and take acknowledged writes."""
    import json
    import urllib.request

    p = tmp_path / "c.yaml"
    p.write_text(f"run: {{id: dur, dir: {tmp_path}}}\nnats: {{sync_always: {str(sync_always).lower()}}}\n"
                 "models: {a: {}}\nagents: {solver: {model: a}, verifier: {model: a}}\n")
    cfg = load_config(p)
    assert cfg.nats.sync_always is sync_always
    server = NatsServer(tmp_path / "nats", monitor_port=free_port(), sync_always=cfg.nats.sync_always).start()
    try:
        nc = await connect(server.url)
        try:
            js = nc.jetstream(timeout=10)
            await ensure_run(js, cfg)
            names = Names("dur")
            info = await js.stream_info(names.traj_stream("a"))
            assert str(getattr(info.config.storage, "value", info.config.storage)) == "file"
            ack = await js.publish(names.traj("a"), b"sample", headers={"Nats-Msg-Id": "s1"})
            assert ack.seq == 1
        finally:
            await nc.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz", timeout=10) as r:
            varz = json.loads(r.read())
        assert varz["jetstream"]["config"].get("sync_always", False) is sync_always
    finally:
        server.stop()
