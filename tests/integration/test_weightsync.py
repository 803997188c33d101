"""Weight sync through both transports against a real nats-server and real UCX endpoints.

The test plays the trainer with the same WeightSource the trainer service uses; rollouters and paramsync
are the real services.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
import torch

from services.paramsync.service import ParamSyncService
from services.rollouter.engine import SamplingParams, TorchEngine
from services.rollouter.service import RollouterService
from shared.kernel.bus import kv_get_int
from shared.kernel.codec import decode, encode
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, GenRequest, GenResponse, SyncDone, WeightsAnnounce
from shared.kernel.service import Service
from shared.kernel.subjects import Names
from shared.models.loading import load_model, shipped_tensors
from shared.models.tokenizer import BOS_ID
from shared.models.weights import flatten, load_into
from shared.models.weightsync import NatsSource, UcxSource, WeightSource

ARCH = "{hidden_size: 64, num_layers: 2, num_heads: 2, intermediate_size: 128, max_position: 64}"
PROMPT = [BOS_ID, 49, 43, 50, 61]
NEW_TOKENS = 8


def write_config(tmp_path: Path, run_id: str, transport: str, models: tuple[str, ...] = ("m",)) -> ChorusConfig:
    p = tmp_path / "run.yaml"
    model_map = ", ".join(f"{m}: {{arch: {ARCH}, rollouter: {{batch_window_ms: 1}}}}" for m in models)
    agents = f"solver: {{model: {models[0]}}}, verifier: {{model: {models[-1]}}}"
    p.write_text(
        f"run: {{id: {run_id}, dir: {tmp_path / 'runs'}}}\n"
        f"models: {{{model_map}}}\n"
        f"agents: {{{agents}}}\n"
        f"paramsync: {{transport: {transport}, bucket_mb: 0.125, pause_timeout_s: 3, load_timeout_s: 10}}\n"
        "metrics_interval_s: 0.5\n"
    )
    return load_config(p)


async def serve(svc: Service, registered: bool) -> asyncio.Task[int]:
    task = asyncio.create_task(svc.serve())
    for _ in range(1200):
        if task.done():
            raise AssertionError(f"{svc.name} exited early with {task.result()}")
        if registered and getattr(svc, "routing", False):  # registered, then in routing
            return task
        elif not registered and hasattr(svc, "queue"):
            return task
        await asyncio.sleep(0.05)
    raise AssertionError(f"{svc.name} did not start")


@contextlib.asynccontextmanager
async def services(cfg: ChorusConfig, nats_url: str, instances: int = 1) -> AsyncIterator[dict[str, list[Any]]]:
    """Per model: ``instances`` rollouters and a paramsync; stopped cleanly (exit 0) at the end."""
    out: dict[str, list[Any]] = {}
    tasks = []
    try:
        for model in cfg.models:
            rs = [RollouterService(cfg, nats_url=nats_url, instance=str(i), model=model) for i in range(instances)]
            ps = ParamSyncService(cfg, nats_url=nats_url, model=model)
            tasks += [await serve(r, True) for r in rs] + [await serve(ps, False)]
            out[model] = [*rs, ps]
        yield out
    finally:
        for group in out.values():
            for svc in group:
                svc.stop()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 30) == [0] * len(tasks)


def version_weights(cfg: ChorusConfig, model: str, version: int) -> dict[str, torch.Tensor]:
    """Weights of a made-up version: a fresh random model per version, so greedy outputs tell versions apart."""
    torch.manual_seed(1000 + version)
    net = load_model(cfg, model)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.5)
    return {k: v.detach().clone() for k, v in shipped_tensors(net, lora=False).items()}


def reference_output(cfg: ChorusConfig, model: str, named: dict[str, torch.Tensor]) -> list[int]:
    """Greedy tokens of PROMPT on a separate engine holding ``named``: what the served version must answer."""
    net = load_model(cfg, model)
    header, buf = flatten(model, 0, named)
    load_into(shipped_tensors(net, lora=False), header, buf)
    engine = TorchEngine(net)
    (out,) = engine.generate([PROMPT], [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)])
    return list(out.ids)


class Trainer:
    """The test's trainer: flattens a version, hands it to a real WeightSource, announces it."""

    def __init__(self, cfg: ChorusConfig, nc: Any, model: str, transport: str) -> None:
        self.cfg, self.nc, self.model, self.names = cfg, nc, model, Names(cfg.run.id)
        self.source: WeightSource = (UcxSource(cfg, self.names, model, nc) if transport == "ucx"
                                     else NatsSource(cfg, self.names, model, nc.jetstream()))

    async def publish(self, version: int, named: dict[str, torch.Tensor]) -> WeightsAnnounce:
        header, buf = flatten(self.model, version, named, bucket_bytes=self.source.bucket_bytes,
                              out=self.source.spare())
        name = await self.source.publish(header, buf)
        ann = WeightsAnnounce(model=self.model, version=version, transport=self.source.transport,  # type: ignore[arg-type]
                              object_name=name, checksum=header.checksum, nbytes=header.nbytes)
        await self.nc.publish(self.names.sync_announce(self.model), encode(ann))
        return ann


