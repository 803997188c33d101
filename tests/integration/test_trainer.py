"""The trainer service against a real nats-server, fed hand-built micro-batches."""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest
import torch

from services.trainer.commits import Commits, Fenced
from services.trainer.service import TrainerService
from shared.kernel.bus import ensure_run, kv_get_int, object_names
from shared.kernel.codec import decode, encode
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, MicroBatch, Sample, WeightsAnnounce
from shared.kernel.service import EX_RUN_FAILED
from shared.kernel.subjects import Names
from shared.models.tokenizer import BOS_ID, EOS_ID
from shared.models.weights import WeightsHeader, checksum, flatten, unpack
from shared.models.weightsync import NatsSource, make_sink

MODEL = "m"


def write_cfg(tmp_path: Path, run_id: str, *, lora: bool = False, **train: Any) -> ChorusConfig:
    settings = {"global_batch": 8, "micro_batch": 4, "max_staleness": 0, "max_versions": 3,
                "checkpoint_every": 2, "ack_wait_s": 5, **train}
    agents = ("{solver: {model: m, adapter: sol}, verifier: {model: m, adapter: ver}}" if lora
              else "{solver: {model: m}, verifier: {model: m}}")
    p = tmp_path / "run.yaml"
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\n"
        "models: {m: {arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: 64},"
        f" optim: {{lr: 0.01}}{', lora: {r: 4}' if lora else ''}}}}}\n"
        f"agents: {agents}\n"
        "workflow: {group_size: 4}\n"
        f"train: {json.dumps(settings)}\n"
        "metrics_interval_s: 0.2\n"
    )
    return load_config(p)


