"""The three pipeline modes end to end, each service its own process: on-policy modes train every sample on
the weights that generated it; in async mode a stalled trainer neither blocks the other model nor grows mq."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import defaultdict
from typing import Any

import nats
import pytest
import yaml

from shared.kernel.bus import kv_get_int
from shared.kernel.codec import decode
from shared.kernel.schemas import MicroBatch, Sample
from shared.kernel.subjects import Names
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import small_run_config

MODELS = ["solver_lm", "verifier_lm"]


class Seen:
    """Sample versions from traj.<model>, trainer step events, mq drop events and depth reports."""

    def __init__(self) -> None:
        self.version_of: dict[str, int] = {}
        self.published_at: dict[str, float] = {}
        self.steps: list[dict[str, Any]] = []
        self.drops: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.held: dict[str, list[tuple[float, int]]] = defaultdict(list)  # (time, samples held by mq)
        self.batches: list[tuple[float, MicroBatch]] = []  # micro-batches as mq dispatched them

    async def attach(self, nc: Any, names: Names) -> None:
        async def on_traj(msg: Any) -> None:
            s = decode(Sample, msg.data)
            self.version_of[s.sample_id] = s.version
            self.published_at[s.sample_id] = time.monotonic()

        async def on_event(msg: Any) -> None:
            ev = json.loads(msg.data)
            if ev.get("kind") == "step":
                ev["seen_at"] = time.monotonic()
                self.steps.append(ev)
            elif ev.get("kind") == "drop":
                self.drops[ev["model"]].append(ev)

        async def on_mq_metrics(msg: Any) -> None:
            m = json.loads(msg.data)
            if isinstance(m.get("held"), int) and m.get("model"):
                self.held[m["model"]].append((time.monotonic(), m["held"]))

        async def on_ready(msg: Any) -> None:
            self.batches.append((time.monotonic(), decode(MicroBatch, msg.data)))

        for m in MODELS:
            await nc.subscribe(names.traj(m), cb=on_traj)
            await nc.subscribe(names.ready(m), cb=on_ready)
        await nc.subscribe(names.events("trainer"), cb=on_event)
        await nc.subscribe(names.events("mq"), cb=on_event)
        await nc.subscribe(names.metrics("mq", "*"), cb=on_mq_metrics)

    def staleness(self) -> list[tuple[str, int]]:
        """(sample id, trainer version at training - sample version) of every trained sample seen."""
        return [(sid, ev["version"] - 1 - self.version_of[sid]) for ev in self.steps for sid in ev["sample_ids"]
                if sid in self.version_of]


def config(tmp_path, run_id: str, **train: Any):
    path = small_run_config(tmp_path, run_id, max_versions=10_000, global_batch=8, micro_batch=8, **train)
    return path


async def kv_of(nc: Any, names: Names) -> Any:
    js = nc.jetstream()
    for _ in range(300):
        try:
            return await js.key_value(names.kv_bucket)
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError("the run's KV bucket never appeared")


async def versions(kv: Any) -> dict[str, int]:
    return {m: await kv_get_int(kv, Names.trained_key(m)) for m in MODELS}


async def wait_versions(kv: Any, cluster: Cluster, target: dict[str, int], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        got = await versions(kv)
        if all(got[m] >= v for m, v in target.items()):
            return got
        assert not cluster.dead(), f"a service died\n{cluster.logs()}"
        await asyncio.sleep(0.25)
    raise AssertionError(f"versions {got} did not reach {target} in {timeout_s}s\n{cluster.logs()}")


async def test_on_policy_modes_train_every_sample_at_staleness_zero(nats_url, run_id, tmp_path):
    """microbatch and sync: one optimizer step per global batch, every sample trained by the weights that made
    it; sync dispatches nothing of a batch before all of it is generated, microbatch trains while it is."""
    for mode in ("microbatch", "sync"):
        rid = f"{run_id}{mode[0]}"
        (tmp_path / mode).mkdir()
        cfg = small_run_config(tmp_path / mode, rid, mode=mode, max_staleness=0, max_versions=4,
                               global_batch=32, micro_batch=8)
        names = Names(rid)
        cluster = Cluster(cfg, nats_url, tmp_path / mode / "logs")
        nc = await nats.connect(nats_url)
        seen = Seen()
        await seen.attach(nc, names)
        try:
            cluster.start_all(MODELS)
            kv = await kv_of(nc, names)
            await wait_versions(kv, cluster, dict.fromkeys(MODELS, 4), 240)
        finally:
            await cluster.stop_all()
            await nc.close()
        stale = seen.staleness()
        assert stale and all(s == 0 for _, s in stale), (mode, [x for x in stale if x[1]][:5])
        overlapped = 0
        for m in MODELS:
            steps = [ev for ev in seen.steps if ev["model"] == m]
            assert [ev["version"] for ev in steps][:4] == [1, 2, 3, 4], (mode, m)
            assert all(ev["samples"] == 32 and ev["staleness_max"] == 0 for ev in steps[:4]), (mode, m)
            for ev in steps[:4]:
                batch = set(ev["sample_ids"])
                last_published = max(seen.published_at[sid] for sid in batch)
                first_dispatched = min(t for t, mb in seen.batches
                                       if mb.model == m and batch & {s.sample_id for s in mb.samples})
                overlapped += first_dispatched < last_published
        if mode == "sync":
            assert overlapped == 0  # the barrier: no micro-batch leaves mq before its whole batch is generated
        else:
            assert overlapped > 0  # training started while the rest of the batch was still generating


@pytest.mark.full  # in make test-long (CI), out of make test's 20 minutes
async def test_async_a_stalled_trainer_holds_back_neither_the_other_model_nor_memory(nats_url, run_id, tmp_path):
    cfg = config(tmp_path, run_id, mode="async", max_staleness=2)
    raw = yaml.safe_load(cfg.read_text())
    raw["mq"] = {"capacity": 32, "max_ready_msgs": 2, "report_interval_s": 0.25}
    cfg.write_text(yaml.safe_dump(raw))
    names = Names(run_id)
    cluster = Cluster(cfg, nats_url, tmp_path / "logs")
    nc = await nats.connect(nats_url)
    seen = Seen()
    await seen.attach(nc, names)
    try:
        cluster.start_all(MODELS)
        kv = await kv_of(nc, names)
        await wait_versions(kv, cluster, dict.fromkeys(MODELS, 2), 180)

        cluster.sup.children["trainer-verifier_lm-0"].popen.send_signal(signal.SIGSTOP)
        stalled_at = await versions(kv)
        t_stop = time.monotonic()
        # The solver's model keeps training at its own pace while the verifier's trainer is frozen.
        await wait_versions(kv, cluster, {"solver_lm": stalled_at["solver_lm"] + 15}, 180)
        during = await versions(kv)
        assert during["verifier_lm"] == stalled_at["verifier_lm"]
        await asyncio.sleep(2.0)  # a few more depth reports with the trainer frozen
        held = [h for t, h in seen.held["verifier_lm"] if t > t_stop]
        assert held and max(held) <= 32 + 2 * 8, max(held)  # capacity plus one task's samples in flight
        shed = [d for d in seen.drops["verifier_lm"] if d["reason"] in ("overflow", "stale", "group_dropped")]
        assert sum(d["count"] for d in shed) > 0

        cluster.sup.children["trainer-verifier_lm-0"].popen.send_signal(signal.SIGCONT)
        await wait_versions(kv, cluster, {"verifier_lm": stalled_at["verifier_lm"] + 3}, 120)
    finally:
        child = cluster.sup.children.get("trainer-verifier_lm-0")
        if child is not None and child.alive():
            child.popen.send_signal(signal.SIGCONT)
        await cluster.stop_all()
        await nc.close()
    stale = seen.staleness()
    assert stale and max(s for _, s in stale) <= 2, [x for x in stale if x[1] > 2][:5]
