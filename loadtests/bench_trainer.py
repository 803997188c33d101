"""The trainer backends, measured: the torch learner against DeepSpeed ZeRO-1/2/3 groups of 2 ranks.

    python loadtests/bench_trainer.py [--steps 3] [--samples 8] [--prompt 48] [--response 48] [--modes full,lora]
    python loadtests/bench_trainer.py --arch 360m [--repeats 3] [--zero-dtypes bfloat16,float32]

Every arm trains the same global batches (``--samples`` samples of ``--prompt`` + ``--response`` random tokens,
GRPO groups of 2, micro-batches of 4, no KL term): one warm-up step, then ``--steps`` timed ones. The torch learner
gets as many threads as a group has ranks (2); each rank of a group gets one. Each arm runs in its own process (its
ranks are its children), so its memory is its own:

- step s: the median wall time of a global batch, from its first micro-batch handed over to the step's return
  (the torch learner computes each micro-batch as it arrives, a group at the step: the same work either way);
- peak RSS per rank (MB): each process's high-water mark (``ru_maxrss``), the largest over the group's ranks; it
  includes loading the model (every rank builds it whole before ZeRO-3 partitions it);
- live state per rank (MB): the bytes of tensor storage a rank holds as it enters the optimizer step of a timed
  step (weights, gradients and AdamW's moments all held then): every tensor reachable from the model's parameters
  (their data, gradients and ZeRO-3 shards), from the optimizer (its state and every tensor attribute of DeepSpeed's
  ZeRO optimizer: flat weight shards, float32 master, gradient partitions, buckets) and from the garbage collector,
  each storage counted once (by its address). Measured, not computed: ZeRO's formula is printed beside it;
- on a GPU, the allocator's peak (``torch.cuda.max_memory_allocated``) beside it.

``--arch 135m`` (the default): SmolLM2-135M (its weights, float32), full fine-tuning and LoRA; one table, then
``ratio zero3_mem=<ZeRO-3 per-rank peak / torch peak> zero3_time=<ZeRO-3 step / torch step>`` for full fine-tuning.

``--arch 360m``: SmolLM2-360M's shape (354M parameters with the byte vocabulary, random init, 64 positions), where
the training state outweighs activations and interpreter: the torch learner in float32 (16 bytes a parameter, the
ZeRO paper's baseline) against ZeRO-1/2/3 in bfloat16 (DeepSpeed's bf16 mode: the paper's mixed precision, 2-byte
weights and gradients, 12 bytes of float32 master and moments) and, with ``--zero-dtypes``, in float32. Full
fine-tuning, short sequences (16 + 16 tokens). One table (medians over ``--repeats`` runs of every arm), then per
run and for the medians ``ratio zero3_state=<ZeRO-3 per-rank live state / torch learner's> zero3_peak=<ZeRO-3
per-rank peak RSS / torch learner's> formula_error=<|ZeRO-3 live state - formula| / formula>`` (ZeRO-3 in bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ["torch", "zero1", "zero2", "zero3"]
RANKS = 2
# SmolLM2-360M's shape, as in tests/deepspeed/test_memory_cap.py (5 KV heads there are 15 here: 354M parameters)
ARCH_360M = {"hidden_size": 960, "num_layers": 32, "num_heads": 15, "intermediate_size": 2560, "max_position": 64}
PROBE_ENV = "CHORUS_BENCH_PROBE"  # a directory: every rank writes its figures there (rank<r>.json)
MB = 2**20


# --- ZeRO's formula ------------------------------------------------------------------------------------
def formula_bytes(arm: str, dtype: str, psi: int, ranks: int = RANKS) -> float:
    """Model-state bytes per rank by the ZeRO paper (Rajbhandari et al. 2020, section 5 and figure 1), with Adam:
    weights of w bytes and gradients of w bytes each, K = 12 bytes of float32 master weights and two moments.

    Mixed precision (w = 2): baseline (2 + 2 + K)Psi; ZeRO-1 (P_os) 2Psi + 2Psi + K Psi/N; ZeRO-2 (P_os+g)
    2Psi + (2 + K)Psi/N; ZeRO-3 (P_os+g+p) (2 + 2 + K)Psi/N. The torch learner in float32 holds 4 + 4 + 8 bytes
    (its weights are AdamW's master): 16Psi, the paper's baseline figure. In float32 (w = 4) the same accounting
    keeps K = 12 (a float32 master besides the float32 weights): 20Psi/N at stage 3, which DeepSpeed does not pay
    (its ZeRO-3 master aliases the float32 weight shard)."""
    if arm == "torch":
        return 16.0 * psi
    w = 2 if dtype == "bfloat16" else 4
    k = 12
    stage = int(arm[-1])
    if stage == 1:
        return w * psi + w * psi + k * psi / ranks
    if stage == 2:
        return w * psi + (w + k) * psi / ranks
    return (w + w + k) * psi / ranks


# --- what a rank holds -----------------------------------------------------------------------------------
def _tensors(obj: Any, depth: int = 3) -> list[Any]:
    """The tensors in ``obj``: itself, or inside its lists, tuples and dicts (``depth`` levels)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for x in (k, v) for t in _tensors(x, depth - 1)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v, depth - 1)]
    return []


