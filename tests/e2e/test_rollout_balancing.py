"""FlexMARL's rollout balancing with rollouter processes (`chorus serve rollouter`) in a running pipeline: an
instance started mid-run joins routing and gets requests within 10 s and leaves on SIGTERM without losing one; an
instance migrates to the other model and serves it at that model's current weight version."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
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


def yield_cpu(cluster: Cluster, cpus: list[int], nice: int = 19) -> None:
    """Every thread of the run's processes on ``cpus`` (all of them: none given) at niceness ``nice`` (raised only:
    lowering it back needs privileges, and then it stays)."""
    for child in cluster.sup.children.values():
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{child.popen.pid}/task")]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                if cpus:
                    os.sched_setaffinity(tid, cpus)
                if nice > os.getpriority(os.PRIO_PROCESS, tid):
                    os.setpriority(os.PRIO_PROCESS, tid, nice)


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
        # While it starts, the run's processes run at a lower priority and on every CPU but the first, the new
        # instance alone on the first: the 10 s measured are its start, load and join, not its share of a 2-core
        # machine with a dozen busy processes.
        cpus = sorted(os.sched_getaffinity(0))
        yield_cpu(cluster, cpus[1:])
        t0 = time.monotonic()
        extra = cluster.start("rollouter", VERIFIER, "9", cpus=cpus[:1] if len(cpus) > 1 else None)

        async def serving() -> bool:
            s = await status(nc, names, "rollouter", VERIFIER, "9")
            return bool(s) and s["counters"].get("requests", 0) > 0

        await until(serving, 30, "the extra instance answering requests", cluster)
        joined_s = time.monotonic() - t0
        yield_cpu(cluster, cpus, nice=0)
        print(f"extra instance: first request {joined_s:.1f}s after its start")
        assert joined_s < 10.0, f"the extra instance got its first request {joined_s:.1f}s after it was started\n{extra.tail(40)}"
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

        await until(moved_in, 60, "the migrated instance routing for the verifier's model", cluster)
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

        await until(used_by_the_coordinator, 30, "the coordinator sending the verifier's requests to it", cluster)
        gone = (await status(nc, names, "coordinator", None, "0"))["balance"]["instances"].get(SOLVER, {})

        async def left_the_solver() -> bool:
            bal = (await status(nc, names, "coordinator", None, "0"))["balance"]
            return "1" not in bal["instances"].get(SOLVER, {})

        await until(left_the_solver, 30, f"the solver's registry dropping instance 1 ({gone})", cluster)
    finally:
        codes = await cluster.stop_all()
        await nc.close()
    assert all(c == 0 for c in codes.values()), (codes, cluster.logs())