async def generate(nc: Any, names: Names, model: str, rid: str = "g") -> GenResponse:
    req = GenRequest(request_id=rid, prompts=[Array.of(PROMPT, "int32")], max_new_tokens=NEW_TOKENS,
                     temperature=0.0)
    msg = await nc.request(names.gen(model), encode(req), timeout=20)
    resp = decode(GenResponse, msg.data)
    assert resp.error is None, resp.error
    return resp


@pytest.mark.parametrize("transport", [pytest.param("ucx", marks=pytest.mark.ucx), "nats"])
async def test_both_transports_deliver_bit_identical_weights_that_the_next_generation_uses(
        nats_url: str, run_id: str, tmp_path: Path, transport: str) -> None:
    cfg = write_config(tmp_path, run_id, transport)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    trainer = Trainer(cfg, nc, "m", transport)
    await trainer.source.start()
    try:
        async with services(cfg, nats_url, instances=2) as svcs:
            rollouters: list[RollouterService] = svcs["m"][:2]
            before = await generate(nc, names, "m")
            assert before.version == 0
            done_sub = await nc.subscribe(names.sync_done("m"))
            for version in (1, 2):
                named = version_weights(cfg, "m", version)
                ann = await trainer.publish(version, named)
                assert ann.nbytes > 3 * 128 * 1024  # several 128 KB buckets
                done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
                assert done.version == version and done.loaded == ["0", "1"] and done.failed == {}
                for r in rollouters:
                    got = r.engine.named_tensors()
                    assert set(got) == set(named)
                    assert all(torch.equal(got[k], named[k]) for k in named)  # bit for bit
                    assert r.checksum == ann.checksum and r.engine.version == version
                    assert r.counters[f"loads_{transport}"] == version
                want = reference_output(cfg, "m", named)
                for i in range(4):  # the queue group spreads these over both instances
                    resp = await generate(nc, names, "m", f"g{version}.{i}")
                    assert resp.version == version and resp.outputs[0].ids.tolist() == want
            assert before.outputs[0].ids.tolist() != want
            kv = await nc.jetstream().key_value(names.kv_bucket)
            assert await kv_get_int(kv, names.version_key("m")) == 2
            if transport == "ucx":
                assert trainer.source.counters["pulls"] == 4  # 2 instances x 2 versions
                assert trainer.source.counters["bytes_sent"] == 4 * ann.nbytes
    finally:
        await trainer.source.close()
        await nc.close()


