"""Action scheduling as ARL-Tangram measures it (§6.1-6.4), simulated at the paper's scale, then a real run here.

    python loadtests/bench_actions.py [--batches 128 256 512 1024 1280 1536] [--steps 2] [--seeds 3]
                                      [--exec-ms <sandbox ms>] [--real-repeats 3]

Part a: a discrete-event simulation (loadtests/actions_simulator.py, which calls the scheduler the actions service
runs) of 1280 CPU cores over 5 nodes: per RL step one burst of `batch` trajectories, each a series of tool calls
between LLM generations and one long-tailed test-suite reward action (Amdahl elasticity, DoP 1..32). The trace is
calibrated to the paper's published figures (TraceConfig; docs/actions.md); every policy plays the same traces.
The figure is the paper's §6.3 measure, the total ACT (queue + execution) of a trajectory's actions averaged over
trajectories, median over `--seeds` traces; split into tool calls and rewards. Policies: the static pod baseline of
§6.1 with single-process tests (`static-1`, the paper's) and with `pytest -n 4` (`static-4`), fixed DoP 4 and 16
(FCFS, exclusive cores, §6.4), the paper's elastic scheduler (Algorithms 1-3 at every arrival and completion), and
Chorus's (`chorus`: the paper's with its three extensions); then each extension alone against the paper's, the
Amdahl serial fraction swept, and the table again with a per-exec cost on every action (`--exec-ms`: by default
the run_code sandbox's cost measured here, as loadtests/bench_sandbox.py measures it). The line
`ratio paper_static=<x> strongest_baseline=<y>` is Chorus's scheduler at the largest batch against static-1 and
against the best of the other five policies there.

Part b: the actions service on `--cores` cores of this machine (an embedded nats-server), fed a trace of real CPU
work (tool calls of `cpu_affinity` busy loops, elastic `cpu_tests` suites whose cases run in parallel across the
cores they get), each action its own request, under `actions.scheduler` fcfs, elastic and chorus, and chorus with
`actions.malleable`, in alternation; it prints the mean ACT of each (median of `--real-repeats`), per kind, and
their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

# both beside this script in loadtests/ (its own directory is on sys.path)
from actions_simulator import TraceConfig, make_trace, simulate
from bench_sandbox import isolated_ms

BASELINES = ("static-1", "static-4", "fixed-4", "fixed-16", "elastic")
POLICIES = (*BASELINES, "chorus")
ABLATION = ("elastic", "elastic+units", "elastic+sef", "elastic+malleable", "chorus")
# the paper's figures beside ours (Fig. 8a: 3.1x at batch 128 to 27.7x at 1536 against Kubernetes; Fig. 9: 2.0x
# against DoP 4 at batch 256, 3.0x against DoP 16 at batch 1280; Fig. 7: 4.3x in total on AI coding)
PAPER = {128: "3.1x vs k8s", 256: "2.0x vs DoP 4", 1280: "3.0x vs DoP 16", 1536: "27.7x vs k8s"}


CACHE: dict[tuple[TraceConfig, int, int, str], dict[str, float]] = {}
POOL: ProcessPoolExecutor | None = None


def one(cfg: TraceConfig, batch: int, seed: int, policy: str) -> dict[str, float]:
    r = simulate(cfg, policy, make_trace(cfg, batch, seed))
    return {"act": r.mean_act, "tool": r.mean_tool, "reward": r.mean_reward, "share": r.action_share}


def run_batch(cfg: TraceConfig, batch: int, seeds: int, policies: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Median over the seeds of each policy's mean ACT per trajectory, its tool and reward parts, its action share
    (the simulation is deterministic: runs are spread over the cores and kept for the later tables)."""
    todo = [(cfg, batch, seed, p) for seed in range(seeds) for p in policies if (cfg, batch, seed, p) not in CACHE]
    if POOL is not None and len(todo) > 1:
        for key, out in zip(todo, POOL.map(one, *zip(*todo, strict=True)), strict=True):
            CACHE[key] = out
    else:
        for key in todo:
            CACHE[key] = one(*key)
    return {p: {k: statistics.median(CACHE[(cfg, batch, seed, p)][k] for seed in range(seeds))
                for k in ("act", "tool", "reward", "share")} for p in policies}


