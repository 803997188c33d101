"""FlexMARL's hierarchical load balancing, measured: a skewed multi-agent workload over a fixed pool of rollouter
instances under random dispatch, intra-agent balancing only, and intra- + inter-agent balancing.

    python loadtests/bench_loadbalance.py [--requests 2000] [--concurrency 16] [--repeats 3]

Two models, one agent each; agent `a` receives 76% of the requests (FlexMARL §3, Observation #2), response lengths
are long-tailed (lognormal, 4 to 96 tokens). Four rollouter instances, two per model, run as separate processes
(`python -m services.rollouter`) against one real nats-server; each serves one request (a group of 4 rows) at a
time. A driver keeps `--concurrency` requests in flight, sending them as the coordinator does:

- `random`: to the model's NATS queue group (NATS picks an instance at random);
- `intra`: the coordinator's rollout manager, least-loaded instance of the model (services/coordinator/routing.py),
  no migration;
- `intra_inter`: the same, and instances migrate from the least to the most loaded model when their queue lengths
  differ by more than Δ = 5.

Each instance gets its own CPU budget, as each instance of a real deployment has its own accelerator: a cgroup
(v1 `cpu` controller) with a CFS quota of the machine's CPUs divided among the instances; an idle instance's budget
is then idle capacity, as an idle accelerator is. Without a writable cgroup CPU controller (not root, or cgroup v2
only) the instances share the CPUs and the benchmark says so: balancing cannot show a gain when every instance can
use every core.

Prints throughput (rows per second) and makespan per mode (median of `--repeats` runs, modes alternating), and
ends with `ratio intra=<x> intra_inter=<y>`: throughput over random dispatch, each repeat's ratio measured side by
side, the median of the repeats'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import nats
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("a", "b")
SKEW = 0.76  # share of requests for model a
GROUP = 4  # rows per request
INSTANCES = {"a": 2, "b": 2}
MODES = ("random", "intra", "intra_inter")
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
HEADROOM = 1.0


def config(run_dir: Path, mode: str) -> dict[str, Any]:
    model = {"arch": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
                      "max_position": 128},
             "rollouter": {"max_batch": GROUP, "threads": 1, "request_timeout_s": 120.0, "engine": "continuous"}}
    return {
        "run": {"id": f"lb-{mode}", "dir": str(run_dir), "seed": 0},
        "models": {m: model for m in MODELS},
        "agents": {"solver": {"model": "a"}, "verifier": {"model": "b"}},
        "balance": {"dispatch": "random" if mode == "random" else "least_loaded", "migrate": mode == "intra_inter",
                    "delta": 5, "poll_s": 0.5, "cooldown_s": 5.0},
        "paramsync": {"transport": "nats"},
        "metrics_interval_s": 1.0,
    }


def workload(n: int, seed: int) -> list[tuple[str, int, list[int]]]:
    """(model, max_new_tokens, prompt) per request: 76% to a, lognormal lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        model = "a" if rng.random() < SKEW else "b"
        tokens = int(min(96, max(4, rng.lognormvariate(2.8, 0.8))))  # median ~16
        out.append((model, tokens, [1, *(rng.randrange(3, 250) for _ in range(8))]))
    return out


