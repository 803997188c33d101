"""The asynchronous pipeline, measured: one long-tail workload in `sync`, `microbatch` and `async` modes.

    python loadtests/bench_pipeline.py [--steps 8] [--warmup 2] [--sync interval|always|both]

Every mode runs the same config (a tiny random-initialised model, one agent, response lengths from the
Pareto distribution of loadtests/longtail_workflow.py) as separate `chorus serve` processes against one
real nats-server, with the rollouter pinned to one core and the trainer to another (separate resource
pools, as in a disaggregated cluster; the light services float). After `--warmup` optimizer steps it times
`--steps` more and prints, per mode: wall seconds per global step, the busy fraction of the trainer (its
compute seconds over the wall time) and of the rollouter (its generation seconds over the wall time), and
the staleness histogram of the trained samples. The last line is `speedup microbatch=<x> async=<y>`:
sync's seconds per step divided by each mode's. Absolute times depend on the machine; the ratios are the
result.

``--sync both`` runs every mode on two servers side by side, one with JetStream's default fsync every two minutes
and one with ``sync_interval: always`` (``nats.sync_always``: an acknowledged write is on disk), and also times
acknowledged publishes of sample-sized messages on each; its last line is ``ratio always_vs_interval <mode>=<x>
... publish=<y>``: each mode's seconds per step (and the publish rate's inverse) on the fsyncing server over the
default one's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import psutil
import yaml

from shared.kernel.codec import decode
from shared.kernel.schemas import Sample, SyncDone
from shared.kernel.subjects import Names
from shared.launcher.natsserver import NatsServer
from shared.launcher.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent
CHORUS = str(Path(sys.executable).parent / "chorus")
MODEL = "m"
MODES = ("sync", "microbatch", "async")
ASYNC_STALENESS = 2
ON_SYNC = ["drain"]  # rollouter.on_sync of every mode (--on-sync)
PROMPT = "You are the solver of a team. Read the notes before you; reply with the last digit of the sum. Task: "


def run_config(mode: str, run_id: str, run_dir: Path) -> dict[str, Any]:
    """The same workload for every mode; only train.mode and max_staleness differ."""
    return {
        "run": {"id": run_id, "dir": str(run_dir), "seed": 0},
        "models": {MODEL: {
            "arch": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 512,
                     "max_position": 160},
            "rollouter": {"instances": 1, "max_batch": 8, "batch_window_ms": 5.0, "threads": 1,
                          "on_sync": ON_SYNC[0]},
            "optim": {"lr": 1.0e-4, "weight_decay": 0.0, "grad_clip": 1.0},
        }},
        # A long instruction, as agents of a multi-agent workflow read the turns before theirs: prompt tokens
        # cost the trainer a forward and backward pass each, the rollouter one batched prefill.
        "agents": {"solver": {"model": MODEL, "prompt": PROMPT}},
        "workflow": {"name": "custom", "function": str(ROOT / "loadtests" / "longtail_workflow.py") + ":longtail",
                     "agents": ["solver"], "concurrency": 8, "group_size": 8, "temperature": 1.0},
        "task": {"name": "arithmetic", "max_operand": 9, "ops": ["+"], "modulo": 10},
        "train": {"mode": mode, "max_staleness": ASYNC_STALENESS if mode == "async" else 0,
                  "max_versions": 10_000, "global_batch": 64, "micro_batch": 8, "checkpoint_every": 0,
                  "threads": 1},
        "actions": {"cores": 1},
        "metrics_interval_s": 0.5,
    }


class Probe:
    """Step events, the version of every published sample, and the rollouter's busy seconds."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.version_of: dict[str, int] = {}
        self.rollouter_busy: list[tuple[float, float]] = []  # (time, busy seconds so far)
        self.published_at: dict[str, float] = {}
        self.served_at: dict[int, float] = {}  # version -> when paramsync reported it loaded
        self.sync_s: dict[int, float] = {}  # version -> paramsync's own seconds for it

    async def attach(self, nc: Any, names: Names) -> None:
        async def on_step(msg: Any) -> None:
            ev = json.loads(msg.data)
            if ev.get("kind") == "step":
                ev["seen_at"] = time.monotonic()
                self.steps.append(ev)

        async def on_traj(msg: Any) -> None:
            s = decode(Sample, msg.data)
            self.version_of[s.sample_id] = s.version
            self.published_at[s.sample_id] = time.monotonic()

        async def on_sync_done(msg: Any) -> None:
            done = decode(SyncDone, msg.data)
            self.served_at.setdefault(done.version, time.monotonic())
            self.sync_s[done.version] = done.seconds

        async def on_rollouter(msg: Any) -> None:
            busy = json.loads(msg.data).get("busy_s")
            if isinstance(busy, int | float):
                self.rollouter_busy.append((time.monotonic(), float(busy)))

        await nc.subscribe(names.events("trainer"), cb=on_step)
        await nc.subscribe(names.traj(MODEL), cb=on_traj)
        await nc.subscribe(names.metrics("rollouter", f"{MODEL}-0"), cb=on_rollouter)
        await nc.subscribe(names.sync_done(MODEL), cb=on_sync_done)

    def phases(self, measured: list[dict[str, Any]]) -> dict[str, float]:
        """Mean seconds per step on the critical path of an on-policy step (v -> v + 1): new weights served ->
        first sample of the batch, first -> last sample (generation), last sample -> optimizer step (the
        training not overlapped), step -> weights served (publish, transfer, pause, load, resume)."""
        spans: dict[str, list[float]] = {"served->first sample": [], "generation": [], "last sample->step": [],
                                         "step->served": [], "paramsync": []}
        for ev in measured:
            v = ev["version"]
            times = sorted(self.published_at[sid] for sid in ev["sample_ids"] if sid in self.published_at)
            if not times or v - 1 not in self.served_at or v not in self.served_at:
                continue
            spans["served->first sample"].append(times[0] - self.served_at[v - 1])
            spans["generation"].append(times[-1] - times[0])
            spans["last sample->step"].append(ev["seen_at"] - times[-1])
            spans["step->served"].append(self.served_at[v] - ev["seen_at"])
            spans["paramsync"].append(self.sync_s.get(v, 0.0))
        return {k: sum(v) / len(v) for k, v in spans.items() if v}

    def busy_at(self, t: float) -> float:
        """The rollouter's busy seconds in its last report at or before ``t``."""
        before = [b for at, b in self.rollouter_busy if at <= t]
        return before[-1] if before else 0.0


