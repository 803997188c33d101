"""Paramsync end to end against a real nats-server: announce -> pause -> load -> version -> resume -> done."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import torch
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from services.coordinator.tasks import make_task
from services.coordinator.workflows.api import GenResult as CoordGen
from services.coordinator.workflows.episode import make_sample
from services.paramsync.service import ParamSyncService
from services.rollouter.continuous import ContinuousEngine
from services.rollouter.engine import behaviour_logprobs
from services.rollouter.service import RollouterService
from services.trainer.intake import SeenIds, filter_samples
from shared.kernel.bus import kv_get_int
from shared.kernel.codec import decode, encode
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import (
    Array,
    GenRequest,
    GenResponse,
    RolloutControl,
    RolloutControlReply,
    SyncDone,
    WeightsAnnounce,
)
from shared.kernel.service import Service
from shared.kernel.subjects import Names
from shared.models.loading import load_model, shipped_tensors
from shared.models.tokenizer import BOS_ID
from shared.models.weights import flatten, pack
from tests.waits import wait_until

MODEL = "m"


def write_config(tmp_path: Path, run_id: str, *, lora: bool = False) -> ChorusConfig:
    p = tmp_path / "run.yaml"
    adapters = ("{solver: {model: m, adapter: sol}, verifier: {model: m, adapter: ver}}" if lora
                else f"{{solver: {{model: {MODEL}}}, verifier: {{model: {MODEL}}}}}")
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\n"
        f"models: {{{MODEL}: {{rollouter: {{batch_window_ms: 2}}{', lora: {r: 4}' if lora else ''}}}}}\n"
        f"agents: {adapters}\n"
        "paramsync: {pause_timeout_s: 3, load_timeout_s: 10}\n"
        "metrics_interval_s: 0.5\n"
    )
    return load_config(p)


async def sync_phase_is(kv: KeyValue, names: Names, phase: str, version: int | None = None) -> bool:
    """Whether the model's sync state (KV) records ``phase`` (and ``version``, when given)."""
    try:
        state = json.loads((await kv.get(names.sync_key(MODEL))).value)
    except KeyNotFoundError:
        return False
    return state.get("phase") == phase and (version is None or state.get("version") == version)


async def serve(svc: Service, ready: str) -> asyncio.Task[int]:
    task = asyncio.create_task(svc.serve())
    for _ in range(1200):
        if task.done():
            raise AssertionError(f"{svc.name} exited early with {task.result()}")
        if hasattr(svc, ready) and (svc.routing if isinstance(svc, RollouterService) else True):
            return task
        await asyncio.sleep(0.05)
    raise AssertionError(f"{svc.name} did not start")


@dataclass
class Setup:
    cfg: ChorusConfig
    names: Names
    nc: NATS
    rollouters: list[RollouterService]
    paramsync: ParamSyncService


@contextlib.asynccontextmanager
async def running(cfg: ChorusConfig, nats_url: str, instances: int) -> AsyncIterator[Setup]:
    """``instances`` rollouters and a paramsync of the model, stopped cleanly at the end."""
    rollouters = [RollouterService(cfg, nats_url=nats_url, instance=str(i), model=MODEL) for i in range(instances)]
    ps = ParamSyncService(cfg, nats_url=nats_url, model=MODEL)
    tasks = [await serve(r, "_gen_subs") for r in rollouters] + [await serve(ps, "queue")]
    nc = await nats.connect(nats_url)
    try:
        yield Setup(cfg, Names(cfg.run.id), nc, rollouters, ps)
    finally:
        await nc.close()
        for svc in [*rollouters, ps]:
            svc.stop()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 30) == [0] * (instances + 1)


@pytest.fixture
async def setup(nats_url: str, run_id: str, tmp_path: Path) -> AsyncIterator[Setup]:
    async with running(write_config(tmp_path, run_id), nats_url, 2) as s:
        yield s