# --- per-instance CPU budgets ------------------------------------------------------------------------------------------
class Budgets:
    """A cgroup per instance with a CFS quota; ``ok`` False where the cpu controller cannot be written."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.base = CGROUP_ROOT / f"chorus-bench-{os.getpid()}"
        self.ok = False
        try:
            self.base.mkdir()
            self.ok = True
        except OSError:
            pass

    def put(self, name: str, pid: int) -> None:
        if not self.ok:
            return
        group = self.base / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(100000 * self.share)))
        (group / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if not self.ok:
            return
        for group in self.base.iterdir():
            if group.is_dir():
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (CGROUP_ROOT / "cgroup.procs").write_text(pid)
                with contextlib.suppress(OSError):
                    group.rmdir()
        with contextlib.suppress(OSError):
            self.base.rmdir()


# --- the driver --------------------------------------------------------------------------------------------------------
class Host:
    """What RolloutRouter needs of its service."""

    def __init__(self, nc: Any, cfg: Any) -> None:
        from shared.kernel.subjects import Names

        self.nc, self.js, self.cfg = nc, nc.jetstream(), cfg
        self.names = Names(cfg.run.id)
        self.counters: Counter[str] = Counter()
        self.stopping = False
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        return task

    async def to_dlq(self, subject: str, data: bytes, reason: str) -> None:
        self.counters["dlq"] += 1


async def drive(mode: str, url: str, cfg: Any, work: list[tuple[str, int, list[int]]], concurrency: int
                ) -> dict[str, Any]:
    import structlog

    from services.coordinator.routing import RolloutRouter
    from shared.kernel.codec import decode, encode
    from shared.kernel.config import PeersSection
    from shared.kernel.peers import PeerWatch, ReplyMux
    from shared.kernel.schemas import Array, GenRequest, GenResponse

    nc = await nats.connect(url)
    host = Host(nc, cfg)
    peers = PeersSection()
    watch = PeerWatch(nc, peers)
    watcher = asyncio.ensure_future(watch.run())
    mux = await ReplyMux(nc, watch, peers).start()
    router = RolloutRouter(host, mux, list(MODELS), structlog.get_logger("bench"))
    if mode != "random":
        await router.start()
        deadline = time.monotonic() + 30
        while any(len(router.manager.live(m)) < n for m, n in INSTANCES.items()):
            assert time.monotonic() < deadline, "the instances did not report in 30 s"
            await asyncio.sleep(0.1)
    queue = list(enumerate(work))
    rows = 0
    served: Counter[str] = Counter()

    async def one(i: int, model: str, tokens: int, prompt: list[int]) -> None:
        nonlocal rows
        req = GenRequest(request_id=f"r{i}", prompts=[Array.of(prompt, "int32")] * GROUP, max_new_tokens=tokens,
                         temperature=1.0)
        data = encode(req)
        if mode == "random":
            raw = await mux.request(host.names.gen(model), data, 300.0)
        else:
            raw = await router.request(model, GROUP, lambda: data, 300.0)
        resp = decode(GenResponse, raw)
        assert resp.error is None, resp.error
        rows += len(resp.outputs)
        served[f"{model}/{resp.instance}"] += 1

    async def worker() -> None:
        while queue:
            i, (model, tokens, prompt) = queue.pop(0)
            await one(i, model, tokens, prompt)

    t0, wall0 = time.monotonic(), time.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    makespan = time.monotonic() - t0
    host.stopping = True
    for t in host.tasks:
        t.cancel()
    watcher.cancel()
    await asyncio.gather(*host.tasks, watcher, return_exceptions=True)
    await mux.close()
    await nc.close()
    return {"makespan": makespan, "throughput": rows / makespan, "served": dict(served),
            "migrations": host.counters["migrations"], "requeued": host.counters["gen_requeued"],
            "migrated_at": [round(m["time"] - wall0, 1) for m in router.migrations]}


async def run_mode(mode: str, work: list[tuple[str, int, list[int]]], concurrency: int, budgets_share: float
                   ) -> dict[str, Any]:
    from shared.kernel.config import load_config
    from shared.launcher.natsserver import NatsServer

    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as server:
        path = Path(tmp) / "c.yaml"
        path.write_text(yaml.safe_dump(config(Path(tmp) / "runs", mode)))
        cfg = load_config(path)
        budgets = Budgets(budgets_share)
        procs = []
        try:
            for model, n in INSTANCES.items():
                for i in range(n):
                    log = open(Path(tmp) / f"rollouter-{model}{i}.log", "wb")  # noqa: SIM115 (closed with the dir)
                    p = subprocess.Popen([sys.executable, "-m", "services.rollouter", "--config", str(path), "--nats",
                                          server.url, "--model", model, "--instance", str(i)],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                    budgets.put(f"{model}{i}", p.pid)
                    procs.append(p)
            try:
                await wait_registered(server.url, cfg)
            except AssertionError:
                for f in sorted(Path(tmp).glob("rollouter-*.log")):
                    print(f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-8:]))
                raise
            result = await drive(mode, server.url, cfg, work, concurrency)
            result["budgets"] = budgets.ok
            return result
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            budgets.close()


async def wait_registered(url: str, cfg: Any) -> None:
    from shared.kernel.bus import kv_keys
    from shared.kernel.subjects import Names

    names = Names(cfg.run.id)
    nc = await nats.connect(url)
    js = nc.jetstream()
    deadline = time.monotonic() + 60
    try:
        while True:
            n = 0
            try:
                for m in MODELS:
                    n += len(await kv_keys(js, names.kv_bucket, names.rollouter_prefix(m)))
            except Exception:  # the bucket is created by the first instance
                n = 0
            if n >= sum(INSTANCES.values()):
                return
            assert time.monotonic() < deadline, "rollouter instances did not register in 60 s"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def main() -> None:
    from shared.kernel.logs import setup_logging

    setup_logging(level="ERROR")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cpus = len(os.sched_getaffinity(0))
    # the CPUs divided over the instances (HEADROOM < 1 would leave some to the driver and the broker: with 0.7,
    # one instance alone on its model drowns in bursts of its requests and instances migrate back and forth)
    share = HEADROOM * cpus / sum(INSTANCES.values())
    print(f"{sum(INSTANCES.values())} rollouter processes ({INSTANCES}), {args.requests} requests of {GROUP} rows, "
          f"{int(SKEW * 100)}% to a, {args.concurrency} in flight; each instance {share:.2f} CPU")
    got: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        work = workload(args.requests, seed=r)
        for mode in MODES:  # alternating: every mode sees the same machine
            res = asyncio.run(run_mode(mode, work, args.concurrency, share))
            got[mode].append(res)
            if not res["budgets"]:
                print("  no writable cgroup cpu controller: the instances share every CPU (balancing cannot gain)")
            print(f"  repeat {r + 1} {mode:>11}: {res['throughput']:6.1f} rows/s, makespan {res['makespan']:5.1f}s, "
                  f"migrations {res['migrations']} (at {res['migrated_at']} s), served {dict(sorted(res['served'].items()))}")
    med = {m: statistics.median(x["throughput"] for x in got[m]) for m in MODES}
    span = {m: statistics.median(x["makespan"] for x in got[m]) for m in MODES}
    print(f"median of {args.repeats}: " + ", ".join(f"{m} {med[m]:.1f} rows/s ({span[m]:.1f}s)" for m in MODES))
    # each repeat's ratio is measured side by side (the modes one after another on the same machine); the result is
    # their median
    ratios = {m: [x["throughput"] / r["throughput"] for x, r in zip(got[m], got["random"], strict=True)]
              for m in ("intra", "intra_inter")}
    print("ratios per repeat: " + "; ".join(f"{m} " + ", ".join(f"{v:.2f}" for v in vs) for m, vs in ratios.items()))
    print(f"ratio intra={statistics.median(ratios['intra']):.2f} "
          f"intra_inter={statistics.median(ratios['intra_inter']):.2f}")


if __name__ == "__main__":
    main()
