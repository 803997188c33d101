"""The training pool against static allocation, on a bursty multi-agent trace, with real forward/backward passes.

    python loadtests/bench_training_pool.py [--repeats 3] [--hidden 640] [--quick]

Trace (Observation 2 of FlexMARL): micro-batches arrive in bursts, as rollouts end, with quiet gaps between the
bursts (the rollouts of the next round); one agent gets about 76% of them. Each model's micro-batches are real
samples (prompt and response token ids, behaviour log-probs, rewards), ``global_batch`` two micro-batches, so a
model's target version is half its micro-batches. Every model is the same Llama-shaped network of tens of millions
of parameters (``--hidden``, 4 layers), byte vocabulary, AdamW.

Arms, side by side on the same trace in one run, each with this machine's cores (two) for training:
- static: one slot per model, held for the whole run, the model's state never leaving it (a trainer process per
  model, as Chorus runs without ``train.pool``); with 4 models on 2 cores two slots share each core.
- pool: ``train.pool`` with one slot per core; a model takes a slot when a micro-batch of it is ready and gives it
  back after it (unless another of its micro-batches is ready and nobody waits), its state (weights, AdamW's
  moments, accumulated gradients) set to host memory after every micro-batch and got back where it moves.
Both arms run the same slot worker processes and learner code; a model's thread replays its arrivals (waits for
each, trains it, steps at each global batch) exactly as the trainer service does.

Utilisation: the training compute (CPU seconds the slot processes spend in micro-batches and optimizer steps)
over the core-seconds bound to training. Static allocation binds every core for the whole run; the pool binds a
slot's cores while a model holds it (between tenancies the slot's cores serve anything else: its process sleeps,
or, with ``mode: destroy``, is gone). That is FlexMARL's §6.1 argument, and the ratio printed at the end. The
machine's utilisation (compute over every core for the whole run) is printed beside it, for both arms.

Then the swap itself for three model sizes: control seconds (a slot process start and the learner's build) and data
seconds (Set: the state out of the slot after a micro-batch; Get: back in on another tenancy), with GB/s.

Ends with ``ratio utilisation=<pool / static> time=<static / pool>`` on the 4-model trace (medians over repeats).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.pool import PooledLearner, TrainingPool, machine_cores  # noqa: E402
from shared.kernel.config import ChorusConfig, load_config  # noqa: E402
from shared.kernel.schemas import Array, Sample  # noqa: E402
from shared.models.tokenizer import BOS_ID, EOS_ID  # noqa: E402

MICRO = 8  # samples per micro-batch
HOT_SHARE = 0.76


def make_cfg(root: Path, models: int, hidden: int, layers: int = 4) -> ChorusConfig:
    arch = (f"{{hidden_size: {hidden}, num_layers: {layers}, num_heads: {max(2, hidden // 64)}, "
            f"intermediate_size: {hidden * 2}, max_position: 128}}")
    names = [f"agent{i}_lm" for i in range(models)]
    lines = [f"run: {{id: bench-pool, dir: {root}}}", "models:"]
    lines += [f"  {n}: {{arch: {arch}, optim: {{lr: 1.0e-4, grad_clip: 1.0}}}}" for n in names]
    lines += ["agents:"] + [f"  a{i}: {{model: {n}}}" for i, n in enumerate(names)]
    lines += [f"workflow: {{name: chain, agents: [{', '.join(f'a{i}' for i in range(models))}], group_size: 4}}",
              f"train: {{global_batch: {2 * MICRO}, micro_batch: {MICRO}, pool: {{slots: 2, cores: 1}}}}"]
    p = root / f"bench-{models}-{hidden}.yaml"
    p.write_text("\n".join(lines) + "\n")
    return load_config(p)


def make_batch(model: str, seed: int, prompt: int = 24, response: int = 24) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for j in range(MICRO):
        resp = [rng.randint(32, 126) for _ in range(response - 1)] + [EOS_ID]
        out.append(Sample(
            run="bench", episode=f"e{seed}", sample_id=f"{model}_{seed}_{j}", env_idx=seed, rollout_idx=j,
            agent="a", model=model, turn=0, prompt_ids=Array.of([BOS_ID] + [rng.randint(32, 126) for _ in
                                                                            range(prompt - 1)], "int32"),
            response_ids=Array.of(resp, "int32"),
            behavior_logprobs=Array.of([-rng.random() * 3 for _ in range(response)], "float32"),
            reward=float(rng.random() < 0.5), group_key=f"g{seed}_{j // 4}", group_size=4, version=0))
    return out


def bursty_trace(models: list[str], bursts: int, gap_s: float, seed: int) -> list[tuple[float, str]]:
    """(arrival second, model): ``bursts`` bursts ``gap_s`` apart on average, 2 to 4 micro-batches each; 76% of all
    the micro-batches (rounded) go to the first model, at random places, the rest spread over the others; every
    model's count is made even (whole global batches) by one more micro-batch at the end where it is odd."""
    rng = random.Random(seed)
    times: list[float] = []
    t = 0.0
    for _ in range(bursts):
        times += [t + rng.random() * 0.2 for _ in range(rng.randint(2, 4))]
        t += rng.uniform(0.5, 1.5) * gap_s
    n = len(times)
    hot = round(HOT_SHARE * n)
    owners = [models[0]] * hot + [models[1 + i % (len(models) - 1)] for i in range(n - hot)]
    rng.shuffle(owners)
    out = sorted(zip(sorted(times), owners, strict=True))
    for m in models:
        if sum(1 for _, x in out if x == m) % 2:
            out.append((t, m))
    return sorted(out)


