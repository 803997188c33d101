"""The training pool against static allocation, on a bursty multi-agent trace, with real forward/backward passes.

    python loadtests/bench_training_pool.py [--repeats 3] [--hidden 768] [--only all|training|system] [--quick]

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

Then the whole system (FlexMARL §8.4: the machine's utilisation, rollouts and training together): rollout work is
real compute, Chorus's engine (``TorchEngine``) generating with a tiny random model in rollout instances (spawned
processes, one torch thread, one per core, started once and parked between loans), in chunks of 8 rows x
``--chunk-tokens`` new tokens. A micro-batch becomes available only when its rollouts are done: each round of
rollouts (a burst of the same bursty traces, 76% of the micro-batches to one agent) is ``chunks`` chunks per
micro-batch, its micro-batches released together when the round's last chunk ends; rounds follow each other without
waiting for training (the asynchronous pipeline). ``chunks`` is set so that a micro-batch's rollouts cost
``--rollout-ratio`` (5) times its training in CPU seconds, both measured here (the training from the 4-model static
arm above). Time to the target versions: until every model reached its target version. Arms, side by side, the
order alternating per repeat, on the same two cores:
- static: the rollout instance on the first core for the whole run, every model's trainer (a slot each, its state
  never leaving it) on the second (the static arm above, with the rollouts beside it).
- pool: a slot on each core, and a :class:`~services.trainer.lending.CoreLender` listening to the pool: a core no
  slot holds is lent to the rollout instance pinned to it, which generates chunk after chunk until a slot takes the
  core back (it finishes its chunk, about 50 ms, then waits).
Machine utilisation: (rollout CPU seconds + training CPU seconds) / (cores x wall seconds); rollout CPU seconds are
each chunk's ``time.process_time`` in its instance, training CPU seconds the slots' (as above). ``waited s`` is the
run-queue wait of these processes (``schedstat``): other processes on the machine, or a chunk finishing on a core
a slot took back.

Ends with ``ratio utilisation=<pool / static> time=<static / pool>`` on the 4-model trace (medians over repeats),
then ``ratio machine_utilisation=<pool / static> system_time=<static / pool>`` of the whole-system arms.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.lending import CoreLender  # noqa: E402
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


# --- the whole system: rollouts and training on the same cores ----------------------------------------------------
ROLLOUT_ROWS, ROLLOUT_PROMPT = 8, 24  # a rollout chunk: this many rows of this long a prompt, a few new tokens each


def rollout_worker(conn: Connection, core: int, cfg_path: str, tokens: int) -> None:
    """An elastic rollout instance (a spawned process): Chorus's engine with a tiny random model, one torch thread,
    every thread pinned to ``core``. Answers ``("chunk",)`` with one chunk's CPU seconds (``time.process_time``
    around the generation: every thread of this process) and tokens; blocked in ``recv`` (no CPU) in between."""
    import torch

    from services.rollouter.engine import SamplingParams, TorchEngine
    from shared.models.modeling import build_model

    torch.set_num_threads(1)
    cfg = load_config(Path(cfg_path))
    engine = TorchEngine(build_model(cfg, next(iter(cfg.models))), max_batch=ROLLOUT_ROWS, seed=core)
    rng = random.Random(core)
    prompts = [[BOS_ID] + [rng.randint(32, 126) for _ in range(ROLLOUT_PROMPT - 1)] for _ in range(ROLLOUT_ROWS)]
    params = [SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=1.0) for _ in prompts]
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})

    def chunk() -> tuple[float, int]:
        c0 = time.process_time()
        out = engine.generate(prompts, params)
        return time.process_time() - c0, sum(len(r.ids) for r in out)

    warm = sorted(chunk()[0] for _ in range(5))  # the first chunks are slower (allocations): the median of five
    conn.send(("ready", warm[2]))
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        conn.send(("done", *chunk()))


class RolloutStream:
    """An arm's rollout work: ``chunks`` per micro-batch, round after round; a round's micro-batches become
    available (their events set) when every chunk of the round is done (rollouts end together: the burst)."""

    def __init__(self, rounds: list[list[str]], chunks: int) -> None:
        self.rounds = rounds
        self.arrivals: dict[str, list[threading.Event]] = {}
        self.of_round: list[list[threading.Event]] = []
        for models in rounds:
            evs = [threading.Event() for _ in models]
            for m, ev in zip(models, evs, strict=True):
                self.arrivals.setdefault(m, []).append(ev)
            self.of_round.append(evs)
        self.bounds: list[int] = []
        total = 0
        for models in rounds:
            total += chunks * len(models)
            self.bounds.append(total)
        self.total = total
        self.lock = threading.Lock()
        self.next = 0
        self.finished: set[int] = set()
        self.low = 0  # every chunk below it is done
        self.released = 0  # rounds whose micro-batches are available
        self.cpu_s = 0.0
        self.tokens = 0
        self.by_core: dict[int, int] = {}

    def take(self) -> int | None:
        with self.lock:
            if self.next >= self.total:
                return None
            self.next += 1
            return self.next - 1

    def done(self, index: int, core: int, cpu_s: float, tokens: int) -> None:
        with self.lock:
            self.finished.add(index)
            self.cpu_s += cpu_s
            self.tokens += tokens
            self.by_core[core] = self.by_core.get(core, 0) + 1
            while self.low in self.finished:
                self.low += 1
            while self.released < len(self.bounds) and self.low >= self.bounds[self.released]:
                for ev in self.of_round[self.released]:
                    ev.set()
                self.released += 1


class RolloutLane:
    """The parent's side of one elastic rollout instance pinned to one core: a :class:`CoreLender` borrower. While
    its core is lent, a feeder thread hands the worker chunk after chunk of the arm's stream; ``reclaim`` closes the
    gate, so the worker finishes the chunk it is in and then waits (parked in ``recv``)."""

    def __init__(self, ctx: Any, core: int, cfg_path: Path, tokens: int) -> None:
        self.core = core
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=rollout_worker, args=(theirs, core, str(cfg_path), tokens), daemon=True,
                                name=f"rollout-{core}")
        self.proc.start()
        theirs.close()
        self.gate = threading.Event()
        self.thread: threading.Thread | None = None
        self.chunk_cpu = 0.0
        self.error: BaseException | None = None

    def ready(self) -> None:
        reply = self.conn.recv()
        assert reply[0] == "ready", reply
        self.chunk_cpu = float(reply[1])

    def lend(self, core: int) -> None:
        self.gate.set()

    def reclaim(self, core: int) -> None:
        self.gate.clear()

    def begin(self, stream: RolloutStream) -> None:
        self.thread = threading.Thread(target=self._feed, args=(stream,), name=f"lane-{self.core}", daemon=True)
        self.thread.start()

    def _feed(self, stream: RolloutStream) -> None:
        try:
            while True:
                self.gate.wait()
                index = stream.take()
                if index is None:
                    return
                self.conn.send(("chunk",))
                _, cpu_s, tokens = self.conn.recv()
                stream.done(index, self.core, cpu_s, tokens)
        except BaseException as exc:  # noqa: BLE001 - reported by the arm
            self.error = exc

    def end(self) -> None:
        """After the arm (its stream is used up): let the feeder see that and stop; the gate closed again."""
        self.gate.set()
        if self.thread is not None:
            self.thread.join()
        self.gate.clear()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("exit",))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def trace_rounds(trace: list[tuple[float, str]]) -> list[list[str]]:
    """The bursts of a :func:`bursty_trace` as rounds of rollouts: the micro-batches of one burst (arrivals less than
    0.3 s apart; bursts are at least ``gap / 2`` apart), in order."""
    rounds: list[list[str]] = []
    last = -1e9
    for t, m in trace:
        if t - last > 0.3:
            rounds.append([])
        rounds[-1].append(m)
        last = t
    return rounds


def run_queue_wait(pids: list[int | None]) -> float:
    """Seconds these processes' threads have waited for a core while runnable (``/proc/<pid>/task/*/schedstat``):
    on a quiet machine only our own overlap (a reclaimed core's last chunk), else other processes' load too."""
    total = 0
    for pid in pids:
        if pid is None:
            continue
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
    return total / 1e9


@dataclass
class SystemResult:
    seconds: float
    rollout_cpu_s: float
    train_cpu_s: float
    cores: int
    versions: dict[str, int]
    lent_core_s: float = 0.0
    swap_data_s: float = 0.0
    tokens: int = 0
    waited_s: float = 0.0

    @property
    def machine(self) -> float:
        return (self.rollout_cpu_s + self.train_cpu_s) / (self.cores * self.seconds)

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.rollout_cpu_s if self.rollout_cpu_s else 0.0


def system_replay(learners: dict[str, PooledLearner], stream: RolloutStream, lanes: list[RolloutLane],
                  start: Any) -> tuple[float, dict[str, int]]:
    """Rollouts (the lanes, on whatever cores ``start`` lends them) and each model's thread training its
    micro-batches as the rollouts make them; returns the seconds until every model reached its target version."""
    finished: dict[str, float] = {}
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def run(model: str) -> None:
        try:
            mine = stream.arrivals.get(model, [])
            learner = learners[model]
            for k, ev in enumerate(mine):
                ev.wait()
                learner.micro_batch(make_batch(model, k), list(range(MICRO)), "grpo")
                learner.step()
                if k + 1 == len(mine):
                    finished[model] = time.perf_counter() - t0
                learner.release(k + 1 < len(mine) and mine[k + 1].is_set())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            for evs in stream.arrivals.values():  # the other threads are not left waiting
                for e in evs:
                    e.set()

    threads = [threading.Thread(target=run, args=(m,), name=m) for m in learners]
    for lane in lanes:
        lane.begin(stream)
    start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(finished.values()), {m: lr.version for m, lr in learners.items()}


def run_system_static(cfg: ChorusConfig, rounds: list[list[str]], chunks: int, cores: list[int],
                      lanes: dict[int, RolloutLane]) -> SystemResult:
    """Static allocation of the same cores: the rollout instance on the first core for the whole run, every model's
    trainer (a slot each, its state never leaving it) on the second."""
    models = list(cfg.models)
    pools = [TrainingPool(cfg, slots=1, cores=[[cores[1]]], swap=False) for _ in models]
    lender = CoreLender({cores[0]: lanes[cores[0]]})
    stream = RolloutStream(rounds, chunks)
    try:
        learners = build(list(zip(pools, models, strict=True)))
        cpu0 = sum(p.times.compute_cpu_s for p in pools)
        pids = [lane.proc.pid for lane in lanes.values()] + [w.pid for p in pools for w in p.workers]
        wait0 = run_queue_wait(pids)
        seconds, versions = system_replay(learners, stream, list(lanes.values()), lambda: lender.update([cores[0]]))
        waited = run_queue_wait(pids) - wait0
        lent = sum(lender.lent_seconds().values())
        lender.close()
        for lane in lanes.values():
            lane.end()
        cpu = sum(p.times.compute_cpu_s for p in pools) - cpu0
    finally:
        lender.close()
        for p in pools:
            p.close()
    return SystemResult(seconds, stream.cpu_s, cpu, len(cores), versions, lent, 0.0, stream.tokens, waited)


def run_system_pool(cfg: ChorusConfig, rounds: list[list[str]], chunks: int, cores: list[int],
                    lanes: dict[int, RolloutLane]) -> SystemResult:
    """The pool: a slot on each core, and on each core the rollout instance that the lender lets run whenever no
    slot holds the core."""
    pool = TrainingPool(cfg, slots=len(cores), cores=[[c] for c in cores])
    lender = CoreLender({c: lanes[c] for c in cores}, current=pool.free_cores)
    stream = RolloutStream(rounds, chunks)
    try:
        learners = build([(pool, m) for m in cfg.models])
        cpu0, data0 = pool.times.compute_cpu_s, pool.times.data_s
        pool.listeners.append(lender)
        pids = [lane.proc.pid for lane in lanes.values()] + [w.pid for w in pool.workers]
        wait0 = run_queue_wait(pids)
        seconds, versions = system_replay(learners, stream, list(lanes.values()), lambda: lender.update(()))
        waited = run_queue_wait(pids) - wait0
        pool.listeners.remove(lender)
        lent = sum(lender.lent_seconds().values())
        lender.close()
        for lane in lanes.values():
            lane.end()
        cpu, data = pool.times.compute_cpu_s - cpu0, pool.times.data_s - data0
    finally:
        lender.close()
        pool.close()
    return SystemResult(seconds, stream.cpu_s, cpu, len(cores), versions, lent, data, stream.tokens, waited)


def training_cpu_per_micro_batch(cfg: ChorusConfig, core: int, n: int = 4) -> float:
    """CPU seconds of one micro-batch (and its share of the optimizer steps) of these models, on one slot."""
    pool = TrainingPool(cfg, slots=1, cores=[[core]], swap=False)
    try:
        model = next(iter(cfg.models))
        learner = PooledLearner(pool, model)
        cpu0 = pool.times.compute_cpu_s
        for k in range(n):
            learner.micro_batch(make_batch(model, k), list(range(MICRO)), "grpo")
            learner.step()
        return (pool.times.compute_cpu_s - cpu0) / n
    finally:
        pool.close()


def whole_system(cfg: ChorusConfig, root: Path, args: argparse.Namespace, cores: list[int],
                 train_cpu: float | None) -> list[float]:
    """The whole-system arms, side by side, ``args.repeats`` times; prints their table; returns the per-repeat
    (machine utilisation pool/static, time static/pool) pairs flattened as [util..., time...]."""
    names = list(cfg.models)
    make_cfg(root, 1, args.rollout_hidden)  # the rollout model's config, at bench-1-<hidden>.yaml
    ctx = mp.get_context("spawn")
    lanes = {c: RolloutLane(ctx, c, root / f"bench-1-{args.rollout_hidden}.yaml", args.chunk_tokens) for c in cores}
    try:
        for lane in lanes.values():
            lane.ready()
        chunk_cpu = statistics.median(lane.chunk_cpu for lane in lanes.values())
        if train_cpu is None:
            train_cpu = training_cpu_per_micro_batch(cfg, cores[1])
        chunks = max(1, round(args.rollout_ratio * train_cpu / chunk_cpu))
        rows: dict[str, list[SystemResult]] = {"static": [], "pool": []}
        for r in range(args.repeats):
            trace = bursty_trace(names, args.system_bursts, 3.5, seed=r)
            rounds = trace_rounds(trace)
            arms = [("static", run_system_static), ("pool", run_system_pool)]
            for name, fn in (arms if r % 2 == 0 else arms[::-1]):
                rows[name].append(fn(cfg, rounds, chunks, cores, lanes))
            targets = {m: sum(1 for _, x in trace if x == m) // 2 for m in names}
            for name in rows:
                assert rows[name][-1].versions == targets, (name, rows[name][-1].versions, targets)
    finally:
        for lane in lanes.values():
            lane.close()
    trace0 = bursty_trace(names, args.system_bursts, 3.5, seed=0)
    print(f"\nwhole system: {len(names)} models, rollouts and training on the same {len(cores)} cores; trace 0: "
          f"{len(trace0)} micro-batches in {len(trace_rounds(trace0))} rounds of rollouts ({args.repeats} repeats, "
          f"medians)")
    print(f"rollout work per micro-batch: {chunks} chunks of {ROLLOUT_ROWS} rows x {args.chunk_tokens} new tokens "
          f"({args.rollout_hidden}-wide x 4 layers, Chorus's TorchEngine), {chunks * chunk_cpu:.2f} CPU s = "
          f"{chunks * chunk_cpu / train_cpu:.1f} x the training's {train_cpu:.2f} CPU s (chunk {chunk_cpu * 1e3:.0f} ms)")
    print(f"{'arm':8} {'time s':>8} {'rollout cpu s':>14} {'train cpu s':>12} {'machine util':>13} "
          f"{'lent core s':>12} {'swap data s':>12} {'tok/cpu s':>10} {'waited s':>9}")
    for name, rs in rows.items():
        m = [statistics.median(getattr(x, f) for x in rs) for f in ("seconds", "rollout_cpu_s", "train_cpu_s",
                                                                      "machine", "lent_core_s", "swap_data_s",
                                                                      "tokens_per_cpu_s", "waited_s")]
        print(f"{name:8} {m[0]:8.1f} {m[1]:14.1f} {m[2]:12.1f} {m[3]:13.3f} {m[4]:12.1f} {m[5]:12.3f} {m[6]:10.0f} "
              f"{m[7]:9.1f}")
    ut = [p.machine / s.machine for p, s in zip(rows["pool"], rows["static"], strict=True)]
    tm = [s.seconds / p.seconds for p, s in zip(rows["pool"], rows["static"], strict=True)]
    print(f"per repeat: machine utilisation pool/static {', '.join(f'{x:.2f}' for x in ut)}; "
          f"time static/pool {', '.join(f'{x:.2f}' for x in tm)}")
    return [statistics.median(ut), statistics.median(tm)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768, help="hidden size of the trace's models (4 layers: 24M "
                    "parameters at 768)")
    ap.add_argument("--bursts", type=int, default=7)
    ap.add_argument("--gap", type=float, default=3.5, help="mean seconds between bursts (the rollouts of a round)")
    ap.add_argument("--sizes", default="256,768,1536", help="hidden sizes of the swap measurement (4 layers)")
    ap.add_argument("--system-bursts", type=int, default=4, help="rounds of rollouts of the whole-system arms")
    ap.add_argument("--rollout-ratio", type=float, default=5.0, help="whole system: rollout CPU seconds per "
                    "micro-batch over the training's (the chunks per micro-batch are set from it, measured here)")
    ap.add_argument("--rollout-hidden", type=int, default=256, help="hidden size of the rollout instances' model")
    ap.add_argument("--chunk-tokens", type=int, default=8, help="new tokens per row of a rollout chunk (a reclaimed "
                    "core waits for at most one chunk)")
    ap.add_argument("--only", choices=("all", "training", "system"), default="all",
                    help="training: the training-only arms and the swap; system: the whole-system arms")
    ap.add_argument("--quick", action="store_true", help="one repeat, small models, a short trace (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.hidden, args.bursts, args.gap, args.sizes = 1, 128, 4, 0.5, "128,256"
        args.system_bursts = 3
    cores = machine_cores()[:2]
    root = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    t_start = time.perf_counter()
    summary: dict[int, dict[str, list[float]]] = {}
    train_cpu: list[float] = []  # the 4-model static arm's training CPU seconds per micro-batch, per repeat
    for models in ((2, 4) if args.only != "system" else ()):
        cfg = make_cfg(root, models, args.hidden)
        names = list(cfg.models)
        rows: dict[str, list[ArmResult]] = {"static": [], "pool": []}
        for r in range(args.repeats):
            trace = bursty_trace(names, args.bursts, args.gap, seed=r)
            arms = [("static", run_static), ("pool", run_pool)]
            for name, fn in (arms if r % 2 == 0 else arms[::-1]):  # alternate which arm runs first
                rows[name].append(fn(cfg, trace, cores))
            if models == 4:
                train_cpu.append(rows["static"][-1].compute_cpu_s / len(trace))
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

    if args.only != "system":
        swap_table(root, args)
    system: list[float] = []
    if args.only != "training":
        system = whole_system(make_cfg(root, 4, args.hidden), root, args, cores,
                              statistics.median(train_cpu) if train_cpu else None)
    print(f"\n(ran {time.perf_counter() - t_start:.0f} s)")
    if 4 in summary:
        s4 = summary[4]
        print(f"ratio utilisation={statistics.median(s4['utilisation']):.2f} "
              f"time={statistics.median(s4['time']):.2f}")
    if system:
        print(f"ratio machine_utilisation={system[0]:.2f} system_time={system[1]:.2f}")


def swap_table(root: Path, args: argparse.Namespace) -> None:
    print("\nswap of the learner state (one slot, two models taking turns: each gives it up after a micro-batch, so "
          "its state is Set, and Got when it comes back)")
    print(f"{'hidden':>7} {'params M':>9} {'state MB':>9} {'control s':>10} {'set s':>8} {'get s':>8} "
          f"{'set GB/s':>9} {'get GB/s':>9}")
    for h in (int(x) for x in args.sizes.split(",")):
        c = swap_costs(root, h)
        print(f"{h:7d} {c['params_m']:9.1f} {c['state_mb']:9.1f} {c['control_s']:10.2f} {c['set_s']:8.4f} "
              f"{c['get_s']:8.4f} {c['set_gbs']:9.2f} {c['get_gbs']:9.2f}")


if __name__ == "__main__":
    main()