async def publish_weights(s: Setup, version: int, delta: float, *, bad_checksum: bool = False,
                          extra: dict[str, torch.Tensor] | None = None, announce: bool = True) -> dict[str, torch.Tensor]:
    """Put v``version`` = initial shipped tensors + delta (and ``extra``) into the object store and announce it."""
    lora = s.cfg.models[MODEL].lora is not None
    net = load_model(s.cfg, MODEL)
    with torch.no_grad():
        for p in shipped_tensors(net, lora).values():
            p.add_(delta)
    named = {k: v.detach().clone() for k, v in shipped_tensors(net, lora).items()}
    header, buf = flatten(MODEL, version, {**named, **(extra or {})})
    obj = await s.nc.jetstream().object_store(s.names.obj_bucket)
    await obj.put(s.names.weights_object(MODEL, version), pack(header, buf))
    ann = WeightsAnnounce(model=MODEL, version=version, object_name=s.names.weights_object(MODEL, version),
                          checksum="0" * 64 if bad_checksum else header.checksum, nbytes=header.nbytes)
    if announce:
        await s.nc.publish(s.names.sync_announce(MODEL), encode(ann))
    return named


async def generate(s: Setup) -> GenResponse:
    req = GenRequest(request_id="g", prompts=[Array.of([BOS_ID, 49, 43, 49, 61], "int32")], max_new_tokens=3)
    msg = await s.nc.request(s.names.gen(MODEL), encode(req), timeout=20)
    return decode(GenResponse, msg.data)


async def test_announced_weights_are_loaded_bit_for_bit_and_version_is_served(setup: Setup) -> None:
    s = setup
    done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
    expected = await publish_weights(s, version=1, delta=0.01)
    done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
    assert done.version == 1 and done.loaded == ["0", "1"] and done.failed == {}
    for r in s.rollouters:
        got = r.engine.named_tensors()
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert r.engine.version == 1 and not r.batcher.paused
    kv = await s.nc.jetstream().key_value(s.names.kv_bucket)
    assert await kv_get_int(kv, s.names.version_key(MODEL)) == 1
    resp = await generate(s)
    assert resp.error is None and resp.version == 1
    assert s.paramsync.counters["syncs"] == 1


async def test_checksum_mismatch_is_reported_and_does_not_move_the_version(setup: Setup) -> None:
    s = setup
    done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
    await publish_weights(s, version=2, delta=0.02, bad_checksum=True)
    done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
    assert done.loaded == [] and set(done.failed) == {"0", "1"}
    assert all("checksum" in reason for reason in done.failed.values())
    kv = await s.nc.jetstream().key_value(s.names.kv_bucket)
    assert await kv_get_int(kv, s.names.version_key(MODEL)) == 0
    # failed instances were resumed and still serve the old weights
    resp = await generate(s)
    assert resp.error is None and resp.version == 0
    assert s.paramsync.counters["failed_instances"] == 2


async def test_a_dead_instance_is_reported_without_blocking_the_others(setup: Setup) -> None:
    s = setup
    kv = await s.nc.jetstream().key_value(s.names.kv_bucket)
    await kv.put(s.names.rollouter_key(MODEL, "ghost"), b'{"instance":"ghost","started_at":0}')
    done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
    await publish_weights(s, version=3, delta=-0.01)
    done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
    assert done.loaded == ["0", "1"] and list(done.failed) == ["ghost"]
    assert "no responders" in done.failed["ghost"]
    assert await kv_get_int(kv, s.names.version_key(MODEL)) == 3
    assert (await generate(s)).version == 3


async def test_a_malformed_announce_goes_to_dlq(setup: Setup) -> None:
    s = setup
    dlq = await s.nc.subscribe(s.names.dlq("paramsync"))
    await s.nc.publish(s.names.sync_announce(MODEL), b"\xc1garbage")
    dead = await dlq.next_msg(timeout=5)
    assert dead.headers and dead.headers["Chorus-Reason"]
    assert s.paramsync.counters["syncs"] == 0