@dataclass
class ArmResult:
    seconds: float
    compute_cpu_s: float
    bound_core_s: float
    machine_core_s: float
    versions: dict[str, int]
    swap_data_s: float = 0.0
    swap_control_s: float = 0.0

    @property
    def utilisation(self) -> float:
        return self.compute_cpu_s / self.bound_core_s

    @property
    def machine(self) -> float:
        return self.compute_cpu_s / self.machine_core_s


def replay(learners: dict[str, PooledLearner], trace: list[tuple[float, str]]) -> tuple[float, dict[str, int]]:
    """Each model's thread trains its micro-batches as they arrive; returns the seconds until the last model reached
    its target version, and the versions reached."""
    t0 = time.perf_counter()
    finished: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(model: str) -> None:
        try:
            mine = [t for t, m in trace if m == model]
            learner = learners[model]
            for k, at in enumerate(mine):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                learner.micro_batch(make_batch(model, k), list(range(MICRO)), "grpo")
                learner.step()
                if k + 1 == len(mine):  # the target version is reached (the slot's release below is after it)
                    finished[model] = time.perf_counter() - t0
                more = k + 1 < len(mine) and t0 + mine[k + 1] <= time.perf_counter()
                learner.release(more)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,), name=m) for m in learners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(finished.values()), {m: lr.version for m, lr in learners.items()}


def build(pairs: list[tuple[TrainingPool, str]]) -> dict[str, PooledLearner]:
    """The models' learners, built in parallel (each in its slot: a process start and a model build)."""
    with ThreadPoolExecutor(len(pairs)) as ex:
        return dict(zip([m for _, m in pairs], ex.map(lambda pm: PooledLearner(*pm), pairs), strict=True))


def run_static(cfg: ChorusConfig, trace: list[tuple[float, str]], cores: list[int]) -> ArmResult:
    models = list(cfg.models)
    pools = [TrainingPool(cfg, slots=1, cores=[[cores[i % len(cores)]]], swap=False) for i in range(len(models))]
    try:
        learners = build(list(zip(pools, models, strict=True)))
        seconds, versions = replay(learners, trace)
        cpu = sum(p.times.compute_cpu_s for p in pools)
    finally:
        for p in pools:
            p.close()
    core_s = len(cores) * seconds
    return ArmResult(seconds, cpu, core_s, core_s, versions)


def run_pool(cfg: ChorusConfig, trace: list[tuple[float, str]], cores: list[int]) -> ArmResult:
    pool = TrainingPool(cfg, slots=len(cores), cores=[[c] for c in cores])
    try:
        learners = build([(pool, m) for m in cfg.models])
        base = sum(pool.sched.busy_seconds())  # the learners' builds and first states, before the trace
        data0, control0 = pool.times.data_s, pool.times.control_s
        seconds, versions = replay(learners, trace)
        held = sum(pool.sched.busy_seconds()) - base
        cpu = pool.times.compute_cpu_s
        data, control = pool.times.data_s - data0, pool.times.control_s - control0
    finally:
        pool.close()
    return ArmResult(seconds, cpu, held * 1, len(cores) * seconds, versions, data, control)