def pin(child: Any, cores: list[int]) -> None:
    """Bind a service process (and the threads it will start) to ``cores``."""
    psutil.Process(child.popen.pid).cpu_affinity(cores)


async def run_mode(mode: str, url: str, work: Path, steps: int, warmup: int, cores: tuple[int, int],
                   timeout_s: float) -> dict[str, Any]:
    run_id = f"bench-{mode}-{int(time.time())}"
    cfg_path = work / f"{mode}.yaml"
    cfg_path.write_text(yaml.safe_dump(run_config(mode, run_id, work / "runs")))
    names = Names(run_id)
    nc = await nats.connect(url)
    probe = Probe()
    await probe.attach(nc, names)
    sup = Supervisor(work / "logs" / mode, env=dict(os.environ))

    def start(service: str, model: str | None = None) -> Any:
        argv = [CHORUS, "serve", service, "--config", str(cfg_path), "--nats", url, "--instance", "0"]
        return sup.start(f"{service}-{model or ''}", argv + (["--model", model] if model else []))

    try:
        start("actions")
        start("mq", MODEL)
        pin(start("trainer", MODEL), [cores[1]])
        pin(start("rollouter", MODEL), [cores[0]])
        start("paramsync", MODEL)
        await asyncio.sleep(3.0)  # the rollouter and trainer load their models before tasks start
        start("coordinator")
        deadline = time.monotonic() + timeout_s
        while len(probe.steps) < warmup + steps:
            dead = [c.key for c in sup.exited()]
            if dead:
                raise RuntimeError(f"{mode}: {dead} exited; logs in {work / 'logs' / mode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: {len(probe.steps)} steps in {timeout_s}s")
            await asyncio.sleep(0.1)
    finally:
        await sup.stop_all(20.0)
        await nc.close()
    window = probe.steps[warmup: warmup + steps + 1]
    t0, t1 = probe.steps[warmup - 1]["seen_at"], window[steps - 1]["seen_at"]
    wall = t1 - t0
    measured = window[:steps]
    staleness: Counter[int] = Counter()
    for ev in measured:
        for sid in ev["sample_ids"]:
            if sid in probe.version_of:
                staleness[(ev["version"] - 1) - probe.version_of[sid]] += 1
    return {
        "mode": mode,
        "step_s": wall / steps,
        "trainer_busy": sum(ev["step_seconds"] for ev in measured) / wall,
        "rollouter_busy": (probe.busy_at(t1) - probe.busy_at(t0)) / wall,
        "samples_per_step": sum(ev["samples"] for ev in measured) / steps,
        "dropped_stale": measured[-1]["dropped_stale"],
        "staleness": dict(sorted(staleness.items())),
        "phases": probe.phases(measured),
        "per_step_s": [round(b["seen_at"] - a["seen_at"], 2)
                       for a, b in zip(probe.steps[warmup - 1:], measured, strict=False)],
    }


