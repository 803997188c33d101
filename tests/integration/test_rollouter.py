"""The rollouter service against a real nats-server: generation, batching, DLQ, control verbs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import torch

from services.rollouter.engine import SamplingParams, TorchEngine
from services.rollouter.service import RollouterService
from shared.kernel.codec import decode, encode
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, GenRequest, GenResponse, RolloutControl, RolloutControlReply
from shared.models.loading import load_model, shipped_tensors
from shared.models.tokenizer import BOS_ID, ByteTokenizer
from shared.models.weights import flatten, pack
from tests.waits import wait_until

MODEL = "m"


def write_config(tmp_path: Path, run_id: str, window_ms: float = 50.0, extra: str = "") -> ChorusConfig:
    p = tmp_path / "run.yaml"
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\n"
        f"models: {{{MODEL}: {{rollouter: {{batch_window_ms: {window_ms}, max_batch: 16}}}}}}\n"
        f"agents: {{solver: {{model: {MODEL}}}, verifier: {{model: {MODEL}}}}}\n"
        "metrics_interval_s: 0.2\n" + extra
    )
    return load_config(p)


async def start(svc: RollouterService) -> asyncio.Task[int]:
    """Serve in this loop; return once the instance is in routing (registered in KV before that)."""
    task = asyncio.create_task(svc.serve())
    for _ in range(1200):
        if task.done():
            raise AssertionError(f"service exited early with {task.result()}")
        if svc.routing:
            return task
        await asyncio.sleep(0.05)
    raise AssertionError("rollouter did not join routing")


@pytest.fixture
async def rollouter(nats_url: str, run_id: str, tmp_path: Path) -> AsyncIterator[RollouterService]:
    svc = RollouterService(write_config(tmp_path, run_id), nats_url=nats_url, instance="0", model=MODEL)
    task = await start(svc)
    yield svc
    svc.stop()
    assert await asyncio.wait_for(task, 30) == 0


def request(rid: str, texts: list[str], **kw: object) -> bytes:
    tok = ByteTokenizer()
    prompts = [Array.of(tok.encode(t), "int32") for t in texts]
    return encode(GenRequest(request_id=rid, prompts=prompts, **kw))  # type: ignore[arg-type]


async def test_gen_request_returns_one_output_per_prompt_with_version(rollouter: RollouterService,
                                                                      nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(rollouter.names.gen(MODEL), request("r1", ["1+2=", "hello"], max_new_tokens=5),
                               timeout=20)
        resp = decode(GenResponse, msg.data)
        assert resp.error is None and resp.request_id == "r1"
        assert resp.version == 0 and resp.instance == "0"
        assert len(resp.outputs) == 2
        for out in resp.outputs:
            assert 1 <= len(out.ids) <= 5 and out.logprobs.shape == out.ids.shape
            assert out.logprobs.dtype == "float32" and all(lp <= 0 for lp in out.logprobs.tolist())
        # the direct subject of the instance answers too
        msg = await nc.request(rollouter.names.gen_direct(MODEL, "0"), request("r2", ["x"], max_new_tokens=2),
                               timeout=20)
        assert decode(GenResponse, msg.data).request_id == "r2"
    finally:
        await nc.close()


async def test_concurrent_requests_are_batched_together(rollouter: RollouterService, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        reqs = [nc.request(rollouter.names.gen(MODEL), request(f"c{i}", [f"{i}+1="], max_new_tokens=3,
                                                                 temperature=0.0), timeout=20)
                for i in range(6)]
        replies = [decode(GenResponse, m.data) for m in await asyncio.gather(*reqs)]
        assert sorted(r.request_id for r in replies) == [f"c{i}" for i in range(6)]
        status = await nc.request(rollouter.names.status("rollouter", MODEL, "0"), b"", timeout=5)
        metrics = json.loads(status.data)
        # continuous batching: the requests ran in one batch together, not one after another (6 x 3 steps)
        assert metrics["engine"] == "continuous"
        assert metrics["max_requests_in_flight"] > 1
        assert metrics["steps"] < 6 * 3 and metrics["rows_generated"] == 6
    finally:
        await nc.close()


async def test_malformed_request_goes_to_dlq_and_service_keeps_answering(rollouter: RollouterService,
                                                                         nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        dlq = await nc.subscribe(rollouter.names.dlq("rollouter"))
        msg = await nc.request(rollouter.names.gen(MODEL), b"\x93\x01\x02", timeout=10)
        assert decode(GenResponse, msg.data).error
        dead = await dlq.next_msg(timeout=5)
        assert dead.data == b"\x93\x01\x02" and dead.headers and dead.headers["Chorus-Reason"]
        # token ids outside the vocabulary: decodes, but is rejected with a reason
        bad = encode(GenRequest(request_id="bad", prompts=[Array.of([BOS_ID, 999], "int32")], max_new_tokens=2))
        msg = await nc.request(rollouter.names.gen(MODEL), bad, timeout=10)
        resp = decode(GenResponse, msg.data)
        assert resp.request_id == "bad" and resp.error and "outside" in resp.error
        assert "outside" in (await dlq.next_msg(timeout=5)).headers["Chorus-Reason"]
        msg = await nc.request(rollouter.names.gen(MODEL), request("ok", ["2+2="], max_new_tokens=2), timeout=20)
        ok = decode(GenResponse, msg.data)
        assert ok.error is None and len(ok.outputs) == 1
        assert rollouter.counters["dlq"] == 2
    finally:
        await nc.close()


async def test_requests_sent_while_paused_wait_and_are_served_after_resume(rollouter: RollouterService,
                                                                           nats_url: str) -> None:
    nc = await nats.connect(nats_url)

    async def control(verb: str) -> RolloutControlReply:
        m = await nc.request(rollouter.names.rollout_control(MODEL, "0", verb),
                             encode(RolloutControl(verb=verb, timeout_s=5)), timeout=10)  # type: ignore[arg-type]
        return decode(RolloutControlReply, m.data)

    try:
        assert (await control("pause")).ok
        pending = asyncio.create_task(nc.request(rollouter.names.gen(MODEL), request("p", ["hi"], max_new_tokens=2),
                                                 timeout=20))
        await wait_until(lambda: rollouter.batcher.queued == 1, "the request queued while paused")
        assert not pending.done()
        info = await control("info")
        assert info.ok and info.in_flight == 0
        assert (await control("resume")).ok
        resp = decode(GenResponse, (await pending).data)
        assert resp.error is None and resp.request_id == "p"
    finally:
        await nc.close()


async def test_graceful_stop_deregisters_the_instance(nats_url: str, run_id: str, tmp_path: Path) -> None:
    svc = RollouterService(write_config(tmp_path, run_id), nats_url=nats_url, instance="3", model=MODEL)
    task = await start(svc)
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(svc.names.kv_bucket)
        entry = await kv.get(svc.names.rollouter_key(MODEL, "3"))
        assert json.loads(entry.value)["instance"] == "3"
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0
        with pytest.raises(Exception):  # noqa: B017 - deleted key: KeyDeletedError or KeyNotFoundError
            await kv.get(svc.names.rollouter_key(MODEL, "3"))
    finally:
        await nc.close()


async def test_pause_waits_for_in_flight_generation_to_finish(rollouter: RollouterService, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        gen = asyncio.create_task(nc.request(rollouter.names.gen(MODEL), request("long", ["a"] * 8, max_new_tokens=150),
                                             timeout=30))
        await wait_until(lambda: rollouter.batcher.in_flight, "the request in flight", interval_s=0.01)
        assert rollouter.batcher.in_flight == 1 and rollouter.batcher.stats.requests == 0
        m = await nc.request(rollouter.names.rollout_control(MODEL, "0", "pause"),
                             encode(RolloutControl(verb="pause", timeout_s=20)), timeout=25)
        reply = decode(RolloutControlReply, m.data)
        # the pause was answered only after the generation in flight had finished
        assert reply.ok and reply.in_flight == 0 and rollouter.batcher.stats.requests == 1
        resp = decode(GenResponse, (await gen).data)
        assert resp.error is None and len(resp.outputs) == 8
        assert rollouter.batcher.paused
    finally:
        await nc.close()


async def test_a_pause_without_a_controller_expires_and_the_instance_resumes(nats_url: str, run_id: str,
                                                                              tmp_path: Path) -> None:
    cfg = write_config(tmp_path, run_id, extra="paramsync: {pause_timeout_s: 0.2, load_timeout_s: 0.2}\n")
    svc = RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL)
    task = await start(svc)
    nc = await nats.connect(nats_url)
    try:
        m = await nc.request(svc.names.rollout_control(MODEL, "0", "pause"),
                             encode(RolloutControl(verb="pause", timeout_s=1)), timeout=5)
        assert decode(RolloutControlReply, m.data).ok and svc.batcher.paused
        await wait_until(lambda: not svc.batcher.paused, "the instance resumed by itself", interval_s=0.1)
        assert not svc.batcher.paused and svc.counters["auto_resumes"] == 1
    finally:
        await nc.close()
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def _lease_of(nc: nats.aio.client.Client, svc: RollouterService, ctl: RolloutControl) -> float:
    """Send ``ctl`` (a pause nobody resumes and no controller watches): the lease the instance took for it, once
    the instance resumed by itself (nothing but the lease running out can resume it)."""
    m = await nc.request(svc.names.rollout_control(MODEL, "0", "pause"), encode(ctl), timeout=10)
    assert decode(RolloutControlReply, m.data).ok and svc.batcher.paused
    lease = svc._pause_lease
    await wait_until(lambda: not svc.batcher.paused, "the instance resumed by itself", interval_s=0.02)
    return lease


async def test_a_pause_lasts_as_long_as_it_says_with_the_default_sync_timeouts(nats_url: str, run_id: str,
                                                                               tmp_path: Path) -> None:
    # The default paramsync timeouts (30 s pause, 60 s load): one stray pause whose own timeout is 1 s, with no
    # resume after it, once froze the instance for 1.5 x (30 + 60) + 1 = 136 s whatever it said.
    svc = RollouterService(write_config(tmp_path, run_id), nats_url=nats_url, instance="0", model=MODEL)
    task = await start(svc)
    nc = await nats.connect(nats_url)
    try:
        lease = await _lease_of(nc, svc, RolloutControl(verb="pause", timeout_s=1))
        assert lease == 1.0, lease  # its own second, not the sync's 136 s
        lease = await _lease_of(nc, svc, RolloutControl(verb="pause", timeout_s=1, lease_s=3))
        assert lease == 3.0, lease  # a lease named in the message wins over the drain timeout
        assert svc.counters["auto_resumes"] == 2
    finally:
        await nc.close()
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def test_no_pause_outlasts_paramsync_max_pause_s(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, run_id, extra="paramsync: {pause_timeout_s: 0.5, load_timeout_s: 0.5, "
                                                "max_pause_s: 2}\n")
    svc = RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL)
    task = await start(svc)
    nc = await nats.connect(nats_url)
    try:
        lease = await _lease_of(nc, svc, RolloutControl(verb="pause", timeout_s=1, lease_s=1e9))
        assert lease == 2.0, lease  # capped at paramsync.max_pause_s
        assert svc.counters["auto_resumes"] == 1
    finally:
        await nc.close()
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def test_a_pause_from_a_sync_that_gave_up_on_the_instance_ends_with_that_sync(nats_url: str, run_id: str,
                                                                                      tmp_path: Path) -> None:
    # A paramsync that found the instance unreachable (its pause was on its way through a broker restart) drops it
    # from the sync and resumes only the others; it is alive, so its probes answer, and the load lease is 136 s.
    svc = RollouterService(write_config(tmp_path, run_id), nats_url=nats_url, instance="0", model=MODEL)
    task = await start(svc)
    nc = await nats.connect(nats_url)
    controller = "test.paramsync.status"

    async def alive(m: nats.aio.msg.Msg) -> None:
        await m.respond(b"{}")

    sub = await nc.subscribe(controller, cb=alive)
    js = nc.jetstream()
    kv = await js.key_value(svc.names.kv_bucket)
    key = svc.names.sync_key(MODEL)

    async def sync_state(phase: str, version: int, instances: list[str]) -> None:
        await kv.put(key, json.dumps({"phase": phase, "version": version, "instances": instances,
                                      "paramsync": "0"}).encode())

    try:
        await sync_state("running", 7, ["0", "1"])
        m = await nc.request(svc.names.rollout_control(MODEL, "0", "pause"),
                             encode(RolloutControl(verb="pause", version=7, timeout_s=1, lease_s=136, peer=controller)),
                             timeout=10)
        assert decode(RolloutControlReply, m.data).ok and svc.batcher.paused
        # while its sync runs and lists it, the pause holds (several probe intervals)
        probes = svc.cfg.peers.probe_interval_s
        await asyncio.sleep(4 * probes)
        assert svc.batcher.paused and svc.counters["auto_resumes"] == 0
        await sync_state("running", 7, ["1"])  # the sync dropped it: over for this instance
        await wait_until(lambda: not svc.batcher.paused, "the instance resumed by itself", interval_s=0.05)
        assert time.monotonic() < svc._pause_until, "resumed by the lease, not by the sync's end"
        assert svc.counters["auto_resumes"] == 1

        await sync_state("running", 8, ["0"])
        m = await nc.request(svc.names.rollout_control(MODEL, "0", "pause"),
                             encode(RolloutControl(verb="pause", version=8, timeout_s=1, lease_s=136, peer=controller)),
                             timeout=10)
        assert decode(RolloutControlReply, m.data).ok and svc.batcher.paused
        await sync_state("done", 8, ["0"])  # done, and no resume came
        await wait_until(lambda: not svc.batcher.paused, "the instance resumed by itself", interval_s=0.05)
        assert svc.counters["auto_resumes"] == 2
    finally:
        await sub.unsubscribe()
        await nc.close()
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


def write_lora_config(tmp_path: Path, run_id: str) -> ChorusConfig:
    p = tmp_path / "lora.yaml"
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\n"
        f"models: {{{MODEL}: {{lora: {{r: 4}}, rollouter: {{batch_window_ms: 200, max_batch: 16}}}}}}\n"
        f"agents: {{solver: {{model: {MODEL}, adapter: sol}}, verifier: {{model: {MODEL}, adapter: ver}}}}\n"
    )
    return load_config(p)


async def test_a_lora_rollouter_serves_each_adapter_and_refuses_unknown_ones(nats_url: str, run_id: str,
                                                                              tmp_path: Path) -> None:
    cfg = write_lora_config(tmp_path, run_id)
    # v1: adapters that differ from each other (fresh ones are no-ops), shipped as the trainer ships them
    trained = load_model(cfg, MODEL).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in shipped_tensors(trained, lora=True).values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.3)
    header, buf = flatten(MODEL, 1, shipped_tensors(trained, lora=True))
    local = TorchEngine(trained)
    texts = ["1+2=", "hello"]
    prompts = [ByteTokenizer().encode(t) for t in texts]
    expected = {a: local.generate(prompts, [SamplingParams(max_new_tokens=6, temperature=0.0)] * 2, [a] * 2)
                for a in ("sol", "ver")}
    assert [r.ids for r in expected["sol"]] != [r.ids for r in expected["ver"]]  # a misrouted row would show

    svc = RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL)
    task = await start(svc)
    nc = await nats.connect(nats_url)
    try:
        obj = await nc.jetstream().object_store(svc.names.obj_bucket)
        await obj.put(svc.names.weights_object(MODEL, 1), pack(header, buf))
        m = await nc.request(svc.names.rollout_control(MODEL, "0", "load"),
                             encode(RolloutControl(verb="load", version=1, object_name=svc.names.weights_object(MODEL, 1),
                                                   checksum=header.checksum, timeout_s=10)), timeout=15)
        loaded = decode(RolloutControlReply, m.data)
        assert loaded.ok and loaded.version == 1 and loaded.checksum == header.checksum

        reqs = [nc.request(svc.names.gen(MODEL), request(a, texts, max_new_tokens=6, temperature=0.0, adapter=a),
                           timeout=20) for a in ("sol", "ver")]
        replies = {r.request_id: r for r in (decode(GenResponse, m.data) for m in await asyncio.gather(*reqs))}
        for a in ("sol", "ver"):
            assert replies[a].error is None and replies[a].version == 1
            for o, r in zip(replies[a].outputs, expected[a], strict=True):
                assert o.ids.tolist() == r.ids
                assert torch.allclose(torch.tensor(o.logprobs.tolist()), torch.tensor(r.logprobs), atol=1e-4)
        assert svc.batcher.stats.max_adapters_per_batch == 2  # both adapters in one forward pass per step

        # stop strings travel with the request: the row ends once its text contains one
        tok = ByteTokenizer()
        stop = tok.decode(expected["ver"][0].ids[2:4])
        m = await nc.request(svc.names.gen(MODEL), request("s", texts[:1], max_new_tokens=6, temperature=0.0,
                                                          adapter="ver", stop=[stop]), timeout=20)
        out = decode(GenResponse, m.data).outputs[0]
        assert out.finish == "stop" and stop in tok.decode(out.ids.tolist())
        assert out.ids.tolist() == expected["ver"][0].ids[: len(out.ids)] and len(out.ids) <= 4

        dlq_before = svc.counters["dlq"]
        m = await nc.request(svc.names.gen(MODEL), request("u", texts, max_new_tokens=2, adapter="nope"), timeout=10)
        bad = decode(GenResponse, m.data)
        assert bad.request_id == "u" and bad.error and "'nope'" in bad.error and "sol" in bad.error
        assert svc.counters["dlq"] == dlq_before + 1
        m = await nc.request(svc.names.gen(MODEL), request("after", texts[:1], max_new_tokens=2, adapter="sol"),
                             timeout=20)
        after = decode(GenResponse, m.data)
        assert after.error is None and after.version == 1 and len(after.outputs[0].ids) >= 1
    finally:
        await nc.close()
        svc.stop()
        assert await asyncio.wait_for(task, 30) == 0


async def test_a_request_past_its_deadline_is_answered_with_an_error_not_generated(rollouter: RollouterService,
                                                                                  nats_url: str) -> None:
    """The backlog a frozen instance finds when it wakes: its requesters gave up, nobody waits for the rows."""
    import time

    nc = await nats.connect(nats_url)
    try:
        late = request("late", ["1+1="], max_new_tokens=3, deadline=time.time() - 1)
        resp = decode(GenResponse, (await nc.request(rollouter.names.gen(MODEL), late, timeout=10)).data)
        assert resp.error and resp.error.startswith("expired") and not resp.outputs
        assert rollouter.counters["expired_on_arrival"] == 1 and rollouter.batcher.stats.batches == 0
        fresh = request("fresh", ["1+1="], max_new_tokens=3, deadline=time.time() + 30)
        resp = decode(GenResponse, (await nc.request(rollouter.names.gen(MODEL), fresh, timeout=10)).data)
        assert resp.error is None and len(resp.outputs) == 1
    finally:
        await nc.close()


async def test_a_rollouter_on_a_device_the_machine_lacks_stops_the_run_naming_the_key(
        nats_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from shared.kernel.service import EX_RUN_FAILED

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write_config(tmp_path, run_id)
    cfg.models[MODEL].device = "cuda"
    code = await asyncio.wait_for(RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL).serve(), 30)
    assert code == EX_RUN_FAILED
    out = capsys.readouterr()
    assert "models.m.device is cuda but torch.cuda.is_available() is False" in out.out + out.err


async def test_a_vllm_rollouter_where_vllm_is_missing_stops_the_run_naming_the_extra(
        nats_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from shared.kernel.service import EX_RUN_FAILED

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    cfg = write_config(tmp_path, run_id)
    cfg.models[MODEL].rollouter.backend = "vllm"
    code = await asyncio.wait_for(RollouterService(cfg, nats_url=nats_url, instance="0", model=MODEL).serve(), 30)
    assert code == EX_RUN_FAILED
    out = capsys.readouterr()
    assert "rollouter.backend vllm needs the vllm package" in out.out + out.err and "make venv-vllm" in out.out + out.err