def live_state(net: Any, optimizer: Any) -> dict[str, int]:
    """Bytes of tensor storage this process holds, each storage once, by where it was first found: ``weights`` (the
    parameters' data and ZeRO-3 shards), ``grads``, ``optimizer`` (its state, and every tensor attribute of it and
    of the optimizer it wraps), ``other`` (any other tensor the garbage collector knows); and ``total``."""
    import torch

    seen: dict[int, int] = {}
    out = {"weights": 0, "grads": 0, "optimizer": 0, "other": 0}

    def add(kind: str, tensors: list[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if ptr and ptr not in seen:
                seen[ptr] = size
                out[kind] += size

    params = list(net.parameters())
    add("weights", [t for p in params for t in (p.data, getattr(p, "ds_tensor", None))])
    add("weights", list(net.buffers()))
    add("grads", [p.grad for p in params])
    inners = [optimizer, getattr(optimizer, "optimizer", None)]
    for opt in inners:
        if opt is None:
            continue
        add("optimizer", [t for state in getattr(opt, "state", {}).values() for t in _tensors(state)])
        add("optimizer", [t for v in vars(opt).values() for t in _tensors(v)])
    gc.collect()
    add("other", [o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
    out["total"] = sum(seen.values())
    return out


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _probe_optimizer(rank: int, net: Any, optimizer: Any, holder: Any, attr: str, figures: dict[str, Any]) -> None:
    """Wrap ``holder.<attr>`` (the step the learner or DeepSpeed's engine calls) to measure the live state as each
    step enters it, then write this rank's figures (when ``CHORUS_BENCH_PROBE`` names a directory)."""
    step = getattr(holder, attr)
    where = os.environ.get(PROBE_ENV)

    def measured(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        figures["steps"].append({"state": live_state(net, optimizer), "rss_mb": _rss_mb(), "peak_mb": _peak_mb()})
        figures["steps"][-1]["probe_s"] = time.perf_counter() - t0  # taken off the step's time
        try:
            return step(*args, **kwargs)
        finally:
            figures["after_step_rss_mb"].append(_rss_mb())
            if where:
                Path(where, f"rank{rank}.json").write_text(json.dumps(figures))

    setattr(holder, attr, measured)


def probe_zero() -> None:
    """Every ZeroLearner of this process measures its state at each optimizer step (rank 0: the arm's worker;
    the others: :func:`follow_probed`)."""
    from services.trainer import zero

    if getattr(zero.ZeroLearner, "_bench_probed", False):
        return
    init = zero.ZeroLearner.__init__

    def probed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        figures: dict[str, Any] = {"rank": self.rank, "init_peak_mb": _peak_mb(), "init_rss_mb": _rss_mb(),
                                   "steps": [], "after_step_rss_mb": []}
        params = [p for p in self.net.parameters() if p.requires_grad]
        figures["psi"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
        self._bench_figures = figures
        _probe_optimizer(self.rank, self.net, self.optimizer, self.optimizer, "step", figures)

    zero.ZeroLearner.__init__ = probed_init  # type: ignore[method-assign]
    zero.ZeroLearner._bench_probed = True  # type: ignore[attr-defined]


def follow_probed(argv: list[str]) -> int:
    """A follower rank (what ``python -m services.trainer.zero`` runs), its learner probed."""
    from services.trainer import zero

    probe_zero()
    return zero.follow(Path(argv[0]), argv[1], int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5]))


@contextlib.contextmanager
def probed_followers() -> Any:
    """TrainerGroup's followers started through :func:`follow_probed` (the same ``follow``, measured)."""
    from services.trainer import zero

    popen = zero.subprocess.Popen

    def start(args: list[str], *rest: Any, **kwargs: Any) -> Any:
        if args[1:3] == ["-m", "services.trainer.zero"]:
            args = [args[0], "-m", "loadtests.bench_trainer", "--follow", *args[3:]]
        return popen(args, *rest, **kwargs)

    zero.subprocess.Popen = start  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        zero.subprocess.Popen = popen  # type: ignore[misc]


# --- the arms --------------------------------------------------------------------------------------------
def config(tmp: Path, arm: str, mode: str, samples: int, arch: str = "135m", dtype: str = "float32") -> Path:
    trainer = "" if arm == "torch" else \
        f", trainer: {{backend: deepspeed, deepspeed: {{ranks: {RANKS}, zero_stage: {arm[-1]}}}}}"
    lora = ", lora: {r: 8, target_modules: [q_proj, k_proj, v_proj, o_proj]}" if mode == "lora" else ""
    agents = ("{solver: {model: m, adapter: sol}, verifier: {model: m, adapter: ver}}" if mode == "lora"
              else "{solver: {model: m}, verifier: {model: m}}")
    source = "source: smollm2" if arch == "135m" else \
        f"source: tiny, arch: {json.dumps(ARCH_360M)}"
    path = tmp / f"{arm}-{mode}-{dtype}.yaml"
    path.write_text(
        f"run: {{id: bench, dir: {ROOT / 'runs'}}}\n"
        f"models: {{m: {{{source}, dtype: {dtype}, optim: {{lr: 1.0e-5, grad_clip: 1.0}}{lora}{trainer}}}}}\n"
        f"agents: {agents}\n"
        "workflow: {group_size: 2, temperature: 1.0}\n"
        f"train: {{global_batch: {samples}, micro_batch: 4, threads: {RANKS if arm == 'torch' else 1}}}\n")
    return path


def batches(cfg: Any, samples: int, prompt: int, response: int, step: int) -> list[list[Any]]:
    import numpy as np

    from shared.kernel.schemas import Array, Sample

    adapters = cfg.adapters_of("m") if cfg.models["m"].lora is not None else None
    # SmolLM2's vocabulary, or the byte vocabulary of a random-init model (printable bytes)
    low, high = (100, 40000) if cfg.models["m"].source == "smollm2" else (32, 127)
    rows = []
    for i in range(samples):
        rng = np.random.default_rng(1000 * step + i)
        rows.append(Sample(
            run="b", episode=f"e{step}-{i // 2}", sample_id=f"s{step}-{i}", env_idx=i // 2, rollout_idx=i % 2,
            agent=("solver", "verifier")[i % 2], model="m", turn=0,
            prompt_ids=Array.of(rng.integers(low, high, prompt).tolist(), "int32"),
            response_ids=Array.of(rng.integers(low, high, response).tolist(), "int32"),
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
    probe_dir = tempfile.mkdtemp(prefix="bench-probe-")
    os.environ[PROBE_ENV] = probe_dir
    if arm == "torch":
        learner: Any = Learner(cfg, "m")
        figures: dict[str, Any] = {"rank": 0, "init_peak_mb": _peak_mb(), "init_rss_mb": _rss_mb(), "steps": [],
                                   "after_step_rss_mb": [],
                                   "psi": sum(p.numel() for p in learner.net.parameters() if p.requires_grad)}
        _probe_optimizer(0, learner.net, learner.optimizer, learner.optimizer, "step", figures)
    else:
        probe_zero()
        with probed_followers():
            learner = TrainerGroup(cfg, "m", threads=1)
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
    ranks = [json.loads(p.read_text()) for p in sorted(Path(probe_dir).glob("rank*.json"))]
    for p in Path(probe_dir).iterdir():
        p.unlink()
    os.rmdir(probe_dir)
    # the probe's own time off each step (the slowest rank's: the others wait for it at the step's collectives)
    times = [t - max((r["steps"][i + 1]["probe_s"] for r in ranks if len(r["steps"]) > i + 1), default=0.0)
             for i, t in enumerate(times)]
    # each rank's live state: the last timed step's (every timed step enters the optimizer with AdamW's moments)
    states = [r["steps"][-1]["state"] for r in ranks]
    return {"step_s": statistics.median(times), "steps": times, "rss_mb": max(own, children), "rank0_mb": own,
            "others_mb": children, "gpu_mb": gpu, "psi": ranks[0]["psi"] if ranks else None,
            "state_mb": max(s["total"] for s in states) / MB if states else None, "states": states,
            "ranks": ranks}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _ratio_line(torch_r: dict, zero3: dict, formula: float) -> str:
    error = abs(zero3["state_mb"] * MB - formula) / formula
    return (f"ratio zero3_state={zero3['state_mb'] / torch_r['state_mb']:.3f} "
            f"zero3_peak={zero3['rss_mb'] / torch_r['rss_mb']:.3f} formula_error={error:.3f}")


def report_large(runs: list[dict[tuple[str, str], dict]], args: argparse.Namespace) -> None:
    """The larger architecture's table (medians over the runs) and its ratio lines."""
    keys = list(runs[0])
    psi = int(next(iter(runs[0].values()))["psi"])
    if ("torch", "float32") not in runs[0]:  # no baseline: every "vs torch" against the arm itself
        runs = [{**run, ("torch", "float32"): next(iter(run.values()))} for run in runs]
    print(f"\nSmolLM2-360M's shape, random init, Psi = {psi:,} parameters; {args.samples} samples of {args.prompt} + "
          f"{args.response} tokens per step, each run's step time the median of {args.steps} steps; medians of "
          f"{len(runs)} run(s); torch: {RANKS} threads, ZeRO: {RANKS} ranks x 1 thread; MALLOC_MMAP_THRESHOLD_ "
          f"{args.mmap_threshold or 'unset'}")
    print("| arm | dtype | step s | vs torch | peak RSS per rank MB | vs torch | rank 0 / 1 MB | RSS after init MB "
          "| live state per rank MB | formula MB | error | vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, dtype in keys:
        rs = [run[(arm, dtype)] for run in runs]
        base = [run[("torch", "float32")] for run in runs]
        formula = formula_bytes(arm, dtype, psi) / MB
        step = _median([r["step_s"] for r in rs])
        peak = _median([r["rss_mb"] for r in rs])
        state = _median([r["state_mb"] for r in rs])
        init = _median([max(x["init_peak_mb"] for x in r["ranks"]) for r in rs])
        ranks = "-" if arm == "torch" else \
            f"{_median([r['rank0_mb'] for r in rs]):.0f} / {_median([r['others_mb'] for r in rs]):.0f}"

        def vs(key: str, rs: list[dict] = rs, base: list[dict] = base) -> float:  # the median of the runs' ratios
            return _median([r[key] / b[key] for r, b in zip(rs, base, strict=True)])

        print(f"| {arm} | {dtype} | {step:.2f} | {vs('step_s'):.2f} | {peak:.0f} | {vs('rss_mb'):.3f} | {ranks} "
              f"| {init:.0f} | {state:.0f} | {formula:.0f} | {abs(state - formula) / formula:.3f} "
              f"| {vs('state_mb'):.3f} |")
    print("\nlive state by kind, MB (first run, largest rank): " + "; ".join(
        f"{arm} {dtype}: " + ", ".join(f"{k} {v / MB:.0f}" for k, v in max(
            runs[0][(arm, dtype)]["states"], key=lambda s: s["total"]).items() if k != "total")
        for arm, dtype in keys))
    if ("zero3", "bfloat16") not in runs[0]:
        return
    formula = formula_bytes("zero3", "bfloat16", psi)
    lines = [_ratio_line(run[("torch", "float32")], run[("zero3", "bfloat16")], formula) for run in runs]
    for i, line in enumerate(lines, 1):
        print(f"run {i}: {line}")
    values = [dict(kv.split("=") for kv in line.split()[1:]) for line in lines]
    print("ratio " + " ".join(f"{k}={_median([float(v[k]) for v in values]):.3f}" for k in values[0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["135m", "360m"], default="135m",
                    help="135m: SmolLM2-135M's weights; 360m: SmolLM2-360M's shape, random init, full fine-tuning")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, help="prompt tokens (default 48; 16 at 360m)")
    ap.add_argument("--response", type=int, help="response tokens (default 48; 16 at 360m)")
    ap.add_argument("--modes", help="full,lora (default; 360m: full only)")
    ap.add_argument("--zero-dtypes", default="bfloat16",
                    help="360m: the ZeRO arms' dtypes, of bfloat16,float32 (the torch learner: float32)")
    ap.add_argument("--arms", default=",".join(ARMS), help="of torch,zero1,zero2,zero3")
    ap.add_argument("--repeats", type=int, default=1, help="360m: runs of every arm (the table: their medians)")
    ap.add_argument("--mmap-threshold", type=int,
                    help="MALLOC_MMAP_THRESHOLD_ for every arm's processes (bytes; default: glibc's dynamic one)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--follow", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.follow:  # a follower rank of a group (started by TrainerGroup, see probed_followers)
        return follow_probed(args.follow)
    small = args.arch == "135m"
    args.prompt = args.prompt or (48 if small else 16)
    args.response = args.response or (48 if small else 16)
    args.modes = args.modes or ("full,lora" if small else "full")
    if args.arm:  # a worker: one arm, its figures as JSON on the last line
        print(json.dumps(run_arm(Path(args.config), args.arm, args.steps, args.samples, args.prompt, args.response)))
        return 0
    arms = args.arms.split(",")
    if small:
        plan = [(arm, mode, "float32") for mode in args.modes.split(",") for arm in arms]
    else:  # the torch learner in float32, then the ZeRO arms in each of --zero-dtypes
        plan = [("torch", "full", "float32")] if "torch" in arms else []
        plan += [(arm, "full", dtype) for dtype in args.zero_dtypes.split(",") for arm in arms if arm != "torch"]
    # glibc serves an allocation under its mmap threshold from its heap, which keeps freed holes; the threshold
    # starts at 128 KiB and rises to the size of each mmapped chunk freed (up to 32 MiB): a fixed one stops that
    malloc = {} if args.mmap_threshold is None else {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
    runs: list[dict[tuple[str, str], dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats if not small else 1):
            results: dict[tuple[str, str], dict] = {}
            for arm, mode, dtype in plan:
                t0 = time.perf_counter()
                path = config(Path(tmp), arm, mode, args.samples, args.arch, dtype)
                proc = subprocess.run([sys.executable, __file__, "--arch", args.arch, "--arm", arm, "--config",
                                       str(path), "--steps", str(args.steps), "--samples", str(args.samples),
                                       "--prompt", str(args.prompt), "--response", str(args.response)],
                                      capture_output=True, text=True,
                                      env={**os.environ, "PYTHONWARNINGS": "ignore", **malloc}, cwd=ROOT)
                if proc.returncode != 0:
                    print(f"{arm} {mode} {dtype}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                    return 1
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                results[(arm, mode) if small else (arm, dtype)] = r
                state = "" if r["state_mb"] is None else f", live state per rank {r['state_mb']:.0f} MB"
                print(f"  {'' if small else f'run {repeat + 1} '}{mode:4} {arm:6} {dtype:8} step {r['step_s']:.2f} s, "
                      f"peak RSS per rank {r['rss_mb']:.0f} MB{state} ({time.perf_counter() - t0:.0f} s)", flush=True)
            runs.append(results)
    if not small:
        report_large(runs, args)
        return 0
    results = runs[0]
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
