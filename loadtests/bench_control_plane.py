"""Chorus's control plane as instances and models grow: real services, rollouters whose engine answers at once.

    python loadtests/bench_control_plane.py [--sizes 1x16,1x128,8x128,8x1024,32x1024] [--versions 40]

Each size ``MxN`` is a run of M models and N rollouter instances in all (N / M per model) against one real
nats-server (JetStream in a temporary directory, monitoring on): the real coordinator (one process), mq,
paramsync and trainer (one process per kind, every model's service in it, the trainer a tiny random model) and
the rollouters, ``--per-process`` instances per process. A rollouter is the real service (batcher, version checks,
registration, load reports, pause / load / resume, catch-up) around a stub engine that answers a request at once
with well-formed token ids and log-probs of the model's vocabulary and serves the trainer's weights like any
engine (loaded in place, checked bucket by bucket), so what is measured is the control plane, not generation.

The workflow (``loadtests/control_plane_workflow.py``) makes one generation per rollout by the agent (one per
model) its task falls to. Each run goes until every model has trained ``--versions`` / M versions (at least 4); the ledger of the
fault tests then checks that every sample published was trained once or dropped with a reason.

Measured per size, in one run:
- episodes and samples per second through the coordinator and mq, between the coordinator's first and last
  episode;
- the coordinator's CPU per episode (its process's CPU seconds over the same span, from /proc);
- JetStream consumers (the account's, peak while running) and subscriptions (the server's /subsz, peak);
- memory per service: each process's peak RSS over the services it runs;
- sync fan-out: for every weight version, from the trainer's announce to paramsync's ``SyncDone`` (every instance
  paused, loaded, resumed), seen by this script; and the control time, that minus the longest weight fetch of
  the sync's instances (each instance times its own fetch);
- limits hit: lines of the server's log naming a limit (maximum consumers, subscriptions, payload, slow consumers)
  and the services' counters of failed requests.

It prints the growth table and ends with ``ratio episode_cpu_1024_vs_16=<coordinator CPU per episode at the
largest size / at the smallest> fanout_128_s=<median fan-out to 128 instances of one model> limits_hit=<n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
import nats.errors  # noqa: E402
import yaml  # noqa: E402

from shared.kernel.subjects import Names  # noqa: E402
from shared.launcher.natsserver import NatsServer, free_port  # noqa: E402

ARCH = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "max_position": 64}
LIMIT_WORDS = ("maximum consumers", "maximum subscriptions", "Slow Consumer", "limit reached", "exceeded",
               "maximum payload", "Maximum Payload", "too many")
# Service counters that say a request of the control plane failed or was refused.
FAILURE_COUNTERS = ("sync_errors", "failed_instances", "load_failures", "resume_failures", "uncommitted_syncs",
                    "gen_errors", "catch_up_failures", "kv_errors", "permission_denied", "tasks_failed",
                    "tasks_abandoned", "auto_resumes", "deregistered", "re_registered", "start_retries")
STARTING = 16  # services of one process starting at once
IDLE_S = 5.0  # seconds the coordinator's background CPU is measured over, after a run


def config(run_dir: Path, run_id: str, models: int, instances: int, versions: int) -> dict[str, Any]:
    names = [f"m{i}" for i in range(models)]
    return {
        "run": {"id": run_id, "dir": str(run_dir), "seed": 0},
        "nats": {"url": None, "max_payload_mb": 8},
        "models": {m: {"arch": ARCH,
                       "rollouter": {"instances": max(1, instances // models), "max_batch": 64,
                                     "batch_window_ms": 1.0, "threads": 1},
                       "optim": {"lr": 1.0e-3, "weight_decay": 0.0, "grad_clip": 1.0}} for m in names},
        "agents": {f"a{i}": {"model": m, "prompt": ""} for i, m in enumerate(names)},
        "workflow": {"name": "custom", "function": str(ROOT / "loadtests" / "control_plane_workflow.py") + ":one_call",
                     "agents": [f"a{i}" for i in range(models)], "concurrency": 64, "group_size": 4,
                     "max_new_tokens": 2, "temperature": 1.0},
        "task": {"name": "arithmetic", "max_operand": 99, "ops": ["+"], "modulo": 10},
        "train": {"max_versions": versions, "global_batch": 16, "micro_batch": 8, "max_staleness": 4,
                  "checkpoint_every": 0, "threads": 1},
        "paramsync": {"transport": "nats", "pause_timeout_s": 30.0, "load_timeout_s": 60.0},
        "metrics_interval_s": 2.0,
    }


# --- the child processes ----------------------------------------------------------------
def _stub_engine(cfg: Any, model: str, net: Any, tok: Any, *, seed: int, fallbacks: list[str]) -> Any:
    from services.rollouter.engine import GenResult, TorchEngine

    class StubEngine(TorchEngine):
        """The model's weights (loaded in place by syncs like any engine's); answers without computing."""

        def generate(self, prompts: Any, params: Any, adapters: Any = None) -> list[Any]:
            out = []
            rng = random.Random(seed + self.rows_generated)
            for sp in params:
                ids = [rng.randrange(48, 58) for _ in range(sp.max_new_tokens)]  # digits of the byte tokenizer
                out.append(GenResult(ids=ids, logprobs=[-2.3] * len(ids), finish="length",
                                     versions=[self.version] * len(ids)))
            self.rows_generated += len(out)
            return out

    return StubEngine(net, tok, seed=seed, max_batch=cfg.models[model].rollouter.max_batch)


FETCHES: list[dict[str, Any]] = []
PHASES: list[dict[str, float]] = []  # paramsync: seconds of each phase of every sync


def _timed_phases() -> None:
    """Every sync's phases timed: listing the instances, pausing and loading them all, committing and resuming."""
    from services.paramsync.service import ParamSyncService

    def wrap(name: str) -> None:
        inner = getattr(ParamSyncService, name)

        async def timed(self: Any, *args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await inner(self, *args, **kw)
            finally:
                PHASES.append({"phase": name, "seconds": time.perf_counter() - t0})  # type: ignore[dict-item]

        setattr(ParamSyncService, name, timed)

    for name in ("begin", "pause_and_load_all", "finish"):
        wrap(name)


def _timed_sinks() -> None:
    """Every rollouter's weight fetch timed (the data part of a sync)."""
    import services.rollouter.service as rs

    make = rs.make_sink

    def timed(*args: Any, **kw: Any) -> Any:
        sink = make(*args, **kw)
        fetch = sink.fetch
        model, instance = args[2], args[3]

        async def fetch_timed(version: int, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fetch(version, **kwargs)
            finally:
                FETCHES.append({"model": model, "instance": instance, "version": version,
                                "seconds": time.perf_counter() - t0})

        sink.fetch = fetch_timed
        return sink

    rs.make_sink = timed  # type: ignore[assignment]


async def _child(spec: dict[str, Any]) -> None:
    from shared.kernel.config import load_config
    from shared.kernel.logs import setup_logging

    cfg = load_config(spec["config"])
    setup_logging(level="warning")
    kind, url = spec["kind"], spec["url"]
    services: list[Any] = []
    if kind in ("rollouters", "trainer"):
        # transformers' lazy imports are not safe from many threads at once (models load in worker threads)
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    if kind == "rollouters":
        import services.rollouter.backends as backends
        from services.rollouter.service import RollouterService

        backends.BACKENDS["chorus"] = _stub_engine
        _timed_sinks()
        services = [RollouterService(cfg, nats_url=url, instance=i, model=m) for m, i in spec["instances"]]
    elif kind == "coordinator":
        from services.coordinator.service import CoordinatorService

        services = [CoordinatorService(cfg, nats_url=url)]
    else:
        from services.mq.service import MqService
        from services.paramsync.service import ParamSyncService
        from services.trainer.service import TrainerService

        if kind == "paramsync":
            _timed_phases()
        cls = {"mq": MqService, "paramsync": ParamSyncService, "trainer": TrainerService}[kind]
        services = [cls(cfg, nats_url=url, model=m) for m in cfg.models]
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(STARTING)
    stop = asyncio.Event()
    served: list[Any] = []  # every service object served, those an instance migrated into included

    async def one(svc: Any) -> int:
        from shared.kernel.service import serve_until_started

        def make(model: str | None = svc.model, instance: str = svc.instance) -> Any:
            # as a service's own process does: a restart after a failed start, or the model it migrates to
            return type(svc)(cfg, nats_url=url, instance=instance, model=model)

        async with gate:
            task = asyncio.ensure_future(serve_until_started(svc, make, served))
            while not svc.ready and not task.done():
                await asyncio.sleep(0.02)
        return await task

    runs = [asyncio.ensure_future(one(s)) for s in services]
    await asyncio.sleep(0.5)
    for sig in (signal.SIGTERM, signal.SIGINT):  # after every serve() put its own: one handler stops them all
        loop.add_signal_handler(sig, stop.set)
    started = False
    while not stop.is_set():
        if not started and all(s.ready for s in services):
            started = True
            Path(spec["ready_file"]).write_text("ready")
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        if any(r.done() for r in runs):  # a service that ended by itself: the run cannot be measured
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    while not all(r.done() for r in runs):  # again while they end: one that was migrating serves its new model
        for s in served:
            s.stop()
        await asyncio.wait(runs, timeout=0.5)
    await asyncio.gather(*runs, return_exceptions=True)
    counters: Counter[str] = Counter()
    for s in served:
        counters.update(s.counters)
    counters["migrations"] = sum(s.migrate_to is not None for s in served)
    Path(spec["out_file"]).write_text(json.dumps({"counters": dict(counters), "fetches": FETCHES, "phases": PHASES,
                                                  "services": len(services)}))


# --- the parent -------------------------------------------------------------------------
@dataclass
class Proc:
    kind: str
    popen: subprocess.Popen[bytes]
    services: int
    ready_file: Path
    out_file: Path
    log: Path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def http_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def traffic(port: int) -> dict[str, dict[str, int]]:
    """Messages and bytes each kind of client sent to and received from the server so far (its /connz), by the
    client name's first part (the service kind; the bench's own clients are "other")."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"in_msgs": 0, "out_msgs": 0, "in_bytes": 0, "out_bytes": 0})
    conns = http_json(port, "/connz?limit=100000").get("connections") or []
    for c in conns:
        kind = str(c.get("name") or "other").split(".")[0] or "other"
        for f in ("in_msgs", "out_msgs", "in_bytes", "out_bytes"):
            out[kind][f] += int(c.get(f) or 0)
    return dict(out)


@dataclass
class SizeResult:
    models: int
    instances: int
    seconds: float = 0.0
    episodes: int = 0
    samples: int = 0
    coord_cpu_s: float = 0.0
    coord_idle_ms_s: float = 0.0  # the coordinator's CPU per second once no task runs (its background: every instance's
    # load reports, the registry, metrics, version polls), measured over IDLE_S after the run
    consumers_peak: int = 0
    subscriptions_peak: int = 0
    connections: int = 0
    rss_mb: dict[str, float] = field(default_factory=dict)  # per service, by kind
    fanout_s: list[float] = field(default_factory=list)
    control_s: list[float] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    fetch_s: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    start_s: float = 0.0
    server_cpu_s: float = 0.0
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # component -> in/out msgs and bytes
    versions: int = 0

    @property
    def episode_cpu_ms(self) -> float:
        return 1000 * self.coord_cpu_s / max(1, self.episodes)


def spawn(kind: str, spec: dict[str, Any], work: Path, n: int, tag: str) -> Proc:
    ready, out = work / f"{tag}.ready", work / f"{tag}.out.json"
    spec = {**spec, "kind": kind, "ready_file": str(ready), "out_file": str(out)}
    spec_file = work / f"{tag}.spec.json"
    spec_file.write_text(json.dumps(spec))
    log = (work / f"{tag}.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    popen = subprocess.Popen([sys.executable, __file__, "--child", str(spec_file)], stdout=log,
                             stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Proc(kind, popen, n, ready, out, work / f"{tag}.log")


async def wait_for(cond: Any, timeout_s: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        for p in procs:
            if p.popen.poll() is not None:
                tail = p.log.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{p.kind} process exited with {p.popen.returncode} while waiting for {what}:\n"
                                   + "\n".join(tail))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        await asyncio.sleep(0.25)


async def run_size(models: int, instances: int, args: argparse.Namespace) -> SizeResult:
    from tests.faults.ledger import Ledger, violations

    res = SizeResult(models, instances)
    versions = res.versions = max(4, args.versions // models)  # the same order of steps in all, whatever M
    run_id = f"cp{models}x{instances}"
    names = Names(run_id)
    model_names = [f"m{i}" for i in range(models)]
    with tempfile.TemporaryDirectory(prefix="chorus-cp-") as tmp:
        work = Path(args.work) / run_id if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        monitor = free_port()
        server = NatsServer(work / "nats", monitor_port=monitor)
        server.start()
        procs: list[Proc] = []
        try:
            cfg_file = work / "run.yaml"
            cfg_file.write_text(yaml.safe_dump(config(work / "runs", run_id, models, instances, versions)))
            spec = {"config": str(cfg_file), "url": server.url}
            t_start = time.monotonic()
            for kind in ("mq", "trainer", "paramsync"):
                procs.append(spawn(kind, spec, work, models, kind))
            per_model = max(1, instances // models)
            pairs = [(m, str(i)) for m in model_names for i in range(per_model)]
            for k in range(0, len(pairs), args.per_process):
                chunk = pairs[k:k + args.per_process]
                procs.append(spawn("rollouters", {**spec, "instances": chunk}, work, len(chunk), f"rollouters{k}"))

            async def all_ready() -> bool:
                return all(p.ready_file.exists() for p in procs)

            await wait_for(all_ready, args.start_timeout_s, "every service started", procs)
            res.start_s = time.monotonic() - t_start
            ledger = await Ledger(run_id, model_names, server.url).start()
            nc = await nats.connect(server.url)
            announced: dict[tuple[str, int], float] = {}
            done: dict[tuple[str, int], tuple[float, int]] = {}

            async def on_announce(msg: Any) -> None:
                from shared.kernel.codec import decode
                from shared.kernel.schemas import WeightsAnnounce
                with contextlib.suppress(Exception):
                    ann = decode(WeightsAnnounce, msg.data)
                    announced.setdefault((ann.model, ann.version), time.monotonic())

            async def on_done(msg: Any) -> None:
                from shared.kernel.codec import decode
                from shared.kernel.schemas import SyncDone
                with contextlib.suppress(Exception):
                    d = decode(SyncDone, msg.data)
                    done.setdefault((d.model, d.version), (time.monotonic(), len(d.loaded)))

            await nc.subscribe(f"chorus.{run_id}.sync.*.announce", cb=on_announce)
            await nc.subscribe(f"chorus.{run_id}.sync.*.done", cb=on_done)
            coord = spawn("coordinator", spec, work, 1, "coordinator")
            procs.append(coord)

            async def coordinator_ready() -> bool:
                return coord.ready_file.exists()

            await wait_for(coordinator_ready, args.start_timeout_s, "the coordinator started", procs)

            async def status() -> dict[str, Any]:
                return await ledger.status("coordinator")

            first = await status()
            traffic0 = traffic(monitor)
            server_cpu0 = cpu_seconds(server.proc.pid) if server.proc else 0.0
            cpu0, t0 = cpu_seconds(coord.popen.pid), time.monotonic()
            tasks0 = int(first.get("counters", {}).get("tasks_done", 0))
            samples0 = int(first.get("counters", {}).get("samples_published", 0))
            peak_consumers = peak_subs = 0

            async def finished() -> bool:
                nonlocal peak_consumers, peak_subs
                with contextlib.suppress(Exception):
                    info = json.loads((await nc.request("$JS.API.INFO", b"", timeout=5)).data)
                    peak_consumers = max(peak_consumers, int(info.get("consumers", 0)))
                    peak_subs = max(peak_subs, int(http_json(monitor, "/subsz").get("num_subscriptions", 0)))
                try:
                    return all(v >= versions for v in (await ledger.trained()).values())
                except (nats.errors.Error, TimeoutError):  # an overloaded server: asked again
                    return False

            await wait_for(finished, args.run_timeout_s, f"every model trained {versions} versions", procs)
            last = await status()
            res.seconds = time.monotonic() - t0
            res.coord_cpu_s = cpu_seconds(coord.popen.pid) - cpu0
            res.episodes = int(last.get("counters", {}).get("tasks_done", 0)) - tasks0
            res.samples = int(last.get("counters", {}).get("samples_published", 0)) - samples0
            res.consumers_peak, res.subscriptions_peak = peak_consumers, peak_subs
            res.connections = int(http_json(monitor, "/connz").get("num_connections", 0))
            res.server_cpu_s = (cpu_seconds(server.proc.pid) if server.proc else 0.0) - server_cpu0
            res.traffic = {k: {f: v[f] - traffic0.get(k, {}).get(f, 0) for f in v} for k, v in traffic(monitor).items()}

            async def quiet() -> bool:
                if await ledger.stream_messages():
                    return False
                await asyncio.sleep(1.0)
                return await ledger.stream_messages() == 0

            await wait_for(quiet, 120, "the streams emptying after the run", procs)
            idle0 = cpu_seconds(coord.popen.pid)
            await asyncio.sleep(IDLE_S)
            res.coord_idle_ms_s = 1000 * (cpu_seconds(coord.popen.pid) - idle0) / IDLE_S
            from shared.kernel.bus import kv_get_int
            kv = await nc.jetstream().key_value(names.kv_bucket)

            async def served() -> bool:  # the last sync over: stopping now leaves no sync half done
                return all([await kv_get_int(kv, names.version_key(m))
                            >= versions for m in model_names])

            await wait_for(served, 120, "the last version served", procs)
            reports = await ledger.report()
            res.problems = violations(reports, versions)
            for p in procs:
                kind = p.kind
                res.rss_mb[kind] = max(res.rss_mb.get(kind, 0.0), peak_rss_mb(p.popen.pid) / p.services)
            await ledger.close()
            await nc.close()
        finally:
            order = ("coordinator", "paramsync", "trainer", "mq", "rollouters")
            for wave in (order[:2], order[2:]):  # nothing left to sync once the first two are gone
                for p in procs:
                    if p.kind in wave and p.popen.poll() is None:
                        p.popen.send_signal(signal.SIGTERM)
                for p in procs:
                    if p.kind in wave:
                        try:
                            p.popen.wait(60)
                        except subprocess.TimeoutExpired:
                            p.popen.kill()
            server.stop()
            log = (work / "nats" / "nats-server.log")
            if log.exists():
                res.limits = [line.strip() for line in log.read_text(errors="replace").splitlines()
                              if any(w.lower() in line.lower() for w in LIMIT_WORDS)]
        fetch_max: dict[tuple[str, int], float] = defaultdict(float)
        for p in procs:
            if not p.out_file.exists():
                res.problems.append(f"{p.kind} process left no report (exit {p.popen.returncode})")
                continue
            out = json.loads(p.out_file.read_text())
            for name in FAILURE_COUNTERS:
                if out["counters"].get(name):
                    res.failures[f"{p.kind}.{name}"] += int(out["counters"][name])
            for ph in out.get("phases", []):
                res.phases[str(ph["phase"])].append(float(ph["seconds"]))
            for f in out["fetches"]:
                res.fetch_s.append(float(f["seconds"]))
                key = (f["model"], int(f["version"]))
                fetch_max[key] = max(fetch_max[key], float(f["seconds"]))
        for key, (t_done, _loaded) in sorted(done.items()):
            if key in announced:
                fan = t_done - announced[key]
                res.fanout_s.append(fan)
                res.control_s.append(max(0.0, fan - fetch_max.get(key, 0.0)))
    return res


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: list[SizeResult]) -> str:
    kinds = ["coordinator", "mq", "paramsync", "trainer", "rollouters"]
    head = ("| models x instances | per model | start s | episodes/s | samples/s | coordinator CPU ms/episode | "
            "coordinator idle CPU ms/s | "
            "consumers | subscriptions | connections | "
            + " | ".join(f"{k} MB/svc" for k in kinds)
            + " | fan-out s (median / max) | control s (median / max) | limits | failures | ledger |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        rows.append(
            f"| {r.models} x {r.instances} | {max(1, r.instances // r.models)} | {r.start_s:.0f} | "
            f"{r.episodes / max(r.seconds, 1e-9):.1f} | {r.samples / max(r.seconds, 1e-9):.1f} | "
            f"{r.episode_cpu_ms:.1f} | {r.coord_idle_ms_s:.0f} | {r.consumers_peak} | {r.subscriptions_peak} | {r.connections} | "
            + " | ".join(f"{r.rss_mb.get(k, 0):.0f}" for k in kinds)
            + f" | {median(r.fanout_s):.2f} / {max(r.fanout_s, default=float('nan')):.2f}"
            f" | {median(r.control_s):.2f} / {max(r.control_s, default=float('nan')):.2f}"
            f" | {len(r.limits)} | {sum(r.failures.values())} | {'ok' if not r.problems else len(r.problems)} |")
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> int:
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    results = []
    for models, instances in sizes:
        t0 = time.monotonic()
        print(f"--- {models} models x {instances} instances", flush=True)
        r = await run_size(models, instances, args)
        results.append(r)
        print(f"  {r.episodes} episodes, {r.samples} samples in {r.seconds:.1f}s (start {r.start_s:.0f}s); "
              f"coordinator {r.episode_cpu_ms:.2f} CPU ms/episode ({r.coord_idle_ms_s:.0f} ms/s once idle); consumers {r.consumers_peak}, subscriptions "
              f"{r.subscriptions_peak}; fan-out median {median(r.fanout_s):.2f}s over {len(r.fanout_s)} syncs "
              f"(control {median(r.control_s):.2f}s); limits {len(r.limits)}; failures {dict(r.failures)}; "
              f"{time.monotonic() - t0:.0f}s", flush=True)
        span = max(r.seconds, 1e-9)
        print(f"  server CPU {1000 * r.server_cpu_s / max(1, r.episodes):.2f} ms/episode "
              f"({r.server_cpu_s / span:.2f} cores); per component, messages/s in+out (bytes/s), per episode:")
        for kind, t in sorted(r.traffic.items()):
            msgs, nbytes = t["in_msgs"] + t["out_msgs"], t["in_bytes"] + t["out_bytes"]
            print(f"    {kind}: {msgs / span:.0f} msg/s ({nbytes / span / 1e3:.0f} kB/s); "
                  f"{msgs / max(1, r.episodes):.1f} msg, {nbytes / max(1, r.episodes) / 1e3:.1f} kB per episode")
        print("  sync phases, median s: " + ", ".join(f"{k} {median(v):.3f}" for k, v in sorted(r.phases.items()))
              + f"; one instance's fetch {median(r.fetch_s):.3f}")
        for line in r.limits[:5]:
            print(f"  server: {line}")
        for line in r.problems[:5]:
            print(f"  ledger: {line}")
    print()
    print(table(results))
    small = min(results, key=lambda r: r.instances)
    large = max(results, key=lambda r: (r.instances, r.models))
    one_128 = [r for r in results if r.models == 1 and r.instances == 128]
    fan128 = median(one_128[0].fanout_s) if one_128 else float("nan")
    limits = sum(len(r.limits) for r in results)
    cpu_ratio = large.episode_cpu_ms / small.episode_cpu_ms if small.episode_cpu_ms else float("nan")
    print(f"ratio episode_cpu_{large.instances}_vs_{small.instances}={cpu_ratio:.2f} "
          f"fanout_128_s={fan128:.2f} limits_hit={limits}")
    return 0 if all(not r.problems for r in results) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1x16,1x128,8x128,8x1024,32x1024", help="MxN: M models, N instances in all")
    ap.add_argument("--versions", type=int, default=40,
                    help="versions trained in each run: by the one model, or this / M by each of M (at least 4)")
    ap.add_argument("--per-process", type=int, default=128, help="rollouter instances per process")
    ap.add_argument("--work", help="keep each run's logs and files here (default: a temporary directory)")
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--run-timeout-s", type=float, default=300)
    a = ap.parse_args()
    if a.child:
        asyncio.run(_child(json.loads(Path(a.child).read_text())))
        sys.exit(0)
    sys.exit(asyncio.run(main(a)))