def table(cfg: TraceConfig, batches: list[int], seeds: int, title: str) -> tuple[float, float]:
    """The six policies per batch; returns Chorus's ratios against static-1 and the strongest baseline at the last
    batch."""
    print(f"\n{title}")
    print(f"{'batch':>6} " + " ".join(f"{p:>9}" for p in POLICIES)
          + "   chorus vs: static-1  static-4  DoP 4  DoP 16  elastic  strongest   paper")
    last = (0.0, 0.0)
    for batch in batches:
        med = run_batch(cfg, batch, seeds, POLICIES)
        c = med["chorus"]["act"]
        strongest = min(med[p]["act"] for p in BASELINES)
        last = (med["static-1"]["act"] / c, strongest / c)
        print(f"{batch:>6} " + " ".join(f"{med[p]['act']:>8.1f}s" for p in POLICIES)
              + "            " + "  ".join(f"{med[p]['act'] / c:>6.2f}x" for p in BASELINES)
              + f"  {last[1]:>8.2f}x   {PAPER.get(batch, '')}")
        print("       tool/reward " + "  ".join(f"{p} {med[p]['tool']:.1f}/{med[p]['reward']:.1f}" for p in POLICIES))
        if batch == batches[0]:
            print(f"       action share of trajectory time: static-1 {med['static-1']['share']:.2f}, tool calls "
                  f"{med['static-1']['tool'] / med['static-1']['act']:.2f} of its action time (paper: 0.47, ~0.5)")
    return last


def ablation(cfg: TraceConfig, batches: list[int], seeds: int) -> None:
    print("\neach extension alone against the paper's scheduler (mean ACT per trajectory, s; x: elastic / policy)")
    print(f"{'batch':>6} " + " ".join(f"{p:>18}" for p in ABLATION))
    for batch in batches:
        med = run_batch(cfg, batch, seeds, ABLATION)
        e = med["elastic"]["act"]
        print(f"{batch:>6} " + " ".join(f"{med[p]['act']:>10.1f}s {e / med[p]['act']:>5.2f}x" for p in ABLATION))


def sweep(cfg: TraceConfig, batches: list[int], seeds: int) -> None:
    print("\nthe Amdahl serial fraction swept (chorus against the strongest of the five others)")
    for lo, hi in ((0.0, 0.05), (0.05, 0.15), (0.15, 0.3), (0.3, 0.5)):
        c = replace(cfg, serial_min=lo, serial_max=hi)
        cells = []
        for batch in batches:
            med = run_batch(c, batch, seeds, POLICIES)
            strongest = min(BASELINES, key=lambda p: med[p]["act"])
            cells.append(f"{batch}: {med[strongest]['act'] / med['chorus']['act']:.2f}x vs {strongest}, "
                         f"{med['static-1']['act'] / med['chorus']['act']:.2f}x vs static-1")
        print(f"  serial {lo:.2f}-{hi:.2f}: " + "; ".join(cells))


