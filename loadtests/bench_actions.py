"""Action scheduling at the paper's scale, simulated: mean action completion time (ACT) of static trajectory-level
allocation, fixed-DoP action-level allocation and ARL-Tangram's elastic scheduler (services/actions/elastic.py).

    python loadtests/bench_actions.py [--batches 128 256 512 1024 1536] [--steps 2] [--seeds 3] [--real-repeats 3]

A discrete-event simulation (services/actions/simulator.py) of 1280 CPU cores over 5 nodes: per RL step one burst
of `batch` trajectories, each a few short tool calls between LLM generations and a long-tailed test-suite reward
action with Amdahl elasticity (1..32 cores). Every policy plays the same generated trace; each figure is the
median over `--seeds` traces. The last line is `ratio act_vs_static=<x> act_vs_best_fixed=<y>` for the largest
batch.

Then a small real run on this machine: an embedded nats-server and the actions service on `--cores` cores, fed a
trace of real CPU work (tool calls of `cpu_affinity` busy loops, elastic `cpu_tests` suites whose cases run in
parallel across the cores they get), each action its own request, under `actions.scheduler: fcfs` and `elastic`
in alternation; it prints the mean ACT of each (median of `--real-repeats`) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from services.actions.simulator import TraceConfig, make_trace, simulate

POLICIES = ("static", "fixed-4", "fixed-16", "elastic")


def main() -> None:
    from shared.kernel.logs import setup_logging

    setup_logging(level="ERROR")  # the service's own logs would bury the figures
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512, 1024, 1536])
    p.add_argument("--steps", type=int, default=2, help="RL steps (bursts) per trace")
    p.add_argument("--seeds", type=int, default=3, help="traces per batch size; figures are their medians")
    p.add_argument("--real-repeats", type=int, default=3, help="real runs per policy (0: no real run)")
    p.add_argument("--cores", type=int, default=min(2, len(os.sched_getaffinity(0))))
    args = p.parse_args()
    cfg = TraceConfig(steps=args.steps)
    print(f"simulated cluster: {cfg.nodes} nodes x {cfg.cores_per_node} cores; {args.steps} RL steps per trace; "
          f"median of {args.seeds} traces")
    print(f"{'batch':>6} " + " ".join(f"{p_:>10}" for p_ in POLICIES) + "   static/elastic  best-fixed/elastic")
    last: tuple[float, float] | None = None
    t0 = time.perf_counter()
    for batch in args.batches:
        acts: dict[str, list[float]] = {p_: [] for p_ in POLICIES}
        for seed in range(args.seeds):
            trace = make_trace(cfg, batch, seed)
            for policy in POLICIES:
                acts[policy].append(simulate(cfg, policy, trace).mean_act)
        med = {p_: statistics.median(v) for p_, v in acts.items()}
        best_fixed = min(med["fixed-4"], med["fixed-16"])
        last = (med["static"] / med["elastic"], best_fixed / med["elastic"])
        print(f"{batch:>6} " + " ".join(f"{med[p_]:>9.1f}s" for p_ in POLICIES)
              + f"   {last[0]:>14.2f}x  {last[1]:>17.2f}x")
    print(f"(simulation took {time.perf_counter() - t0:.0f} s)")
    assert last is not None
    if args.real_repeats:
        real(args.cores, args.real_repeats)
    print(f"ratio act_vs_static={last[0]:.2f} act_vs_best_fixed={last[1]:.2f}")


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
                            f"actions: {{cores: {cores}, scheduler: {policy}, timeout_s: 60, memory_mb: 512}}\n")
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
            if kind == "cpu_tests":
                spread.append(int(res.results[0]["parallelism"]))

        await asyncio.gather(*(one(i, *x) for i, x in enumerate(trace)))
        await nc.close()
        svc.stop()
        await task
        REAL_SPREAD.setdefault(policy, []).extend(spread)
        return sum(acts) / len(acts)


REAL_SPREAD: dict[str, list[int]] = {}


def real(cores: int, repeats: int) -> None:
    print(f"real run: the actions service on {cores} cores, {len(real_trace(0))} actions per run "
          "(tool calls and elastic cpu_tests suites), each its own request")
    got: dict[str, list[float]] = {"fcfs": [], "elastic": []}
    for r in range(repeats):
        trace = real_trace(r)
        for policy in ("fcfs", "elastic"):  # alternating: both see the same machine
            got[policy].append(asyncio.run(real_once(policy, cores, trace)))
        print(f"  repeat {r + 1}: mean ACT fcfs {got['fcfs'][-1]:.3f}s  elastic {got['elastic'][-1]:.3f}s  "
              f"ratio {got['fcfs'][-1] / got['elastic'][-1]:.2f}x")
    for policy, ks in REAL_SPREAD.items():
        print(f"  {policy}: test suites ran on " + ", ".join(f"{k} core{'s' if k > 1 else ''} x{ks.count(k)}"
                                                              for k in sorted(set(ks))))
    f, e = statistics.median(got["fcfs"]), statistics.median(got["elastic"])
    print(f"real run, median of {repeats}: mean ACT fcfs {f:.3f}s, elastic {e:.3f}s: ratio act_fcfs_vs_elastic={f / e:.2f}")


if __name__ == "__main__":
    main()