async def test_a_rollouter_started_later_catches_up_with_the_served_version(setup: Setup, nats_url: str) -> None:
    s = setup
    done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
    expected = await publish_weights(s, version=4, delta=0.03)
    assert decode(SyncDone, (await done_sub.next_msg(timeout=30)).data).version == 4
    late = RollouterService(s.cfg, nats_url=nats_url, instance="late", model=MODEL)
    task = await serve(late, "_gen_subs")
    try:
        assert late.engine.version == 4
        got = late.engine.named_tensors()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    finally:
        late.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def test_a_running_rollouter_that_a_sync_missed_loads_the_served_version_by_itself(setup: Setup) -> None:
    s = setup
    # Weights of v6 in the store and the served version raised, as by a sync that did not list instance 1.
    expected = await publish_weights(s, version=6, delta=0.02)
    done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
    assert decode(SyncDone, (await done_sub.next_msg(timeout=30)).data).version == 6
    r = s.rollouters[1]
    r.engine.version = 5  # this instance missed v6 (its tensors are those of v6 already; load them again)
    with torch.no_grad():
        for t in r.engine.named_tensors().values():
            t.zero_()
    await wait_until(lambda: r.engine.version == 6, "instance 1 at v6", interval_s=0.1)
    assert r.engine.version == 6 and r.counters["catch_ups"] >= 1
    got = r.engine.named_tensors()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


async def test_a_lora_update_ships_only_adapters_and_loads_them_with_the_base_untouched(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, run_id, lora=True)
    base = {k: v.detach().clone() for k, v in load_model(cfg, MODEL).named_parameters() if "lora_" not in k}
    async with running(cfg, nats_url, 1) as s:
        done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
        expected = await publish_weights(s, version=1, delta=0.05)
        assert expected and all("lora_" in k for k in expected)
        done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
        assert done.version == 1 and done.loaded == ["0"] and done.failed == {}
        engine = s.rollouters[0].engine
        got = engine.named_tensors()
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
        served = dict(engine.model.named_parameters())
        assert all(torch.equal(served[k], v) for k, v in base.items())

        # An update naming a tensor this rollouter does not have is refused whole; v1 keeps serving.
        stray = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight": torch.zeros(4, 64)}
        await publish_weights(s, version=2, delta=0.1, extra=stray)
        done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
        assert done.loaded == [] and "does not have" in done.failed["0"]
        kv = await s.nc.jetstream().key_value(s.names.kv_bucket)
        assert await kv_get_int(kv, s.names.version_key(MODEL)) == 1
        assert all(torch.equal(engine.named_tensors()[k], expected[k]) for k in expected)
        resp = await generate(s)
        assert resp.error is None and resp.version == 1


async def test_a_lost_announce_is_synced_from_the_commit_point(setup: Setup) -> None:
    """The trainer commits v7 (KV weights.<model>) but its announce never arrives: paramsync syncs it anyway."""
    s = setup
    named = await publish_weights(s, version=7, delta=0.04, announce=False)
    header, _ = flatten(MODEL, 7, named)
    ann = WeightsAnnounce(model=MODEL, version=7, object_name=s.names.weights_object(MODEL, 7),
                          checksum=header.checksum, nbytes=header.nbytes)
    kv = await s.nc.jetstream().key_value(s.names.kv_bucket)
    await kv.put(s.names.weights_key(MODEL), encode(ann))
    # the sync's last step: its phase recorded done, after the version is served
    await wait_until(lambda: sync_phase_is(kv, s.names, "done", 7), "v7 synced", interval_s=0.1)
    assert await kv_get_int(kv, s.names.version_key(MODEL)) == 7
    assert all(r.engine.version == 7 for r in s.rollouters)
    assert s.paramsync.counters["polled_commits"] >= 1 and s.paramsync.counters["announces"] == 0


async def test_a_restarted_paramsync_aborts_the_sync_it_left_half_done(nats_url: str, run_id: str,
                                                                       tmp_path: Path) -> None:
    """A paramsync that died between pause and resume: the next one resumes every instance at once."""
    cfg = write_config(tmp_path, run_id)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    rollouter = RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL)
    task = await serve(rollouter, "_gen_subs")
    # A controller that still answers probes, so the instance does not resume by itself.
    async def alive(msg: object) -> None:
        await msg.respond(b"{}")  # type: ignore[attr-defined]

    await nc.subscribe(f"{names.prefix}.probe.alive", cb=alive)
    ps = None
    try:
        reply = await nc.request(names.rollout_control(MODEL, "0", "pause"), encode(
            RolloutControl(verb="pause", version=1, timeout_s=2, lease_s=60, peer=f"{names.prefix}.probe.alive")),
            timeout=10)
        assert decode(RolloutControlReply, reply.data).paused
        kv = await nc.jetstream().key_value(names.kv_bucket)
        await kv.put(names.sync_key(MODEL), json.dumps({"phase": "running", "version": 1, "instances": ["0"]}).encode())
        await asyncio.sleep(3)
        assert rollouter.batcher.paused  # nobody resumes it...
        ps = ParamSyncService(cfg, nats_url=nats_url, model=MODEL)
        ps_task = await serve(ps, "queue")
        # the last step of the abort, which the paramsync's setup runs
        await wait_until(lambda: sync_phase_is(kv, names, "aborted"), "the half-done sync aborted", interval_s=0.1)
        assert not rollouter.batcher.paused  # ...until a paramsync starts: it aborted the half-done sync
        assert ps.counters["aborted_syncs"] == 1
        assert (await generate(Setup(cfg, names, nc, [rollouter], ps))).error is None
    finally:
        for svc in [s for s in (rollouter, ps) if s is not None]:
            svc.stop()
        await asyncio.wait_for(task, 30)
        if ps is not None:
            await asyncio.wait_for(ps_task, 30)
        await nc.close()