def main() -> None:
    from shared.kernel.logs import setup_logging

    setup_logging(level="ERROR")  # the service's own logs would bury the figures
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512, 1024, 1280, 1536])
    p.add_argument("--steps", type=int, default=2, help="RL steps (bursts) per trace")
    p.add_argument("--seeds", type=int, default=3, help="traces per batch size; figures are their medians")
    p.add_argument("--exec-ms", type=float, default=None, help="per-exec cost (default: the sandbox's, measured)")
    p.add_argument("--no-extras", action="store_true", help="only the main table (no ablation, sweep, cost)")
    p.add_argument("--real-repeats", type=int, default=3, help="real runs per policy (0: no real run)")
    p.add_argument("--cores", type=int, default=min(2, len(os.sched_getaffinity(0))))
    args = p.parse_args()
    cfg = TraceConfig(steps=args.steps)
    global POOL
    POOL = ProcessPoolExecutor(max(1, min(args.cores, len(os.sched_getaffinity(0)))))
    print(f"simulated cluster: {cfg.nodes} nodes x {cfg.cores_per_node} cores; {args.steps} RL steps per trace; "
          f"median of {args.seeds} traces; mean total ACT per trajectory (queue + execution), seconds")
    t0 = time.perf_counter()
    last = table(cfg, args.batches, args.seeds, "no pod-start or exec cost")
    if not args.no_extras:
        ablation(cfg, args.batches, args.seeds)
        sweep(cfg, sorted({args.batches[len(args.batches) // 2], args.batches[-1]}), 1)
        exec_ms = args.exec_ms if args.exec_ms is not None else isolated_ms()
        if exec_ms is None:
            print("\nno namespaces here: the sandbox's per-exec cost cannot be measured (give --exec-ms)")
        else:
            table(replace(cfg, exec_s=exec_ms / 1000), [args.batches[0], args.batches[-1]], args.seeds,
                  f"every action pays {exec_ms:.1f} ms to start (the run_code sandbox here; static: the same per exec)")
    POOL.shutdown()
    POOL = None
    print(f"(simulation took {time.perf_counter() - t0:.0f} s)")
    if args.real_repeats:
        real(args.cores, args.real_repeats)
    print(f"ratio paper_static={last[0]:.2f} strongest_baseline={last[1]:.2f}")


# --- the real run ----------------------------------------------------------------------------------------------------
def real_trace(seed: int) -> list[tuple[float, str, dict[str, object]]]:
    """(submit offset s, kind, payload): 3 bursts of 4 trajectories, each 2 tool calls then a test suite."""
    rng = random.Random(seed)
    out = []
    for burst in range(3):
        t0 = burst * 4.0
        for _ in range(4):
            t = t0 + rng.uniform(0, 0.6)
            for _ in range(2):
                out.append((t, "cpu_affinity", {"spin_s": round(rng.uniform(0.02, 0.1), 3)}))
                t += rng.uniform(0.1, 0.4)
            cases = rng.choice([4, 8, 16])
            out.append((t, "cpu_tests", {"cases": cases, "case_s": 0.08, "serial_s": 0.02,
                                         "t_ori": 0.02 + cases * 0.08}))
    return sorted(out, key=lambda x: x[0])


async def real_once(policy: str, cores: int, trace: list[tuple[float, str, dict[str, object]]]) -> float:
    import nats

    from services.actions.service import ActionsService
    from shared.kernel.codec import decode, encode
    from shared.kernel.config import load_config
    from shared.kernel.schemas import ActionRequest, ActionResult
    from shared.launcher.natsserver import NatsServer

    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as server:
        cfg_path = Path(tmp) / "c.yaml"
        cfg_path.write_text(f"run: {{id: bench, dir: {tmp}}}\nmodels: {{a: {{}}}}\n"
                            "agents: {solver: {model: a}, verifier: {model: a}}\n"
                            f"actions: {{cores: {cores}, scheduler: {policy.split('+')[0]}, timeout_s: 60, "
                            f"memory_mb: 512, malleable: {str(policy.endswith('+malleable')).lower()}}}\n")
        svc = ActionsService(load_config(cfg_path), nats_url=server.url)
        task = asyncio.create_task(svc.serve())
        while getattr(svc, "_sub", None) is None:
            await asyncio.sleep(0.05)
        nc = await nats.connect(server.url)
        acts: list[float] = []
        spread: list[int] = []  # the parallelism each test suite ran with
        start = time.monotonic()

        async def one(i: int, at: float, kind: str, payload: dict[str, object]) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            t = time.monotonic()
            msg = await nc.request(svc.names.actions_submit(), encode(ActionRequest(
                action_id=f"b{i}", kind=kind, payloads=[payload], timeout_s=60)), timeout=120)
            res = decode(ActionResult, msg.data)
            assert res.error is None and res.errors == [None], res
            acts.append(time.monotonic() - t)
            REAL_KIND.setdefault(policy, {}).setdefault(kind, []).append(acts[-1])
            if kind == "cpu_tests":
                spread.append(int(res.results[0]["parallelism"]))

        await asyncio.gather(*(one(i, *x) for i, x in enumerate(trace)))
        await nc.close()
        svc.stop()
        await task
        REAL_SPREAD.setdefault(policy, []).extend(spread)
        return sum(acts) / len(acts)


REAL_SPREAD: dict[str, list[int]] = {}
REAL_KIND: dict[str, dict[str, list[float]]] = {}  # policy -> kind -> ACTs over every repeat


def real(cores: int, repeats: int) -> None:
    print(f"real run: the actions service on {cores} cores, {len(real_trace(0))} actions per run "
          "(tool calls and elastic cpu_tests suites), each its own request")
    got: dict[str, list[float]] = {p: [] for p in REAL_POLICIES}
    for r in range(repeats):
        trace = real_trace(r)
        for policy in REAL_POLICIES:  # alternating: all see the same machine
            got[policy].append(asyncio.run(real_once(policy, cores, trace)))
        print(f"  repeat {r + 1}: mean ACT " + "  ".join(f"{p} {got[p][-1]:.3f}s" for p in REAL_POLICIES)
              + "  fcfs/" + " fcfs/".join(f"{p} {got['fcfs'][-1] / got[p][-1]:.2f}x" for p in REAL_POLICIES[1:]))
    for policy, ks in REAL_SPREAD.items():
        print(f"  {policy}: test suites ran on " + ", ".join(f"{k} core{'s' if k > 1 else ''} x{ks.count(k)}"
                                                              for k in sorted(set(ks))))
    for policy, kinds in REAL_KIND.items():
        print(f"  {policy}: mean ACT " + ", ".join(f"{k} {statistics.mean(v):.3f}s (n {len(v)})"
                                                  for k, v in sorted(kinds.items())))
    med = {p: statistics.median(v) for p, v in got.items()}
    best = min(med, key=lambda p: med[p])
    print(f"real run, median of {repeats}: mean ACT " + ", ".join(f"{p} {v:.3f}s" for p, v in med.items())
          + f": ratio act_fcfs_vs_elastic={med['fcfs'] / med['elastic']:.2f} "
          f"act_fcfs_vs_chorus={med['fcfs'] / med['chorus']:.2f} "
          f"act_fcfs_vs_malleable={med['fcfs'] / med['chorus+malleable']:.2f} fastest={best}")


REAL_POLICIES = ("fcfs", "elastic", "chorus", "chorus+malleable")


if __name__ == "__main__":
    main()