def swap_costs(root: Path, hidden: int) -> dict[str, float]:
    """One slot, two models of this size taking turns: control (process start, learner build) and data (Set, Get)."""
    cfg = make_cfg(root, 2, hidden)
    a, b = list(cfg.models)
    pool = TrainingPool(cfg, slots=1, cores=[[machine_cores()[0]]])
    try:
        la = PooledLearner(pool, a)
        start_build = pool.times.control_s
        lb = PooledLearner(pool, b)

        def turns(n: int, first: int) -> None:  # each turn: Get (the other model was in the slot), train, Set
            for k in range(first, first + n):
                for lr in (la, lb):
                    lr.micro_batch(make_batch(lr.model_name, k), list(range(MICRO)), "grpo")
                    lr.release()

        turns(2, 0)  # both state files of each model written once: their pages exist (a steady run's case)
        sets0, set0, gets0, get0 = pool.times.sets, pool.times.set_s, pool.times.gets, pool.times.get_s
        turns(3, 2)
        sets, gets = pool.times.sets - sets0, pool.times.gets - gets0
        nbytes = pool.store.get(a).nbytes  # type: ignore[union-attr]
        info = la._call("describe", mutates=False).value
        la.release()
        params = info.get("params", 0)
        return {"params_m": params / 1e6, "state_mb": nbytes / 2**20, "control_s": start_build,
                "set_s": (pool.times.set_s - set0) / sets, "get_s": (pool.times.get_s - get0) / gets,
                "set_gbs": nbytes / 1e9 / max((pool.times.set_s - set0) / sets, 1e-9),
                "get_gbs": nbytes / 1e9 / max((pool.times.get_s - get0) / gets, 1e-9)}
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768, help="hidden size of the trace's models (4 layers: 24M "
                    "parameters at 768)")
    ap.add_argument("--bursts", type=int, default=7)
    ap.add_argument("--gap", type=float, default=3.5, help="mean seconds between bursts (the rollouts of a round)")
    ap.add_argument("--sizes", default="256,768,1536", help="hidden sizes of the swap measurement (4 layers)")
    ap.add_argument("--quick", action="store_true", help="one repeat, small models, a short trace (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.hidden, args.bursts, args.gap, args.sizes = 1, 128, 4, 0.5, "128,256"
    cores = machine_cores()[:2]
    root = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    t_start = time.perf_counter()
    summary: dict[int, dict[str, list[float]]] = {}
    for models in (2, 4):
        cfg = make_cfg(root, models, args.hidden)
        names = list(cfg.models)
        rows: dict[str, list[ArmResult]] = {"static": [], "pool": []}
        for r in range(args.repeats):
            trace = bursty_trace(names, args.bursts, args.gap, seed=r)
            arms = [("static", run_static), ("pool", run_pool)]
            for name, fn in (arms if r % 2 == 0 else arms[::-1]):  # alternate which arm runs first
                rows[name].append(fn(cfg, trace, cores))
            targets = {m: sum(1 for _, x in trace if x == m) // 2 for m in names}
            for name in rows:
                assert rows[name][-1].versions == targets, (name, rows[name][-1].versions, targets)
        hot = sum(1 for _, m in bursty_trace(names, args.bursts, args.gap, 0) if m == names[0])
        total = len(bursty_trace(names, args.bursts, args.gap, 0))
        print(f"\n{models} models on {len(cores)} cores, {args.hidden}-wide x 4 layers; trace 0: {total} micro-batches "
              f"of {MICRO} samples, {hot / total:.0%} to {names[0]} ({args.repeats} repeats, medians)")
        print(f"{'arm':8} {'time s':>8} {'compute cpu s':>14} {'bound core s':>13} {'utilisation':>12} "
              f"{'machine util':>13} {'swap data s':>12} {'swap ctrl s':>12}")
        med: dict[str, list[float]] = {}
        for name, rs in rows.items():
            m = [statistics.median(getattr(x, f) if not callable(getattr(x, f)) else getattr(x, f)() for x in rs)
                 for f in ("seconds", "compute_cpu_s", "bound_core_s", "utilisation", "machine", "swap_data_s",
                           "swap_control_s")]
            med[name] = m
            print(f"{name:8} {m[0]:8.1f} {m[1]:14.1f} {m[2]:13.1f} {m[3]:12.3f} {m[4]:13.3f} {m[5]:12.3f} "
                  f"{m[6]:12.3f}")
        ut = [p.utilisation / s.utilisation for p, s in zip(rows["pool"], rows["static"], strict=True)]
        tm = [s.seconds / p.seconds for p, s in zip(rows["pool"], rows["static"], strict=True)]
        print(f"per repeat: utilisation pool/static {', '.join(f'{x:.2f}' for x in ut)}; "
              f"time static/pool {', '.join(f'{x:.2f}' for x in tm)}")
        summary[models] = {"utilisation": ut, "time": tm}

    print("\nswap of the learner state (one slot, two models taking turns: each gives it up after a micro-batch, so "
          "its state is Set, and Got when it comes back)")
    print(f"{'hidden':>7} {'params M':>9} {'state MB':>9} {'control s':>10} {'set s':>8} {'get s':>8} "
          f"{'set GB/s':>9} {'get GB/s':>9}")
    for h in (int(x) for x in args.sizes.split(",")):
        c = swap_costs(root, h)
        print(f"{h:7d} {c['params_m']:9.1f} {c['state_mb']:9.1f} {c['control_s']:10.2f} {c['set_s']:8.4f} "
              f"{c['get_s']:8.4f} {c['set_gbs']:9.2f} {c['get_gbs']:9.2f}")
    print(f"\n(ran {time.perf_counter() - t_start:.0f} s)")
    s4 = summary[4]
    print(f"ratio utilisation={statistics.median(s4['utilisation']):.2f} time={statistics.median(s4['time']):.2f}")


if __name__ == "__main__":
    main()