async def main(steps: int, warmup: int, timeout_s: float, modes: tuple[str, ...] = MODES,
               work_dir: Path | None = None, sync: str = "interval") -> dict[str, dict[str, Any]]:
    available = sorted(psutil.Process().cpu_affinity() or [0])
    cores = (available[0], available[-1])
    if cores[0] == cores[1]:
        print("only one core available: rollouter and trainer share it, so no mode can overlap them")
    with tempfile.TemporaryDirectory(prefix="chorus-bench-") as scratch:
        tmp = work_dir or scratch
        if sync == "both":
            return await run_durability(Path(tmp), steps, warmup, cores, timeout_s, modes)
        results = await run_modes(Path(tmp), steps, warmup, cores, timeout_s, modes, sync_always=sync == "always")
    if "sync" in results:
        sync = results["sync"]["step_s"]
        ratios = " ".join(f"{m}={sync / results[m]['step_s']:.2f}" for m in ("microbatch", "async") if m in results)
        print(f"speedup {ratios}")
    return results


async def run_modes(tmp: Path, steps: int, warmup: int, cores: tuple[int, int], timeout_s: float,
                    modes: tuple[str, ...], sync_always: bool = False) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with NatsServer(Path(tmp) / "nats", sync_always=sync_always) as server:
        for mode in modes:
            results[mode] = await _one_mode(mode, server.url, tmp, steps, warmup, cores, timeout_s)
    return results


async def _one_mode(mode: str, url: str, tmp: Path, steps: int, warmup: int, cores: tuple[int, int],
                    timeout_s: float, label: str = "") -> dict[str, Any]:
    print(f"running {mode}{label} ({warmup} warm-up + {steps} measured steps) ...", flush=True)
    Path(tmp).mkdir(parents=True, exist_ok=True)
    r = await run_mode(mode, url, Path(tmp), steps, warmup, cores, timeout_s)
    print(f"  {mode:<10} {r['step_s']:6.2f} s/step  trainer busy {r['trainer_busy']:.0%}  "
          f"rollouter busy {r['rollouter_busy']:.0%}  samples/step {r['samples_per_step']:.0f}  "
          f"staleness {r['staleness']}  dropped stale {r['dropped_stale']}", flush=True)
    print(f"  per-step wall seconds: {r['per_step_s']}", flush=True)
    print("  mean seconds per step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
          + (" (overlapping in async mode)" if mode == "async" else ""), flush=True)
    return r


async def publish_rate(url: str, n: int = 2000, size: int = 2048) -> float:
    """Acknowledged JetStream publishes per second of ``size``-byte messages (a sample's order of size), 64 in
    flight at a time, to a file stream of this server."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        stream = f"BENCH_{int(time.time() * 1000)}"
        await js.add_stream(name=stream, subjects=[f"bench.{stream}"])
        body = os.urandom(size)
        t0 = time.perf_counter()
        for start in range(0, n, 64):
            await asyncio.gather(*(js.publish(f"bench.{stream}", body, headers={"Nats-Msg-Id": f"{stream}-{i}"})
                                   for i in range(start, min(n, start + 64))))
        rate = n / (time.perf_counter() - t0)
        await js.delete_stream(stream)
        return rate
    finally:
        await nc.close()


async def run_durability(tmp: Path, steps: int, warmup: int, cores: tuple[int, int], timeout_s: float,
                         modes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every mode on a default server and on a sync_interval: always one, interleaved; acked publish rates."""
    results: dict[str, dict[str, Any]] = {}
    with NatsServer(tmp / "nats-interval") as interval, NatsServer(tmp / "nats-always", sync_always=True) as always:
        servers = {"interval": interval, "always": always}
        rates = {name: [] for name in servers}
        for _ in range(3):
            for name, server in servers.items():
                rates[name].append(await publish_rate(server.url))
        for name in servers:
            print(f"acked publishes per second ({name}): {', '.join(f'{r:.0f}' for r in rates[name])}", flush=True)
        for mode in modes:
            for name, server in servers.items():
                results[f"{mode}/{name}"] = await _one_mode(mode, server.url, tmp / name, steps, warmup, cores,
                                                            timeout_s, label=f" on sync_interval {name}")
    step = " ".join(f"{m}={results[f'{m}/always']['step_s'] / results[f'{m}/interval']['step_s']:.2f}"
                    for m in modes)
    publish = sorted(rates["interval"])[1] / sorted(rates["always"])[1]
    print(f"ratio always_vs_interval {step} publish={publish:.2f}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="measured optimizer steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="steps before measuring (model load, first sync)")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="give up on a mode after this long")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of sync,microbatch,async")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep configs, run dirs and service logs here")
    ap.add_argument("--on-sync", choices=("drain", "interrupt"), default="drain",
                    help="rollouter.on_sync: what a weight sync does to rows mid-generation")
    ap.add_argument("--sync", choices=("interval", "always", "both"), default="interval",
                    help="JetStream's fsync: every 2 minutes (the default), on every write (nats.sync_always), or "
                         "both side by side")
    a = ap.parse_args()
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: choose from {','.join(MODES)}")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    ON_SYNC[0] = a.on_sync
    asyncio.run(main(a.steps, a.warmup, a.timeout_s, modes, a.work_dir, a.sync))
