"""The mq service against a real nats-server: grouping, staleness drops, DLQ, restart without loss."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.mq.service import MqService
from shared.kernel.bus import fetch, kv_get_int, kv_put_int_max, pull_consumer
from shared.kernel.codec import decode, encode
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, MicroBatch, Sample
from shared.kernel.subjects import Names
from tests.waits import wait_until

MODEL = "m"
GROUP = 2  # samples per group; micro_batch 4 -> 2 groups per micro-batch


def make_cfg(tmp_path: Path, run_id: str, max_ready_msgs: int = 256) -> ChorusConfig:
    p = tmp_path / "run.yaml"
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\n"
        "models: {m: {}}\n"
        "agents: {solver: {model: m}, verifier: {model: m}}\n"
        f"workflow: {{group_size: {GROUP}}}\n"
        "train: {global_batch: 4, micro_batch: 4, max_staleness: 1}\n"
        f"mq: {{report_interval_s: 0.1, capacity: 64, max_ready_msgs: {max_ready_msgs}}}\n"
        "metrics_interval_s: 0.2\n"
    )
    return load_config(p)


def sample(run_id: str, key: str, i: int, version: int = 0, agent: str = "solver") -> Sample:
    return Sample(
        run=run_id, episode=key, sample_id=Sample.make_id(key, 0, i), env_idx=0, rollout_idx=i, agent=agent,
        model=MODEL, turn=0, prompt_ids=Array.of([257, 49, 43, 49]), response_ids=Array.of([50, 258]),
        behavior_logprobs=Array.of([-0.3, -0.1], "float32"), reward=float(i), group_key=f"{key}:{agent}:0",
        group_size=GROUP, version=version,
    )


@asynccontextmanager
async def running_mq(cfg: ChorusConfig, nats_url: str) -> AsyncIterator[MqService]:
    svc = MqService(cfg, nats_url=nats_url, model=MODEL)
    task = asyncio.create_task(svc.serve())
    await wait_until(lambda: getattr(svc, "sub", None) is not None or task.done(), "mq started", interval_s=0.02)
    assert not task.done(), "mq failed to start"
    try:
        yield svc
    finally:
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


@asynccontextmanager
async def client(nats_url: str) -> AsyncIterator[tuple[NATS, JetStreamContext]]:
    nc = await nats.connect(nats_url)
    try:
        yield nc, nc.jetstream(timeout=5)
    finally:
        await nc.drain()


async def send(js: JetStreamContext, names: Names, samples: list[Sample], msg_id_suffix: str = "") -> None:
    await asyncio.gather(*(
        js.publish(names.traj(MODEL), encode(s), headers={"Nats-Msg-Id": s.sample_id + msg_id_suffix})
        for s in samples
    ))


class Ready:
    """Reads micro-batches off the ready stream as the trainer would (its durable), acking them."""

    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self.js, self.names = js, names
        self.batches: list[tuple[MicroBatch, str]] = []

    async def start(self) -> Ready:
        self.sub = await pull_consumer(self.js, stream=self.names.ready_stream(MODEL), subject=self.names.ready(MODEL),
                                       durable=self.names.trainer_consumer(MODEL), ack_wait_s=30, max_ack_pending=100)
        return self

    async def until(self, n_batches: int, timeout: float = 60.0) -> list[tuple[MicroBatch, str]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.batches) < n_batches and loop.time() < deadline:
            for msg in await fetch(self.sub, 10, 0.2):
                self.batches.append((decode(MicroBatch, msg.data), msg.headers["Nats-Msg-Id"]))
                await msg.ack()
        return self.batches


class Events:
    """Collects mq drop events."""

    def __init__(self) -> None:
        self.drops: list[dict[str, Any]] = []

    async def start(self, nc: NATS, names: Names) -> Events:
        async def cb(msg: Any) -> None:
            ev = json.loads(msg.data)
            if ev["kind"] == "drop":
                self.drops.append(ev)

        await nc.subscribe(names.events("mq"), cb=cb)
        return self

    def ids(self) -> list[str]:
        return [sid for ev in self.drops for sid in ev["sample_ids"]]

    async def until(self, n_ids: int, timeout: float = 60.0) -> list[str]:
        for _ in range(int(timeout / 0.05)):
            if len(self.ids()) >= n_ids:
                break
            await asyncio.sleep(0.05)
        return self.ids()


async def test_complete_groups_become_micro_batches_and_depth_is_reported(nats_url, run_id, tmp_path):
    cfg, names = make_cfg(tmp_path, run_id), Names(run_id)
    async with running_mq(cfg, nats_url) as svc, client(nats_url) as (nc, js):
        depth_sub = await nc.subscribe(names.depth(MODEL))
        ready = await Ready(js, names).start()
        # interleaved: a0 b0 c0 a1 b1 -> groups a and b complete, c waits
        await send(js, names, [sample(run_id, k, i) for i, k in [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b")]])
        batches = await ready.until(1)
        assert len(batches) == 1
        mb, msg_id = batches[0]
        ids = [s.sample_id for s in mb.samples]
        assert sorted(ids) == ["a_0_0", "a_0_1", "b_0_0", "b_0_1"]
        assert mb.batch_id == msg_id == hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()
        # c is half a group: it is held, not dispatched, and counted in the depth
        for _ in range(50):
            report = json.loads((await depth_sub.next_msg(timeout=2)).data)
            if report["depth"] == 1:
                break
        assert report == {**report, "model": MODEL, "depth": 1, "capacity": 64, "trained_version": 0}
        await send(js, names, [sample(run_id, "c", 1), sample(run_id, "d", 0), sample(run_id, "d", 1)])
        batches = await ready.until(2)
        assert sorted(s.sample_id for s in batches[1][0].samples) == ["c_0_0", "c_0_1", "d_0_0", "d_0_1"]
        assert svc.counters["micro_batches"] == 2 and svc.counters["dispatched"] == 8


async def test_stale_samples_are_dropped_counted_and_reported(nats_url, run_id, tmp_path):
    cfg, names = make_cfg(tmp_path, run_id), Names(run_id)
    async with running_mq(cfg, nats_url) as svc, client(nats_url) as (nc, js):
        events = await Events().start(nc, names)
        ready = await Ready(js, names).start()
        await kv_put_int_max(svc.kv, names.trained_key(MODEL), 3)
        await wait_until(lambda: svc.trained_version == 3, "mq at trained version 3", interval_s=0.02)
        # max_staleness 1 at trained version 3: version 1 is stale, 2 and 3 are fresh
        await send(js, names, [sample(run_id, "old", i, version=1) for i in range(2)]
                   + [sample(run_id, "new", i, version=2 + i) for i in range(2)]
                   + [sample(run_id, "also", i, version=3) for i in range(2)] + [sample(run_id, "half", 0, version=2)])
        assert sorted(await events.until(2)) == ["old_0_0", "old_0_1"]
        batches = await ready.until(1)
        assert sorted(s.sample_id for s in batches[0][0].samples) == ["also_0_0", "also_0_1", "new_0_0", "new_0_1"]
        assert batches[0][0].trained_version_seen == 3
        # the trainer moves on: the held half group becomes stale and is dropped, too
        await kv_put_int_max(svc.kv, names.trained_key(MODEL), 4)
        assert sorted(await events.until(3)) == ["half_0_0", "old_0_0", "old_0_1"]
        assert all(ev["reason"] == "stale" and ev["model"] == MODEL for ev in events.drops), events.drops
        assert svc.counters["dropped_stale"] == 3 and svc.store.depth() == 0


async def test_malformed_message_goes_to_dlq_and_mq_keeps_going(nats_url, run_id, tmp_path):
    cfg, names = make_cfg(tmp_path, run_id), Names(run_id)
    async with running_mq(cfg, nats_url) as svc, client(nats_url) as (nc, js):
        dlq = await nc.subscribe(names.dlq("mq"))
        ready = await Ready(js, names).start()
        await js.publish(names.traj(MODEL), b"\xc1 not msgpack", headers={"Nats-Msg-Id": "junk"})
        bad = msgpack.unpackb(encode(sample(run_id, "x", 0)))
        bad["group_size"] = 0
        await js.publish(names.traj(MODEL), msgpack.packb(bad), headers={"Nats-Msg-Id": "bad"})
        first = await dlq.next_msg(timeout=5)
        second = await dlq.next_msg(timeout=5)
        assert first.data == b"\xc1 not msgpack" and "not msgpack" in first.headers["Chorus-Reason"]
        assert "group_size" in second.headers["Chorus-Reason"]
        assert second.headers["Chorus-Subject"] == names.traj(MODEL)
        await send(js, names, [sample(run_id, k, i) for k in "ab" for i in range(2)])
        assert len(await ready.until(1)) == 1
        assert svc.counters["dlq"] == 2
        # terminated, not redelivered: the traj stream is empty once the batch is acked
        async def traj_empty() -> bool:
            return (await js.stream_info(names.traj_stream(MODEL))).state.messages == 0

        await wait_until(traj_empty, "the trajectory stream empty")
        assert (await js.stream_info(names.traj_stream(MODEL))).state.messages == 0


async def test_full_ready_stream_pushes_back_without_losing_batches(nats_url, run_id, tmp_path):
    cfg, names = make_cfg(tmp_path, run_id, max_ready_msgs=1), Names(run_id)
    async with running_mq(cfg, nats_url) as svc, client(nats_url) as (_, js):
        await send(js, names, [sample(run_id, f"g{k}", i) for k in range(4) for i in range(2)])
        # the second micro-batch waits for room in the ready stream
        await wait_until(lambda: svc.counters["backpressure_waits"] > 0, "a backpressure wait")
        assert svc.counters["backpressure_waits"] > 0 and svc.counters["micro_batches"] == 1
        assert svc.store.depth() == 4  # held (not acked) while it waits
        batches = await (await Ready(js, names).start()).until(2)
        assert [len(mb.samples) for mb, _ in batches] == [4, 4]
        assert svc.counters["publish_errors"] == 0


async def test_restart_with_half_received_groups_loses_nothing(nats_url, run_id, tmp_path):
    cfg, names = make_cfg(tmp_path, run_id), Names(run_id)
    keys = [f"k{i}" for i in range(6)]
    async with client(nats_url) as (nc, js):
        async with running_mq(cfg, nats_url) as first:
            events = await Events().start(nc, names)
            ready = await Ready(js, names).start()
            # k0, k1 complete (one micro-batch); k2..k5 half received when mq stops
            await send(js, names, [sample(run_id, k, 0) for k in keys] + [sample(run_id, k, 1) for k in keys[:2]])
            assert len(await ready.until(1)) == 1
            await wait_until(lambda: first.store.depth() == 4, "four samples held", interval_s=0.02)
            assert first.store.depth() == 4
        async with running_mq(cfg, nats_url) as second:
            # the rest, one group's first half re-sent under a new message id (a republish), and a stale group
            await send(js, names, [sample(run_id, k, 1) for k in keys[2:]])
            await send(js, names, [sample(run_id, "k2", 0)], msg_id_suffix="-again")
            await kv_put_int_max(second.kv, names.trained_key(MODEL), 2)
            await send(js, names, [sample(run_id, "late", i, version=0) for i in range(2)])
            batches = await ready.until(3)
            await events.until(2)
            assert second.counters["duplicates"] >= 1
    trained = Counter(s.sample_id for mb, _ in batches for s in mb.samples)
    dropped = Counter(events.ids())
    expected = {Sample.make_id(k, 0, i) for k in [*keys, "late"] for i in range(2)}
    assert set(trained + dropped) == expected
    assert all(c == 1 for c in (trained + dropped).values())  # exactly once: no loss, no double
    assert set(dropped) == {"late_0_0", "late_0_1"}
    for mb, _ in batches:  # whole groups only
        assert all(c == GROUP for c in Counter(s.group_key for s in mb.samples).values())


async def test_exit_when_done_waits_for_the_coordinators_last_samples_then_closes_for_the_trainer(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    """A finished run (the trainer at train.max_versions) does not stop an mq started with --exit-when-done while
    samples can still come: samples published after the finish are dropped as ``finished``, the mq waits for
    ``closed.coordinator``, then writes ``closed.mq.<model>`` for the trainer and exits 0."""
    cfg = make_cfg(tmp_path, run_id)
    names = Names(run_id)
    budget = cfg.train.max_versions
    async with client(nats_url) as (nc, js):
        events = await Events().start(nc, names)
        svc = MqService(cfg, nats_url=nats_url, model=MODEL)
        svc.exit_when_done = True
        task = asyncio.create_task(svc.serve())
        await wait_until(lambda: getattr(svc, "sub", None) is not None or task.done(), "mq started", interval_s=0.02)
        assert not task.done(), "mq failed to start"
        kv = await js.key_value(names.kv_bucket)
        await kv.put(names.trained_key(MODEL), str(budget).encode())
        await kv.put(names.eval_final_key(), str(budget).encode())
        await wait_until(lambda: svc.exit_waiting_for == "the coordinator's last samples", "the mq waiting",
                         interval_s=0.05)
        late = [sample(run_id, "late", i) for i in range(GROUP)]  # an episode that ended after the finish
        await send(js, names, late)
        await wait_until(lambda: set(events.ids()) >= {s.sample_id for s in late}, "the late samples dropped",
                         interval_s=0.05)
        assert {d["reason"] for d in events.drops} == {"finished"}, events.drops
        assert not task.done(), "the mq exited before the coordinator closed"
        assert await kv_get_int(kv, names.mq_closed_key(MODEL)) == 0
        await kv.put(names.coordinator_closed_key(), str(budget).encode())
        assert await asyncio.wait_for(task, 30) == 0
        assert await kv_get_int(kv, names.mq_closed_key(MODEL)) == budget
