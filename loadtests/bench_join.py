"""How soon a rollouter instance started in the middle of a run gets its first request.

    python loadtests/bench_join.py [--repeats 3]

FlexMARL's elastic instances are worth what their join costs: an instance added to a busy model must start, load
the served weights, register and be routed requests. Per repeat: the tiny two-model run (configs/tiny-chain.yaml,
every service its own process, `chorus serve`, against a real nats-server on a free port), two tasks in flight;
once both models trained v1, an extra instance of the verifier's model is started. While it starts, the run's
processes are niced to 19 and kept off the first CPU, and the new instance runs alone on it: the figure is its
start, weight load and join, not its share of a 2-core machine with a dozen busy processes.

Prints each repeat's seconds from the start of the process to the first request it answered, then
`join_s=<median> reference_s=10.0 ratio=<median / reference>` (reference: the 10 s docs/balancing.md gives a
tiny model's instance from its start to its first request; under 1 is within it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.kernel.subjects import Names  # noqa: E402
from shared.launcher.natsserver import NatsServer  # noqa: E402
from tests.e2e.cluster import Cluster  # noqa: E402
from tests.e2e.conftest import small_run_config  # noqa: E402
from tests.e2e.test_services_as_processes import MODELS, wait_for_bucket, wait_for_versions  # noqa: E402

REFERENCE_S = 10.0
VERIFIER = MODELS[1]


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


async def requests_answered(nc: Any, names: Names, instance: str) -> int:
    try:
        msg = await nc.request(names.status("rollouter", VERIFIER, instance), b"", timeout=2)
    except (nats.errors.Error, TimeoutError):
        return 0
    return int(json.loads(msg.data).get("counters", {}).get("requests", 0))


async def one_join(work: Path, nats_url: str) -> float:
    run_id = "j" + uuid.uuid4().hex[:10]
    work.mkdir(parents=True, exist_ok=True)
    cfg = small_run_config(work, run_id, sections={"balance": {"migrate": False}, "workflow": {"concurrency": 1}},
                           max_versions=10_000, global_batch=64, micro_batch=32)
    cluster = Cluster(cfg, nats_url, work / f"logs-{run_id}")
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    try:
        cluster.start_all(MODELS)
        kv = await wait_for_bucket(nc.jetstream(), names, cluster)
        await wait_for_versions(kv, cluster, 1, 300)
        cpus = sorted(os.sched_getaffinity(0))
        yield_cpu(cluster, cpus[1:])
        t0 = time.monotonic()
        cluster.start("rollouter", VERIFIER, "9", cpus=cpus[:1] if len(cpus) > 1 else None)
        deadline = t0 + 300
        while await requests_answered(nc, names, "9") == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the extra instance answered no request within 300 s\n{cluster.logs()}")
            await asyncio.sleep(0.1)
        return time.monotonic() - t0
    finally:
        await cluster.stop_all()
        await nc.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    joins = []
    with tempfile.TemporaryDirectory(prefix="bench-join-") as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            for i in range(args.repeats):
                s = await one_join(Path(tmp) / f"r{i}", server.url)
                joins.append(s)
                print(f"repeat {i + 1}: first request {s:.2f} s after the instance's start", flush=True)
        finally:
            server.stop()
    median = statistics.median(joins)
    print(f"join_s={median:.2f} reference_s={REFERENCE_S:.1f} ratio={median / REFERENCE_S:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
