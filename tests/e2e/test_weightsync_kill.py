"""A rollouter killed in the middle of a UCX weight transfer: the others load, only then is the version served.

Trainer, paramsync and three rollouters of one model run as separate processes (`chorus serve`); the
weights travel over real UCX endpoints between them (shared memory on loopback).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from shared.kernel.bus import kv_get_int
from shared.kernel.codec import decode, encode
from shared.kernel.schemas import (
    Array,
    GenRequest,
    GenResponse,
    RolloutControl,
    RolloutControlReply,
    SyncDone,
    WeightsPull,
)
from shared.kernel.subjects import Names
from shared.models.tokenizer import BOS_ID
from tests.e2e.cluster import Cluster
from tests.integration.test_trainer import publish_batch

MODEL = "m"
VICTIM = "2"


def write_config(tmp_path: Path, run_id: str) -> Path:
    cfg = {
        "run": {"id": run_id, "dir": str(tmp_path / "runs")},
        # about 67 MB of float32 weights in 4 MB buckets: a transfer lasts long enough (tens of ms) for the
        # victim to be frozen in the middle of it
        "models": {MODEL: {"arch": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 2048,
                                    "max_position": 64}, "optim": {"lr": 0.01}, "rollouter": {"batch_window_ms": 1}}},
        "agents": {"solver": {"model": MODEL}, "verifier": {"model": MODEL}},
        "workflow": {"group_size": 4},
        "train": {"global_batch": 8, "micro_batch": 4, "max_staleness": 0, "checkpoint_every": 0, "ack_wait_s": 30},
        "paramsync": {"transport": "ucx", "bucket_mb": 4, "pause_timeout_s": 3, "load_timeout_s": 4},
        "metrics_interval_s": 0.3,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def info(nc: Any, names: Names, instance: str) -> RolloutControlReply:
    msg = await nc.request(names.rollout_control(MODEL, instance, "info"), encode(RolloutControl(verb="info")),
                           timeout=5)
    return decode(RolloutControlReply, msg.data)


@pytest.mark.ucx
async def test_a_rollouter_killed_mid_transfer_is_dropped_and_the_version_waits_for_the_live_ones(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    names = Names(run_id)
    cluster = Cluster(write_config(tmp_path, run_id), nats_url, tmp_path / "logs")
    nc = await nats.connect(nats_url)
    killed: dict[str, float] = {}
    at_commit: dict[str, int] = {}
    trainer_metrics: list[dict[str, Any]] = []
    victim_pid = 0

    async def on_pull(msg: Any) -> None:
        pull = decode(WeightsPull, msg.data)
        if pull.instance == VICTIM and pull.version == 1 and not killed:
            # Freeze it as its transfer starts (the trainer's sends of its buckets cannot complete), then kill it.
            os.kill(victim_pid, signal.SIGSTOP)
            killed["at"] = time.monotonic()
            await asyncio.sleep(0.3)
            os.kill(victim_pid, signal.SIGKILL)

    async def on_trainer_metrics(msg: Any) -> None:
        trainer_metrics.append(json.loads(msg.data))

    try:
        await nc.subscribe(names.metrics("trainer", f"{MODEL}-0"), cb=on_trainer_metrics)
        cluster.start("trainer", MODEL)
        cluster.start("paramsync", MODEL)
        for i in range(3):
            cluster.start("rollouter", MODEL, str(i))
        victim_pid = cluster.sup.children[f"rollouter-{MODEL}-{VICTIM}"].popen.pid
        js = nc.jetstream()
        kv = None
        for _ in range(600):
            try:
                kv = await js.key_value(names.kv_bucket)
                keys = [k async for k in _keys(kv, names.rollouter_prefix(MODEL))]
                if len(keys) == 3 and any(m.get("weights") is not None for m in trainer_metrics):
                    break
            except Exception:
                pass
            assert not cluster.dead(), cluster.logs()
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"services did not start\n{cluster.logs()}")
        assert kv is not None
        await nc.subscribe(names.weights_pull(MODEL), cb=on_pull)
        done_sub = await nc.subscribe(names.sync_done(MODEL))

        async def watch_version() -> None:
            watcher = await kv.watch(names.version_key(MODEL))
            while True:
                entry = await watcher.updates(timeout=120)
                if entry is not None and entry.value and int(entry.value) == 1:
                    # the moment v1 is served: what do the live instances hold?
                    for i in ("0", "1"):
                        at_commit[i] = (await info(nc, names, i)).version
                    return

        watching = asyncio.create_task(watch_version())
        await asyncio.sleep(0.5)
        for key in ("a", "b"):  # one global batch: the trainer steps to v1 and offers it over UCX
            await publish_batch(js, names, run_id, key, 0)

        done = None
        while done is None or done.version < 1:
            done = decode(SyncDone, (await done_sub.next_msg(timeout=60)).data)
        assert killed, f"the victim never pulled v1\n{cluster.logs()}"
        assert done.version == 1 and done.loaded == ["0", "1"], (done, cluster.logs())
        assert VICTIM in done.failed, done
        await asyncio.wait_for(watching, 10)
        assert at_commit == {"0": 1, "1": 1}  # the version moved only once the live instances had loaded it
        assert await kv_get_int(kv, names.version_key(MODEL)) == 1
        assert not cluster.sup.children[f"rollouter-{MODEL}-{VICTIM}"].alive()
        assert cluster.sup.children[f"trainer-{MODEL}-0"].alive(), cluster.logs()

        # the killed instance is out of routing: requests are answered by the live ones, on v1
        for i in range(8):
            req = GenRequest(request_id=f"r{i}", prompts=[Array.of([BOS_ID, 49, 43, 50], "int32")],
                             max_new_tokens=4)
            resp = decode(GenResponse, (await nc.request(names.gen(MODEL), encode(req), timeout=20)).data)
            assert resp.error is None and resp.instance in ("0", "1") and resp.version == 1
        # and out of the next sync: its stale registration was dropped
        keys = sorted([k async for k in _keys(kv, names.rollouter_prefix(MODEL))])
        assert keys == [names.rollouter_key(MODEL, "0"), names.rollouter_key(MODEL, "1")]
        for key in ("c", "d"):
            await publish_batch(js, names, run_id, key, 1)
        # paramsync may sync v1 once more from the commit point (idempotent) before v2: wait for v2
        while done.version < 2:
            done = decode(SyncDone, (await done_sub.next_msg(timeout=60)).data)
        assert done.version == 2 and done.loaded == ["0", "1"] and done.failed == {}
        # the trainer's sends to the frozen instance failed (it was killed mid-transfer) and did not hurt it
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            weights = trainer_metrics[-1].get("weights", {})
            if weights.get("pull_failures", 0) >= 1 and weights.get("pulls", 0) >= 4:
                break
            await asyncio.sleep(0.3)
        assert weights.get("pull_failures", 0) >= 1 and weights.get("pulls", 0) >= 4, weights
    finally:
        codes = await cluster.stop_all()
        await nc.close()
    assert all(c == 0 for k, c in codes.items() if VICTIM not in k.rsplit("-", 1)[-1]), (codes, cluster.logs())


async def _keys(kv: Any, prefix: str):  # noqa: ANN202 - async generator
    watcher = await kv.watch(f"{prefix}*", ignore_deletes=True, meta_only=True)
    try:
        while True:
            entry = await watcher.updates(timeout=5)
            if entry is None:
                return
            yield entry.key
    finally:
        await watcher.stop()
