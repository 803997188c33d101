"""The trainer backends, measured: the torch learner against DeepSpeed ZeRO-1/2/3 groups of 2 ranks, on SmolLM2-135M.

    python loadtests/bench_trainer.py [--steps 3] [--samples 8] [--prompt 48] [--response 48] [--modes full,lora]

Every arm trains the same global batches (``--samples`` samples of ``--prompt`` + ``--response`` random tokens
of SmolLM2's vocabulary, GRPO groups of 2, micro-batches of 4, no KL term): one warm-up step, then ``--steps``
timed ones. The torch learner gets as many threads as a group has ranks (2); each rank of a group gets one.
Each arm runs in its own process (its ranks are its children), so its memory is its own:

- step s: the median wall time of a global batch, from its first micro-batch handed over to the step's return
  (the torch learner computes each micro-batch as it arrives, a group at the step: the same work either way);
- peak RSS per rank (MB): the process's high-water mark (``ru_maxrss``), the largest over the group's ranks; it
  includes loading the model (every rank loads it whole before ZeRO-3 partitions it);
- on a GPU, the allocator's peak (``torch.cuda.max_memory_allocated``) beside it.

Prints one table, then ``ratio zero3_mem=<ZeRO-3 per-rank peak / torch peak> zero3_time=<ZeRO-3 step / torch
step>`` for full fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ["torch", "zero1", "zero2", "zero3"]
RANKS = 2


def config(tmp: Path, arm: str, mode: str, samples: int) -> Path:
    trainer = "" if arm == "torch" else \
        f", trainer: {{backend: deepspeed, deepspeed: {{ranks: {RANKS}, zero_stage: {arm[-1]}}}}}"
    lora = ", lora: {r: 8, target_modules: [q_proj, k_proj, v_proj, o_proj]}" if mode == "lora" else ""
    agents = ("{solver: {model: m, adapter: sol}, verifier: {model: m, adapter: ver}}" if mode == "lora"
              else "{solver: {model: m}, verifier: {model: m}}")
    path = tmp / f"{arm}-{mode}.yaml"
    path.write_text(
        f"run: {{id: bench, dir: {ROOT / 'runs'}}}\n"
        f"models: {{m: {{source: smollm2, optim: {{lr: 1.0e-5, grad_clip: 1.0}}{lora}{trainer}}}}}\n"
        f"agents: {agents}\n"
        "workflow: {group_size: 2, temperature: 1.0}\n"
        f"train: {{global_batch: {samples}, micro_batch: 4, threads: {RANKS if arm == 'torch' else 1}}}\n")
    return path


def batches(cfg, samples: int, prompt: int, response: int, step: int):  # type: ignore[no-untyped-def]
    import numpy as np

    from shared.kernel.schemas import Array, Sample

    adapters = cfg.adapters_of("m") if cfg.models["m"].lora is not None else None
    rows = []
    for i in range(samples):
        rng = np.random.default_rng(1000 * step + i)
        rows.append(Sample(
            run="b", episode=f"e{step}-{i // 2}", sample_id=f"s{step}-{i}", env_idx=i // 2, rollout_idx=i % 2,
            agent=("solver", "verifier")[i % 2], model="m", turn=0,
            prompt_ids=Array.of(rng.integers(100, 40000, prompt).tolist(), "int32"),
            response_ids=Array.of(rng.integers(100, 40000, response).tolist(), "int32"),
            behavior_logprobs=Array.of((-rng.random(response) * 2 - 8).tolist(), "float32"),
            reward=float(rng.integers(0, 2)), group_key=f"g{step}-{i // 2}", group_size=2, version=step,
            adapter=adapters[i % 2] if adapters else None))
    return [rows[k : k + 4] for k in range(0, samples, 4)]


def run_arm(path: Path, arm: str, steps: int, samples: int, prompt: int, response: int) -> dict:
    """One arm in this process: its learner (a group starts its other rank), a warm-up step, ``steps`` timed."""
    import torch

    from services.trainer.learner import Learner
    from services.trainer.zero import TrainerGroup
    from shared.kernel.config import load_config

    cfg = load_config(path)
    torch.set_num_threads(cfg.train.threads)
    learner = Learner(cfg, "m") if arm == "torch" else TrainerGroup(cfg, "m", threads=1)
    times = []
    try:
        for step in range(steps + 1):
            t0 = time.perf_counter()
            for mb in batches(cfg, samples, prompt, response, step):
                learner.micro_batch(mb, list(range(len(mb))), "grpo")
            result = learner.step()
            assert result is not None and not result.skipped, result
            if step:
                times.append(time.perf_counter() - t0)
    finally:
        if arm != "torch":
            learner.close()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest waited-for child
    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {"step_s": statistics.median(times), "steps": times, "rss_mb": max(own, children), "rank0_mb": own,
            "others_mb": children, "gpu_mb": gpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:  # a worker: one arm, its figures as JSON on the last line
        print(json.dumps(run_arm(Path(args.config), args.arm, args.steps, args.samples, args.prompt, args.response)))
        return 0
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for arm in ARMS:
                t0 = time.perf_counter()
                path = config(Path(tmp), arm, mode, args.samples)
                proc = subprocess.run([sys.executable, __file__, "--arm", arm, "--config", str(path), "--steps",
                                       str(args.steps), "--samples", str(args.samples), "--prompt", str(args.prompt),
                                       "--response", str(args.response)], capture_output=True, text=True,
                                      env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=ROOT)
                if proc.returncode != 0:
                    print(f"{arm} {mode}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                    return 1
                results[(arm, mode)] = json.loads(proc.stdout.strip().splitlines()[-1])
                r = results[(arm, mode)]
                print(f"  {mode:4} {arm:6} step {r['step_s']:.2f} s, peak RSS per rank {r['rss_mb']:.0f} MB "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\nSmolLM2-135M, {args.samples} samples of {args.prompt} + {args.response} tokens per step, "
          f"median of {args.steps} steps; torch: {RANKS} threads, ZeRO: {RANKS} ranks x 1 thread")
    print("| mode | arm | step s | vs torch | peak RSS per rank MB | vs torch | rank 0 MB | other ranks MB |")
    print("|---|---|---|---|---|---|---|---|")
    for (arm, mode), r in results.items():
        base = results[("torch", mode)]
        others = "-" if arm == "torch" else f"{r['others_mb']:.0f}"
        print(f"| {mode} | {arm} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f} | {r['rss_mb']:.0f} | "
              f"{r['rss_mb'] / base['rss_mb']:.2f} | {r['rank0_mb']:.0f} | {others} |")
    if ("zero3", "full") in results:
        z, t = results[("zero3", "full")], results[("torch", "full")]
        print(f"ratio zero3_mem={z['rss_mb'] / t['rss_mb']:.2f} zero3_time={z['step_s'] / t['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