async def test_a_rollouter_paused_by_a_paramsync_that_died_resumes_before_its_lease_runs_out(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, run_id)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    rollouter = RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL)
    task = await serve(rollouter, "_gen_subs")
    try:
        gone = names.status("paramsync", MODEL, "gone")  # nobody answers there: its process is dead
        # a lease as long as paramsync.max_pause_s (180 s): only finding its paramsync dead can end it sooner
        await nc.request(names.rollout_control(MODEL, "0", "pause"),
                         encode(RolloutControl(verb="pause", version=1, timeout_s=2, lease_s=180, peer=gone)),
                         timeout=10)
        await wait_until(lambda: not rollouter.batcher.paused, "the instance resuming by itself")
        assert time.monotonic() < rollouter._pause_until  # its lease had not run out: the probe resumed it
        assert rollouter.counters["auto_resumes"] == 1
    finally:
        rollouter.stop()
        await asyncio.wait_for(task, 30)
        await nc.close()


async def test_a_sync_in_interrupt_mode_continues_rows_mid_generation_under_the_new_weights(
        nats_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rollouter.on_sync interrupt: a sync arrives while rows are mid-generation; they pause at a step boundary,
    the new weights load in place, and they go on (re-prefilled). Each token carries the version that sampled it,
    its log-prob is that version's, and the sample's staleness counts from its oldest token."""

    cfg = write_config(tmp_path, run_id)
    cfg.models[MODEL].rollouter.on_sync = "interrupt"
    # one token per row and step (no speculation): rows are surely mid-generation when the sync arrives
    cfg.models[MODEL].rollouter.speculate.draft_tokens = 0
    step = ContinuousEngine.step

    def slow_step(self: ContinuousEngine, new_rows: object = ()) -> object:
        time.sleep(0.02)  # room for a sync to arrive mid-generation
        return step(self, new_rows)  # type: ignore[arg-type]

    monkeypatch.setattr(ContinuousEngine, "step", slow_step)
    async with running(cfg, nats_url, 1) as s:
        r = s.rollouters[0]
        assert r.batcher.on_sync == "interrupt"
        prompts = [[BOS_ID, 49, 43, 49, 61], [BOS_ID, 50, 43, 51, 61, 32]]
        req = GenRequest(request_id="long", prompts=[Array.of(p, "int32") for p in prompts], max_new_tokens=120,
                         temperature=1.0, stop_ids=[])
        reply = asyncio.ensure_future(s.nc.request(s.names.gen(MODEL), encode(req), timeout=60))
        await wait_until(lambda: r.engine.running and min(len(row.ids) for row in r.engine.running) >= 10,
                         "rows 10 tokens into their generation", interval_s=0.01)
        v0 = {k: v.clone() for k, v in r.engine.named_tensors().items()}
        done_sub = await s.nc.subscribe(s.names.sync_done(MODEL))
        v1 = await publish_weights(s, version=1, delta=0.02)
        done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
        assert done.version == 1 and done.loaded == ["0"]
        resp = decode(GenResponse, (await reply).data)
    assert resp.error is None and resp.version == 0  # the oldest token's version
    assert r.batcher.interrupted == 1 and r.batcher.mixed_answers == 1
    net = load_model(cfg, MODEL)
    for prompt, out in zip(prompts, resp.outputs, strict=True):
        ids = out.ids.tolist()
        assert out.versions is not None, "every row was mid-generation: its tokens carry both versions"
        versions = out.versions.tolist()
        first_v1 = versions.index(1)
        assert len(ids) == 120 and 10 <= first_v1 < 120 and versions == [0] * first_v1 + [1] * (120 - first_v1)
        # log-probs against a reference recomputation (teacher-forced full forward) with each version's weights
        for version, weights in ((0, v0), (1, v1)):
            with torch.no_grad():
                for k, t in shipped_tensors(net, False).items():
                    t.copy_(weights[k])
                logits = net(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            n = logits.shape[0]
            ref = behaviour_logprobs(logits, torch.ones(n), torch.ones(n)).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            mine = [i for i, v in enumerate(versions) if v == version]
            assert torch.allclose(torch.tensor(out.logprobs.tolist())[mine], ref[mine], atol=1e-4), version
        # the sample's version is its oldest token's: trained at v2 with max_staleness 1 it is stale (2 - 0 > 1),
        # although most of its tokens are v1
        row = CoordGen(ids=ids, logprobs=out.logprobs.tolist(), finished=False, version=resp.version,
                       token_versions=versions, prompt_ids=prompt)
        task = make_task(random.Random(0), cfg.task)
        sample = make_sample(cfg, task, 0, "solver", 0, 0, 0, row, 1.0, {MODEL: 1}, 0.1)
        assert sample.version == 0 and sample.token_versions is not None
        assert sample.token_versions.tolist() == versions
        assert len(filter_samples([sample], version=2, max_staleness=1, seen=SeenIds(8)).stale) == 1
        assert len(filter_samples([sample], version=1, max_staleness=1, seen=SeenIds(8)).keep) == 1


async def test_an_instance_that_starts_during_a_sync_never_answers_below_the_served_version(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    """The race of an instance that joins, restarts or migrates while a sync is under way: the sync lists the
    registered instances, the newcomer loads the version served at that moment and would join routing, then the
    sync commits the next version, which the newcomer does not hold. Requests sent once the new version is served
    must never be answered with the old one."""
    cfg = write_config(tmp_path, run_id)
    async with running(cfg, nats_url, 1) as s:
        named = await publish_weights(s, version=1, delta=0.03, announce=False)
        header, _ = flatten(MODEL, 1, named)
        ann = WeightsAnnounce(model=MODEL, version=1, object_name=s.names.weights_object(MODEL, 1),
                              checksum=header.checksum, nbytes=header.nbytes)
        kv = await s.nc.jetstream().key_value(s.names.kv_bucket)
        t0 = time.perf_counter()
        assert await s.paramsync.begin(ann) == ["0"]  # the sync covers the instances registered now

        late = RollouterService(cfg, nats_url=nats_url, instance="late", model=MODEL)
        task = asyncio.create_task(late.serve())
        try:
            for _ in range(1200):  # the newcomer starts meanwhile: it has loaded what is served and registered
                assert not task.done(), f"the new instance exited with {task.result()}"
                with contextlib.suppress(Exception):
                    if hasattr(late, "engine") and await late.kv.get(s.names.rollouter_key(MODEL, "late")):
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the new instance did not register")
            results = await s.paramsync.pause_and_load_all(["0"], ann)
            done = await s.paramsync.finish(ann, results, t0)
            assert done.loaded == ["0"] and await kv_get_int(kv, s.names.version_key(MODEL)) == 1

            # From now on v1 is served: the newcomer may take requests only with v1 loaded.
            req = GenRequest(request_id="after", prompts=[Array.of([BOS_ID, 49, 43], "int32")], max_new_tokens=2)
            for _ in range(1200):
                if late.routing:
                    break
                await asyncio.sleep(0.05)
            msg = await s.nc.request(s.names.gen_direct(MODEL, "late"), encode(req), timeout=30)
            resp = decode(GenResponse, msg.data)
            assert resp.error is None and resp.instance == "late", resp
            assert resp.version >= 1, f"answered with v{resp.version} while v1 was served"
            got = late.engine.named_tensors()
            assert all(torch.equal(got[k], named[k]) for k in named)
        finally:
            late.stop()
            assert await asyncio.wait_for(task, 30) == 0
