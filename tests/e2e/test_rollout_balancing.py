"""FlexMARL's rollout balancing with rollouter processes (`chorus serve rollouter`) in a running pipeline: an
instance started mid-run joins routing and gets requests, and leaves on SIGTERM without losing one; an instance
migrates to the other model and serves it at that model's current weight version. (How soon an instance joins is
measured by loadtests/bench_join.py.)"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import nats

from shared.kernel.bus import kv_get_int
from shared.kernel.codec import decode, encode
from shared.kernel.schemas import Array, GenRequest, GenResponse, RolloutControl, RolloutControlReply
from shared.kernel.subjects import Names
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import small_run_config
from tests.e2e.test_services_as_processes import MODELS, wait_for_bucket, wait_for_versions

SOLVER, VERIFIER = MODELS


async def status(nc: Any, names: Names, service: str, model: str | None, instance: str) -> dict[str, Any]:
    try:
        msg = await nc.request(names.status(service, model, instance), b"", timeout=2)
    except (nats.errors.Error, TimeoutError):
        return {}
    return json.loads(msg.data)


async def until(cond: Any, timeout_s: float, what: str, cluster: Cluster) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await cond()
        if got:
            return got
        dead = [c.key for c in cluster.dead()]
        assert not dead, f"died: {dead}\n{cluster.logs()}"
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s:.0f}s\n{cluster.logs()}")


async def test_an_instance_joins_and_leaves_mid_run_and_one_migrates_to_the_other_model(nats_url, run_id, tmp_path):
    # a light run (two tasks in flight, a version per 32 samples) beside the instances' starts on a 2-core machine
    cfg = small_run_config(tmp_path, run_id, sections={"balance": {"migrate": False}, "workflow": {"concurrency": 1}},
                           max_versions=10_000, global_batch=64, micro_batch=32)
    names = Names(run_id)
    cluster = Cluster(cfg, nats_url, tmp_path / "logs")
    nc = await nats.connect(nats_url)
    try:
        cluster.start_all(MODELS)
        cluster.start("rollouter", SOLVER, "1")  # the solver can give one instance away
        js = nc.jetstream()
        kv = await wait_for_bucket(js, names, cluster)
        await wait_for_versions(kv, cluster, 1, 180)

        # --- an extra instance of the verifier's model, started mid-run --------------------------------------
        before = (await status(nc, names, "coordinator", None, "0"))["counters"]
        t0 = time.monotonic()
        extra = cluster.start("rollouter", VERIFIER, "9")

        async def serving() -> bool:
            s = await status(nc, names, "rollouter", VERIFIER, "9")
            return bool(s) and s["counters"].get("requests", 0) > 0

        await until(serving, 180, "the extra instance answering requests", cluster)
        print(f"extra instance: first request {time.monotonic() - t0:.1f}s after its start")
        extra.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(extra.popen.wait, 60) == 0, extra.tail(30)
        del cluster.sup.children[extra.key]
        await asyncio.sleep(2.0)
        after = (await status(nc, names, "coordinator", None, "0"))["counters"]
        # every request it took was answered: no error reply, nothing abandoned, no workflow failure
        for key in ("gen_error_replies", "tasks_abandoned", "workflow_failures"):
            assert after.get(key, 0) == before.get(key, 0), (key, before, after)

        # --- a solver instance migrates to the verifier's model ----------------------------------------------
        reply = decode(RolloutControlReply, (await nc.request(
            names.rollout_control(SOLVER, "1", "migrate"),
            encode(RolloutControl(verb="migrate", target=VERIFIER)), timeout=10)).data)
        assert reply.ok, reply
        moved = "solver_lm--1"

        async def moved_in() -> dict[str, Any]:
            s = await status(nc, names, "rollouter", VERIFIER, moved)
            return s if s.get("routing") else {}

        await until(moved_in, 180, "the migrated instance routing for the verifier's model", cluster)
        served = await kv_get_int(kv, Names.version_key(VERIFIER))
        req = GenRequest(request_id="migrated", prompts=[Array.of([1, 40, 41], "int32")], max_new_tokens=4,
                         temperature=1.0)
        resp = decode(GenResponse, (await nc.request(names.gen_direct(VERIFIER, moved), encode(req), timeout=30)).data)
        served_after = await kv_get_int(kv, Names.version_key(VERIFIER))
        assert resp.error is None and resp.instance == moved, resp
        assert served <= resp.version <= served_after, (served, resp.version, served_after)

        async def used_by_the_coordinator() -> bool:
            s = await status(nc, names, "rollouter", VERIFIER, moved)
            bal = (await status(nc, names, "coordinator", None, "0"))["balance"]
            return moved in bal["instances"].get(VERIFIER, {}) and s["counters"].get("requests", 0) > 1

        await until(used_by_the_coordinator, 120, "the coordinator sending the verifier's requests to it", cluster)
        gone = (await status(nc, names, "coordinator", None, "0"))["balance"]["instances"].get(SOLVER, {})

        async def left_the_solver() -> bool:
            bal = (await status(nc, names, "coordinator", None, "0"))["balance"]
            return "1" not in bal["instances"].get(SOLVER, {})

        await until(left_the_solver, 120, f"the solver's registry dropping instance 1 ({gone})", cluster)
    finally:
        codes = await cluster.stop_all()
        await nc.close()
    assert all(c == 0 for c in codes.values()), (codes, cluster.logs())