def group(run_id: str, key: str, version: int, agent: str = "solver", adapter: str | None = None) -> list[Sample]:
    """A complete GRPO group of 4 with different rewards, so advantages are non-zero."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))  # the same samples in every process (hash() is salted)
    out = []
    for i in range(4):
        resp = [*rng.integers(48, 58, 3).tolist(), EOS_ID]
        out.append(Sample(
            run=run_id, episode=key, sample_id=f"{key}_0_{i}", env_idx=0, rollout_idx=i, agent=agent, model=MODEL,
            adapter=adapter, turn=0, prompt_ids=Array.of([BOS_ID, 50, 43, 50, 61], "int32"), response_ids=Array.of(resp, "int32"),
            behavior_logprobs=Array.of((-rng.random(4) * 5 - 0.1).tolist(), "float32"), reward=float(i % 2 + i / 10),
            group_key=f"{key}:{agent}:0", group_size=4, version=version,
        ))
    return out


async def publish_batch(js: Any, names: Names, run_id: str, key: str, version: int, agent: str = "solver",
                        adapter: str | None = None) -> None:
    mb = MicroBatch(batch_id=key, model=MODEL, samples=group(run_id, key, version, agent, adapter))
    await js.publish(names.ready(MODEL), encode(mb), headers={"Nats-Msg-Id": key})


async def wait_until(cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = cond()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def fetch_object(js: Any, names: Names, ann: WeightsAnnounce) -> tuple[WeightsHeader, bytes]:
    """The announced weights, fetched the way a rollouter does (the announce names the transport)."""
    sink = make_sink(ann.transport, names, MODEL, "test", js._nc, js)
    header, body = await sink.fetch(ann.version, object_name=ann.object_name, timeout_s=10)
    assert header.version == ann.version and header.model == MODEL
    assert checksum(body, header.bucket_bytes) == header.checksum == ann.checksum
    return header, bytes(body)


async def fetch_weights(js: Any, names: Names, ann: WeightsAnnounce) -> bytes:
    return (await fetch_object(js, names, ann))[1]


class Watch:
    """Collects announces, trainer events and DLQ entries of a run."""

    def __init__(self) -> None:
        self.announces: list[WeightsAnnounce] = []
        self.events: list[dict[str, Any]] = []
        self.dlq: list[Any] = []

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    async def attach(self, nc: Any, names: Names) -> None:
        async def on_announce(msg: Any) -> None:
            self.announces.append(decode(WeightsAnnounce, msg.data))

        async def on_event(msg: Any) -> None:
            self.events.append(json.loads(msg.data))

        async def on_dlq(msg: Any) -> None:
            self.dlq.append(msg)

        await nc.subscribe(names.sync_announce(MODEL), cb=on_announce)
        await nc.subscribe(names.events("trainer"), cb=on_event)
        await nc.subscribe(names.dlq("trainer"), cb=on_dlq)
        await nc.flush()


async def start(cfg: ChorusConfig, nats_url: str) -> tuple[TrainerService, asyncio.Task[int]]:
    svc = TrainerService(cfg, nats_url=nats_url, model=MODEL)
    return svc, asyncio.create_task(svc.serve())


async def test_trainer_steps_publishes_weights_drops_stale_and_rejects_malformed(nats_url, run_id, tmp_path):
    cfg = write_cfg(tmp_path, run_id)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    watch = Watch()
    await watch.attach(nc, names)
    svc, task = await start(cfg, nats_url)
    try:
        await wait_until(lambda: watch.announces, what="the v0 announce")
        assert watch.announces[0].version == 0
        js = nc.jetstream()
        v0 = await fetch_weights(js, names, watch.announces[0])
        kv = await js.key_value(names.kv_bucket)
        assert await kv_get_int(kv, names.trained_key(MODEL), -1) == 0

        # Garbage first: it goes to the DLQ with a reason, and training goes on behind it.
        await js.publish(names.ready(MODEL), b"\xc1 not a micro-batch", headers={"Nats-Msg-Id": "junk"})
        await publish_batch(js, names, run_id, "a", version=0)
        await publish_batch(js, names, run_id, "b", version=0, agent="verifier")
        await wait_until(lambda: kv_get_int(kv, names.trained_key(MODEL)), what="trained.m >= 1")
        assert watch.dlq and watch.dlq[0].headers["Chorus-Reason"].startswith("not msgpack")
        assert svc.counters["dlq"] == 1

        await wait_until(lambda: [a for a in watch.announces if a.version == 1], what="the v1 announce")
        v1 = await fetch_weights(js, names, watch.announces[-1])
        assert v1 != v0

        # Trainer is at v1 with max_staleness 0: version-0 samples are stale; already-trained ids are repeats.
        await publish_batch(js, names, run_id, "c", version=0)
        await wait_until(lambda: watch.kinds("drop"), what="a drop event")
        drop = watch.kinds("drop")[0]
        assert drop["reason"] == "stale" and drop["detail"].startswith("staleness > 0 at trainer version 1"), drop
        assert drop["count"] == 4 and sorted(drop["sample_ids"]) == [f"c_0_{i}" for i in range(4)]
        mb = MicroBatch(batch_id="a-again", model=MODEL, samples=group(run_id, "a", version=1))
        await js.publish(names.ready(MODEL), encode(mb), headers={"Nats-Msg-Id": "a-again"})
        await wait_until(lambda: svc.counters["duplicates"] == 4, what="duplicates counted")
        assert svc.counters["dropped_stale"] == 4

        # One broken sample goes to the DLQ on its own; its group mates still train.
        broken = group(run_id, "x", version=1)
        broken[0] = broken[0].model_copy(update={"behavior_logprobs": Array.of([-1.0], "float32")})
        mb = MicroBatch(batch_id="x", model=MODEL, samples=broken)
        await js.publish(names.ready(MODEL), encode(mb), headers={"Nats-Msg-Id": "x"})
        await wait_until(lambda: len(watch.dlq) == 2, what="the broken sample in the DLQ")
        assert "x_0_0" in watch.dlq[1].headers["Chorus-Reason"]
        assert decode(Sample, watch.dlq[1].data).sample_id == "x_0_0"
        assert svc.counters["dropped_invalid"] == 1
        for key in ("d", "e"):
            await publish_batch(js, names, run_id, key, version=1)
        for key in ("f", "g"):
            await publish_batch(js, names, run_id, key, version=2)
        await wait_until(lambda: watch.kinds("done"), what="the done event")
        assert watch.kinds("done")[0]["version"] == 3
        assert await kv_get_int(kv, names.trained_key(MODEL)) == 3

        lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["version"] for r in lines] == [1, 2, 3]
        first = lines[0]
        for field in ("model", "version", "reward_mean", "reward_std", "samples", "staleness_mean", "staleness_max",
                      "dropped_stale", "step_seconds", "loss", "agent_reward", "sample_ids"):
            assert field in first, field
        assert first["samples"] == 8 and first["staleness_max"] == 0
        assert sorted(first["sample_ids"]) == sorted([f"a_0_{i}" for i in range(4)] + [f"b_0_{i}" for i in range(4)])
        assert set(first["agent_reward"]) == {"solver", "verifier"}
        assert first["reward_mean"] == pytest.approx(np.mean([0.0, 1.1, 0.2, 1.3]))
        assert [r["dropped_stale"] for r in lines] == [0, 4, 4]
        assert [r["samples"] for r in lines] == [8, 11, 8]
        assert "x_0_0" not in lines[1]["sample_ids"] and "x_0_1" in lines[1]["sample_ids"]
        steps = watch.kinds("step")
        assert [s["version"] for s in steps] == [1, 2, 3] and steps[1]["sample_ids"] == lines[1]["sample_ids"]
        # every checkpoint_every (2) versions, and the final version's whatever checkpoint_every says
        assert sorted(p.name for p in (cfg.run_dir / "checkpoints" / MODEL).iterdir()) == ["v2.pt", "v3.pt"]

        # At max_versions the trainer stays up and trains nothing more: later samples are dropped as finished
        # (recorded, then acked), so every sample of the run is accounted for.
        await publish_batch(js, names, run_id, "h", version=3)
        await wait_until(lambda: [d for d in watch.kinds("drop") if d["reason"] == "finished"],
                         what="the finished drop")
        finished = [d for d in watch.kinds("drop") if d["reason"] == "finished"][0]
        assert sorted(finished["sample_ids"]) == [f"h_0_{i}" for i in range(4)]
        assert svc.counters["dropped_finished"] == 4
        assert await kv_get_int(kv, names.trained_key(MODEL)) == 3
        await wait_until(lambda: _messages(js, names.ready_stream(MODEL), 0), what="the ready stream empty")
        assert not task.done()
    finally:
        svc.stop()
        code = await asyncio.wait_for(task, 30)
        await nc.close()
    assert code == 0


async def test_trainer_restarts_from_its_newest_checkpoint(nats_url, run_id, tmp_path):
    cfg = write_cfg(tmp_path, run_id, global_batch=4, max_versions=2, checkpoint_every=1)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    watch = Watch()
    await watch.attach(nc, names)
    trained_v1, _ = await _train_v1(cfg, nats_url, js, names, watch, run_id)
    assert (cfg.run_dir / "checkpoints" / MODEL / "v1.pt").is_file()

    watch.announces.clear()
    svc, task = await start(cfg, nats_url)
    try:
        await wait_until(lambda: watch.announces, what="the announce after restart")
        assert watch.announces[0].version == 1
        assert await fetch_weights(js, names, watch.announces[0]) == trained_v1
        await publish_batch(js, names, run_id, "b", version=1)
        await wait_until(lambda: watch.kinds("done"), what="the done event")
        assert watch.kinds("done")[0]["version"] == 2
    finally:
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0
        await nc.close()


async def test_a_lora_trainer_trains_both_adapters_in_one_step_and_ships_only_adapter_tensors(nats_url, run_id, tmp_path):
    cfg = write_cfg(tmp_path, run_id, lora=True, global_batch=8, max_versions=1)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    watch = Watch()
    await watch.attach(nc, names)
    svc, task = await start(cfg, nats_url)
    try:
        await wait_until(lambda: watch.announces, what="the v0 announce")
        header0, _ = await fetch_object(js, names, watch.announces[0])
        shipped = {s.name for s in header0.slots}
        assert shipped and all(".lora_A." in n or ".lora_B." in n for n in shipped)
        base_bytes = sum(p.numel() * p.element_size() for p in svc.learner.net.parameters())
        assert header0.nbytes * 10 < base_bytes

        # One micro-batch with a group per adapter, plus one sample naming an adapter the model lacks.
        sol, ver = group(run_id, "s", 0, "solver", "sol"), group(run_id, "v", 0, "verifier", "ver")
        stray = group(run_id, "z", 0, "verifier", "nope")[:1]
        mb = MicroBatch(batch_id="mixed", model=MODEL, samples=sol[:2] + ver[:2] + stray + sol[2:] + ver[2:])
        await js.publish(names.ready(MODEL), encode(mb), headers={"Nats-Msg-Id": "mixed"})
        await wait_until(lambda: watch.kinds("step"), what="the step event")
        await wait_until(lambda: watch.dlq, what="the stray sample in the DLQ")
        reason = watch.dlq[0].headers["Chorus-Reason"]
        assert "z_0_0" in reason and "agent 'verifier' uses adapter 'ver', the sample says 'nope'" in reason
        assert svc.counters["dropped_invalid"] == 1

        step = watch.kinds("step")[0]
        assert step["version"] == 1 and step["samples"] == 8
        assert step["adapter_samples"] == {"sol": 4, "ver": 4}
        assert sorted(step["sample_ids"]) == sorted(s.sample_id for s in sol + ver)
        await wait_until(lambda: [a for a in watch.announces if a.version == 1], what="the v1 announce")
        header1, body1 = await fetch_object(js, names, watch.announces[-1])
        _, body0 = await fetch_object(js, names, watch.announces[0])
        assert {s.name for s in header1.slots} == shipped
        moved = {n.split(".lora_")[1].split(".")[1] for n in _changed(header0, body0, header1, body1)}
        assert moved == {"sol", "ver"}
    finally:
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0
        await nc.close()


async def _messages(js: Any, stream: str, n: int) -> bool:
    return (await js.stream_info(stream)).state.messages == n


def _changed(h0: WeightsHeader, b0: bytes, h1: WeightsHeader, b1: bytes) -> list[str]:
    """Names of the tensors whose bytes differ between two weight objects of the same layout."""
    slots1 = {s.name: s for s in h1.slots}
    return [s.name for s in h0.slots
            if b0[s.offset : s.offset + s.nbytes] != b1[slots1[s.name].offset : slots1[s.name].offset + s.nbytes]]


async def test_a_restarted_trainer_continues_from_its_commit_and_knows_what_it_trained(nats_url, run_id, tmp_path):
    """No checkpoint file: the commit in the object store is what a restart reads. A micro-batch re-formed from
    samples already trained (mq restarted between its publish and its acks) is a duplicate, not a new step."""
    cfg = write_cfg(tmp_path, run_id, global_batch=4, max_versions=3, checkpoint_every=0)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    watch = Watch()
    await watch.attach(nc, names)
    v1, first_epoch = await _train_v1(cfg, nats_url, js, names, watch, run_id)
    assert not (cfg.run_dir / "checkpoints").exists()

    watch.announces.clear()
    svc, task = await start(cfg, nats_url)
    try:
        await wait_until(lambda: watch.announces, what="the announce after restart")
        ann = watch.announces[0]
        assert ann.version == 1 and await fetch_weights(js, names, ann) == v1
        assert svc.epoch != first_epoch and svc.learner.version == 1
        kv = await js.key_value(names.kv_bucket)
        assert decode(WeightsAnnounce, (await kv.get(names.weights_key(MODEL))).value).object_name == ann.object_name
        # mq re-formed the trained group into a new micro-batch: recognised, acked, not trained again.
        mb = MicroBatch(batch_id="a-reformed", model=MODEL, samples=group(run_id, "a", version=1))
        await js.publish(names.ready(MODEL), encode(mb), headers={"Nats-Msg-Id": "a-reformed"})
        await wait_until(lambda: svc.counters["duplicates"] == 4, what="the duplicates")
        await wait_until(lambda: _messages(js, names.ready_stream(MODEL), 0), what="the duplicate acked")
        assert svc.learner.version == 1 and svc.learner.accumulated == 0
        await publish_batch(js, names, run_id, "b", version=1)
        await wait_until(lambda: [a for a in watch.announces if a.version == 2], what="the v2 announce")
    finally:
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0
    # The step record of v1 was written again by the restarted trainer: one record per version in the stream.
    steps = [e for e in await _stream_events(js, names) if e["kind"] == "step"]
    assert sorted(e["version"] for e in steps) == [1, 2]
    assert sorted(steps[0]["sample_ids"]) == [f"a_0_{i}" for i in range(4)]
    await nc.close()


async def test_a_stale_trainer_loses_the_commit_to_a_newer_one(nats_url, run_id, tmp_path):
    """Two trainers of one model (one was frozen while the other started): the later commit is refused."""
    cfg = write_cfg(tmp_path, run_id)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        kv, _ = await ensure_run(js, cfg)
        header, buf = flatten(MODEL, 0, {"w": torch.zeros(4)})

        def commits(epoch: str) -> Commits:
            return Commits(js, kv, names, MODEL, NatsSource(cfg, names, MODEL, js), epoch, 64 * 1024)

        old, new = commits("old"), commits("new")
        assert await old.latest() is None
        await old.commit(header, buf, b"state v0", "nats")
        assert (await new.latest()).version == 0
        h1, b1 = flatten(MODEL, 1, {"w": torch.ones(4)})
        ann = await new.commit(h1, b1, b"state v1 of new", "nats")
        with pytest.raises(Fenced):
            await old.commit(h1, flatten(MODEL, 1, {"w": torch.full((4,), 2.0)})[1], b"state v1 of old", "nats")
        latest = await commits("reader").latest()
        assert latest == ann and latest.state_object.endswith("-new")
        weights, state = await new.read(latest)
        assert bytes(state) == b"state v1 of new" and unpack(weights)[0].checksum == h1.checksum
        # The loser's objects are left over; a restart's sweep removes what no commit names.
        await new.sweep(latest)
        assert not [n for n in await object_names(js, names.obj_bucket) if n.endswith("-old") and "/v1" in n]
    finally:
        await nc.close()


async def test_a_commit_retried_after_its_reply_was_lost_is_its_own_not_a_newer_trainers(nats_url, run_id, tmp_path):
    """The swap of v1 landed but its reply was lost (the broker cut off past the swap's attempts) and the trainer
    committed v1 again: the commit point already holds this trainer's v1 (an announce with another created_at),
    which is its own write, not a newer trainer's. A trainer of another epoch is still fenced off."""
    cfg = write_cfg(tmp_path, run_id)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        kv, _ = await ensure_run(js, cfg)

        def commits(epoch: str) -> Commits:
            return Commits(js, kv, names, MODEL, NatsSource(cfg, names, MODEL, js), epoch, 64 * 1024)

        mine, stale = commits("mine"), commits("stale")
        header, buf = flatten(MODEL, 0, {"w": torch.zeros(4)})
        await mine.commit(header, buf, b"state v0", "nats")
        assert (await stale.latest()).version == 0
        before = mine.revision
        h1, b1 = flatten(MODEL, 1, {"w": torch.ones(4)})
        first = await mine.commit(h1, b1, b"state v1", "nats")
        mine.revision = before  # the swap's reply never came back
        await asyncio.sleep(0.01)
        again = await mine.commit(h1, b1, b"state v1", "nats")
        assert again.created_at != first.created_at and again.object_name == first.object_name
        assert mine.revision == (await kv.get(mine.key)).revision  # it goes on from its own write
        h2, b2 = flatten(MODEL, 2, {"w": torch.full((4,), 2.0)})
        assert (await mine.commit(h2, b2, b"state v2", "nats")).version == 2
        with pytest.raises(Fenced):
            await stale.commit(h1, b1, b"state v1 of stale", "nats")
        assert (await commits("reader").latest()).object_name.endswith("-mine")
    finally:
        await nc.close()


async def _stream_events(js: Any, names: Names) -> list[dict[str, Any]]:
    sub = await js.subscribe(names.events_all(), ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except Exception:  # noqa: BLE001 - the end of the stream
                break
            out.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return out


async def _train_v1(cfg, nats_url, js, names, watch, run_id) -> tuple[bytes, str]:  # noqa: ANN001
    """Start a trainer, train version 1 on group "a" and stop it: (the v1 weights, the trainer's epoch)."""
    svc, task = await start(cfg, nats_url)
    try:
        await wait_until(lambda: watch.announces, what="the v0 announce")
        await publish_batch(js, names, run_id, "a", version=0)
        await wait_until(lambda: [a for a in watch.announces if a.version == 1], what="the v1 announce")
        return await fetch_weights(js, names, watch.announces[-1]), svc.epoch
    finally:
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def test_a_trainer_on_a_device_the_machine_lacks_fails_at_start_naming_the_key(nats_url, run_id, tmp_path,
                                                                                      monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write_cfg(tmp_path, run_id)
    cfg.models[MODEL].device = "cuda"
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    watch = Watch()
    await watch.attach(nc, names)
    try:
        code = await asyncio.wait_for(TrainerService(cfg, nats_url=nats_url, model=MODEL).serve(), 30)
        assert code == EX_RUN_FAILED  # `chorus up` stops the run instead of restarting it in a loop
        out = capsys.readouterr()
        assert "models.m.device is cuda but torch.cuda.is_available() is False" in out.out + out.err
        assert "set device: cpu or auto" in out.out + out.err
        await nc.flush()
        assert not watch.announces  # it stopped before committing or announcing anything
    finally:
        await nc.close()
