"""Action scheduling at the paper's scale, simulated: mean action completion time (ACT) of static trajectory-level
allocation, fixed-DoP action-level allocation and ARL-Tangram's elastic scheduler (services/actions/elastic.py).

    python loadtests/bench_actions.py [--batches 128 256 512 1024 1536] [--steps 2] [--seeds 3]

A discrete-event simulation (services/actions/simulator.py) of 1280 CPU cores over 5 nodes: per RL step one burst
of `batch` trajectories, each a few short tool calls between LLM generations and a long-tailed test-suite reward
action with Amdahl elasticity (1..32 cores). Every policy plays the same generated trace; each figure is the
median over `--seeds` traces. The last line is `ratio act_vs_static=<x> act_vs_best_fixed=<y>` for the largest
batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

from services.actions.simulator import TraceConfig, make_trace, simulate

POLICIES = ("static", "fixed-4", "fixed-16", "elastic")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512, 1024, 1536])
    p.add_argument("--steps", type=int, default=2, help="RL steps (bursts) per trace")
    p.add_argument("--seeds", type=int, default=3, help="traces per batch size; figures are their medians")
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
    print(f"ratio act_vs_static={last[0]:.2f} act_vs_best_fixed={last[1]:.2f}")


if __name__ == "__main__":
    main()