@pytest.mark.ucx
async def test_a_model_keeps_serving_while_another_syncs_and_no_answer_mixes_two_versions(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    """Model b syncs ten versions while both models answer a steady stream of greedy requests.

    Model a is never paused and answers throughout b's syncs; every answer of b equals the greedy output of
    exactly the version it reports (a batch straddling a load would match neither version).
    """
    cfg = write_config(tmp_path, run_id, "ucx", models=("a", "b"))
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    trainer = Trainer(cfg, nc, "b", "ucx")
    await trainer.source.start()
    versions = range(1, 11)
    weights = {v: version_weights(cfg, "b", v) for v in versions}
    expected_b = {0: None, **{v: reference_output(cfg, "b", w) for v, w in weights.items()}}
    paused: list[tuple[str, float]] = []  # (verb, time) of b's pause/resume controls
    a_answers: list[tuple[float, int]] = []
    b_answers: list[tuple[int, list[int]]] = []
    stop = asyncio.Event()

    async def on_control(msg: Any) -> None:
        paused.append((msg.subject.rsplit(".", 1)[-1], time.monotonic()))

    async def client(model: str) -> None:
        i = 0
        while not stop.is_set():
            resp = await generate(nc, names, model, f"{model}{i}")
            i += 1
            if model == "a":
                a_answers.append((time.monotonic(), resp.version))
            else:
                b_answers.append((resp.version, resp.outputs[0].ids.tolist()))

    try:
        async with services(cfg, nats_url) as svcs:
            ra: RollouterService = svcs["a"][0]
            rb: RollouterService = svcs["b"][0]
            expected_b[0] = (await generate(nc, names, "b")).outputs[0].ids.tolist()
            for verb in ("pause", "resume"):
                await nc.subscribe(names.rollout_control("b", "0", verb), cb=on_control)
            clients = [asyncio.create_task(client("a")), asyncio.create_task(client("b"))]
            await asyncio.sleep(1.0)
            done_sub = await nc.subscribe(names.sync_done("b"))
            for v in versions:
                await trainer.publish(v, weights[v])
                done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
                assert done.loaded == ["0"] and done.version == v
                await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*clients)

            assert ra.counters["control_pause"] == 0 and ra.engine.version == 0
            assert rb.counters["control_pause"] == len(versions) and rb.engine.version == versions[-1]
            # no answer of b mixes versions: each is exactly the greedy output of the version it reports
            seen = {v for v, _ in b_answers}
            assert len(seen) >= 5, seen
            wrong = [(v, ids) for v, ids in b_answers if ids != expected_b[v]]
            assert not wrong, wrong[:3]
            # a answers while b is paused, at about the rate it has when b is not syncing
            windows = []
            for (verb, t0), (verb2, t1) in zip(paused[::2], paused[1::2], strict=False):
                assert (verb, verb2) == ("pause", "resume")
                windows.append((t0, t1))
            assert len(windows) == len(versions)
            inside = sum(1 for t, _ in a_answers if any(t0 <= t <= t1 for t0, t1 in windows))
            sync_s = sum(t1 - t0 for t0, t1 in windows)
            span = a_answers[-1][0] - a_answers[0][0]
            rate_in = inside / sync_s
            rate_out = (len(a_answers) - inside) / (span - sync_s)
            print(f"model a: {rate_in:.1f} answers/s during b's syncs ({sync_s:.2f} s), {rate_out:.1f} outside")
            assert inside > 0 and rate_in > 0.25 * rate_out
    finally:
        stop.set()
        await trainer.source.close()
        await nc.close()


@pytest.mark.ucx
async def test_an_instance_that_cannot_load_is_retried_reported_and_kept_out_of_routing_until_it_catches_up(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    """Instance 1 receives a corrupted bucket on every try: the real checks refuse it and nothing is written;
    v1 is served by instance 0 alone until instance 1 loads it by itself and comes back."""
    cfg = write_config(tmp_path, run_id, "ucx")
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    trainer = Trainer(cfg, nc, "m", "ucx")
    await trainer.source.start()
    corrupt = {"on": True, "count": 0}
    try:
        async with services(cfg, nats_url, instances=2) as svcs:
            r0, r1, ps = svcs["m"]
            sink = r1._sink("ucx")
            real_fetch = sink.fetch

            async def flaky_fetch(version: int, **kw: Any) -> Any:
                header, body = await real_fetch(version, **kw)
                if corrupt["on"]:
                    corrupt["count"] += 1
                    body[len(body) // 2] ^= 0x01  # one bit of one bucket, as a broken transfer would leave it
                return header, body

            sink.fetch = flaky_fetch  # type: ignore[method-assign]
            v0 = {k: v.clone() for k, v in r1.engine.named_tensors().items()}
            done_sub = await nc.subscribe(names.sync_done("m"))
            named = version_weights(cfg, "m", 1)
            await trainer.publish(1, named)
            done = decode(SyncDone, (await done_sub.next_msg(timeout=30)).data)
            assert done.loaded == ["0"] and list(done.failed) == ["1"] and "bucket" in done.failed["1"]
            assert corrupt["count"] >= cfg.paramsync.load_attempts == 2  # retried, then given up (and catch-ups)
            assert ps.counters["load_retries"] == 1 and ps.counters["load_gave_up"] == 1
            kv = await nc.jetstream().key_value(names.kv_bucket)
            assert await kv_get_int(kv, names.version_key("m")) == 1
            # nothing of the refused transfers was written; out of routing; the live instance answers, on v1
            assert r1.engine.version == 0 and all(torch.equal(v0[k], v) for k, v in r1.engine.named_tensors().items())
            assert not r1.routing and r0.routing
            for i in range(6):
                resp = await generate(nc, names, "m", f"r{i}")
                assert resp.instance == "0" and resp.version == 1
            # the fault clears: instance 1 loads the served version by itself and comes back
            corrupt["on"] = False
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not (r1.routing and r1.engine.version == 1):
                await asyncio.sleep(0.1)
            assert r1.routing and r1.engine.version == 1 and r1.counters["catch_ups"] >= 1
            got = r1.engine.named_tensors()
            assert all(torch.equal(got[k], named[k]) for k in named)
            answered = {(await generate(nc, names, "m", f"s{i}")).instance for i in range(12)}
            assert answered == {"0", "1"}
    finally:
        await trainer.source.close()
        await nc.close()
