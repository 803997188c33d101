"""The rollout engines, measured: new tokens per CPU-second of the engine process, on one pinned core.

    python loadtests/bench_rollout.py [--repeats 3] [--batches 1,8,32] [--depth 3] [--long 256] [--quick]

Arms: Chorus's static engine (`TorchEngine`: chunks of `max_batch` rows, each chunk runs until its longest
row ends), Chorus's continuous engine (`ContinuousEngine`: the whole queue submitted, at most `max_batch`
rows in flight, rows join as others finish), plain transformers `generate` (chunks of `max_batch`
left-padded rows), transformers' continuous batching (a `ContinuousBatchingManager` from
`model.init_continuous_batching`, at most `max_batch` requests per step) and vLLM (below). All five serve SmolLM2-135M-Instruct
in float32 (dequantised once into `runs/_cache`, as `configs/demo.yaml` does), greedily, one torch thread.

Each arm is its own worker process, started once (the models load in parallel), with one torch thread.
Every repeat runs every (cell, arm) job once, on one lane per core of the two this machine has: a lane takes
the longest job left whose arm is idle and pins the worker with every thread to its core for that job, so
both cores stay busy and no arm runs two jobs at once (`--one-core`: one lane, all on one core, about twice
the wall time). A worker times `time.process_time()` (every thread of the process) around the generation
only: engine set-up (a KV pool, a manager and its paged cache) is outside. CPU time, not wall time, because
this machine is shared and the job on the other core shares its memory bus.

Workload of a cell (batch B): a queue of `--depth` (3) batch-worths of requests, 2 for equal rows (a
batch-worth is B requests, 2 at B=1), each prompt the demo's solver prompt and a distinct question of its arithmetic task
("What is 13 - 7?", 29 to 31 tokens with the chat template), each row with a fixed output length: Chorus
`SamplingParams(max_new_tokens=L, ignore_eos=True, temperature=0)`; transformers' continuous batching
per-request `add_request(max_new_tokens=L, eos_token_id=-1)` (EOS off); `generate` one call per chunk of B
with `min_new_tokens = max_new_tokens =` the chunk's longest row (every row of a chunk runs that long, as in
any static batch). Only each row's target tokens count, so what a static batch spends on rows that already
ended is its loss.
- equal: every row `--equal` tokens (default 12).
- longtail: every row `min(40, ceil(8 * Pareto(1.5)))` tokens (8 to 40, mean 17.3), then one row of each
  batch-worth set to the long row, min(`--long`, max(16, 8 * B)) tokens (256 at B=32, 64 at B=8, 16 at B=1), at a
  seeded random place: the issue's shape, most rows 8 to 40 tokens and one of 256 in every 32.
The arms whose rows join (Chorus continuous, transformers' continuous batching) run the whole queue: rows
join as others end, and the long rows run beside short ones. The static-like arms (Chorus static,
transformers `generate`) run the first batch-worth: rows cannot join their batches, so the other
batch-worths would only be more chunks of the same shape at the same rate (one 256-token chunk at B=32 is
about 80 s of CPU on this machine; the whole queue three times over, for two arms, would not fit the 10
minutes).

Prints one table per (batch, shape): per arm the target tokens, median CPU seconds, median tokens per
CPU-second, their spread over repeats, the median ratio to the static arm, median wall seconds, and how many
rows start with the same 4 tokens as the static arm's (greedy: a check that every arm computes the same
model; float sums in other batch shapes may flip a near-tie later in a row). The last line is `ratio
continuous_vs_static=<x> vs_hf_generate=<y> vs_hf_continuous=<z>` for B=32, long-tailed: the median over
repeats of the continuous arm's tokens per CPU-second divided by the other arm's in the same repeat (n/a
where an arm is unavailable or B=32 was not run).

vLLM (the vllm arm, in the venv of the vllm extra, `.venv-vllm`, when this one lacks it): Chorus's rollouter
backend `VllmEngine` around vLLM's in-process engine, started once per worker, at most `max_batch` rows in flight
(a row joins as one ends, as the rollouter's batcher feeds it), prefix caching off like the other arms, greedy,
EOS off, one OpenMP thread (`VLLM_CPU_OMP_THREADS_BIND=nobind`, pinned like the others). A last line
`ratio chorus_vs_vllm=<x>` gives the continuous arm's tokens per CPU-second over vLLM's, B=32 long tail. The
continuous arm prints the kernel choices its engine measured on this CPU first (`rows`: Chorus's own kernel,
services/rollouter/rows.cpp, built on this machine; where it could not be built, the line says why).

transformers' continuous batching on CPU: no flash attention, so it runs `sdpa` over the keys of every
request of the step concatenated, with a block-diagonal mask: a decode step's attention costs B * (sum of
the rows' lengths) instead of sum of the lengths, a handicap that grows with B and length, and is its
design on CPU, not a setting left wrong. Its cache is sized here (pages of 256 tokens, room for two
batches of rows) so that nothing is evicted and prefilled again; prefix sharing is off (a prompt is shorter
than a page). It returns no log-probs (Chorus's engines compute the behaviour log-probs of every token).

About 8 minutes on this two-core machine when it is quiet; wall time stretches when other processes share
the cores, CPU time much less. `--quick` (1 repeat, depth 2, rows of 8, long rows of 32, short rows capped at
16) checks every arm in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: `python loadtests/bench_rollout.py`
    sys.path.insert(0, str(ROOT))

ARMS = ("static", "continuous", "hf_generate", "hf_continuous", "vllm")
STATIC_LIKE = ("static", "hf_generate")  # rows cannot join: they run the first batch-worth of the queue
TAIL_PER_ROW = 8  # the long row of a batch-worth is min(--long, max(16, 8 * B)) tokens: 16, 64, 256 at B = 1, 8, 32
SHAPES = ("equal", "longtail")
SHORT_MIN, SHORT_MAX, ALPHA = 8, 40, 1.5  # short rows of the long tail: min(40, ceil(8 * Pareto(1.5)))
HEADS = 4  # tokens per row compared with the static arm


# --- workload -------------------------------------------------------------------------------------------
def demo_config() -> Any:
    """configs/demo.yaml: its cache of the dequantised SmolLM2, its solver prompt and its arithmetic task."""
    from shared.kernel.config import load_config

    return load_config(ROOT / "configs" / "demo.yaml")


def cache_dir(cfg: Any) -> Path:
    path = cfg.cache_dir  # run.dir / "_cache", run.dir relative to the repository root
    return path if path.is_absolute() else ROOT / path


def lengths_for(batch: int, shape: str, n: int, equal: int, long: int, short_max: int,
                seed: int) -> list[int]:
    """The target output length of each of ``n`` requests (see the module docstring)."""
    if shape == "equal":
        return [equal] * n
    rng = random.Random(f"longtail/{batch}/{n}/{seed}")
    group = max(batch, 2)  # a batch-worth of one would be nothing but the long row
    cap = min(short_max, long)
    out = [min(cap, math.ceil(SHORT_MIN * rng.paretovariate(ALPHA))) for _ in range(n)]
    for start in range(0, n - group + 1, group):  # one long row in each whole batch-worth, none in the rest
        out[start + rng.randrange(group)] = long
    return out


def prompts_for(cfg: Any, tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    """``n`` distinct chat prompts of the demo (solver prompt, "What is 13 - 7?"), the same for every arm."""
    from services.coordinator.tasks import make_task

    rng = random.Random(seed)
    questions: dict[str, None] = {}
    while len(questions) < n:
        questions[make_task(rng, cfg.task).question] = None
    return [tokenizer.chat(cfg.agents["solver"].prompt, q) for q in questions]


# --- the arms (each in its own worker process) ----------------------------------------------------------
class Arm:
    """One engine: ``run`` makes ``lengths[i]`` tokens for ``prompts[i]``, at most ``batch`` rows at once."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def prepare(self, batch: int, prompts: list[list[int]], lengths: list[int]) -> Any:
        return None

    def run(self, state: Any, batch: int, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def finish(self, state: Any) -> None:
        return None


def chorus_params(lengths: list[int]) -> list[Any]:
    from services.rollouter.engine import SamplingParams

    return [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]


class ChorusStatic(Arm):
    def prepare(self, batch: int, prompts: list[list[int]], lengths: list[int]) -> Any:
        from services.rollouter.engine import TorchEngine

        return TorchEngine(self.model, self.tokenizer, max_batch=batch)

    def run(self, state: Any, batch: int, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        return [r.ids for r in state.generate(prompts, chorus_params(lengths))]


class ChorusContinuous(ChorusStatic):
    def __init__(self, model: Any, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        from services.rollouter.continuous import ContinuousEngine  # being written: may not import yet

        self.engine_cls = ContinuousEngine
        # raises if this model is not one it serves; measures the kernel plan (outside every measurement)
        self.choices = self.engine_cls(model, tokenizer, max_batch=1).kernel_choices()
        from services.rollouter import native

        self.native = native.why_unavailable()  # empty: Chorus's own kernel was built and measured

    def prepare(self, batch: int, prompts: list[list[int]], lengths: list[int]) -> Any:
        # A fresh engine per job: no KV pool or prefix cache carried over from the previous repeat.
        return self.engine_cls(self.model, self.tokenizer, max_batch=batch, max_tokens=0, seed=0)


class HFGenerate(Arm):
    def run(self, state: Any, batch: int, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        import torch
        from transformers import GenerationConfig

        out: list[list[int]] = []
        for start in range(0, len(prompts), batch):
            chunk, need = prompts[start:start + batch], lengths[start:start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.tokenizer.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            ids, mask = ids.to(self.model.device), mask.to(self.model.device)  # a model on a GPU (gpu_check.py)
            # EOS off: the chunk runs to its longest row, every row to the end (what a static batch costs).
            cfg = GenerationConfig(do_sample=False, max_new_tokens=max(need), min_new_tokens=max(need),
                                   eos_token_id=None, pad_token_id=self.tokenizer.pad_id)
            with torch.inference_mode():
                seqs = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            out += [seqs[i, width:width + n].tolist() for i, n in enumerate(need)]
        return out


class HFContinuous(Arm):
    def prepare(self, batch: int, prompts: list[list[int]], lengths: list[int]) -> Any:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page = 256
        per_row = math.ceil((max(len(p) for p in prompts) + max(lengths)) / page)
        cb = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=2 * batch * per_row + 4,  # room for every row in flight: nothing evicted, re-prefilled
            max_batch_tokens=max(2048, batch * max(len(p) for p in prompts)),  # a batch's prompts in one step
            max_requests_per_batch=batch,  # = max_batch of the Chorus engines
            allow_block_sharing=False,  # a prompt is shorter than a 256-token page: nothing could be shared
            seed=0,
        )
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=-1,
                               pad_token_id=self.tokenizer.pad_id)
        manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.warmup()  # builds the paged cache and batch processor before the clock starts
        manager.start()
        return manager

    def run(self, state: Any, batch: int, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        ids = [state.add_request(p, max_new_tokens=n, eos_token_id=-1)
               for p, n in zip(prompts, lengths, strict=True)]
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            res = state.get_result(timeout=60)
            if res is None:
                raise RuntimeError(f"transformers' continuous batching stopped, {len(done)}/{len(ids)} done")
            if res.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed a request: {res.error}")
            if res.is_finished():
                done[res.request_id] = list(res.generated_tokens)
        return [done[i] for i in ids]

    def finish(self, state: Any) -> None:
        state.stop(block=True)
        state.destroy()


class Vllm(Arm):
    """vLLM in-process behind Chorus's rollouter protocol (:class:`VllmEngine`), started once per worker: at most
    ``batch`` rows in flight, a new row joining as one ends, the way the rollouter's batcher feeds it."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        from services.rollouter.vllm_engine import VllmEngine
        from shared.kernel.config import VllmSection

        # 64 rows of a 30-token prompt and a 256-token row: about 0.85 GiB of float32 KV for SmolLM2
        self.engine = VllmEngine(model, tokenizer, settings=VllmSection(kv_cache_gib=2.0, prefix_caching=False),
                                 max_batch=64)

    def run(self, state: Any, batch: int, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        engine = self.engine
        rows = [engine.row(p, prm, handle=i) for i, (p, prm) in enumerate(zip(prompts, chorus_params(lengths),
                                                                              strict=True))]
        queue = list(reversed(rows))
        out: dict[int, list[int]] = {}
        while queue or engine.busy:
            new = [queue.pop() for _ in range(min(len(queue), batch - engine.rows_in_flight))]
            for r in engine.step(new):
                out[r.handle] = r.ids
        return [out[i] for i in range(len(rows))]


ARM_CLASSES: dict[str, type[Arm]] = {"static": ChorusStatic, "continuous": ChorusContinuous,
                                     "hf_generate": HFGenerate, "hf_continuous": HFContinuous, "vllm": Vllm}


def python_for(arm: str) -> str:
    """The interpreter of an arm's worker: this one, or for vllm the venv that has it (`make venv-vllm`)."""
    import importlib.util

    if arm != "vllm" or importlib.util.find_spec("vllm") is not None:
        return sys.executable
    other = ROOT / ".venv-vllm" / "bin" / "python"
    return str(other) if other.exists() else sys.executable  # the worker then says vllm is missing


def pin_all_threads(core: int) -> None:
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})


def worker(arm_name: str, model_dir: str, core: int) -> None:
    """Load the model, pin to ``core``, then answer one JSON job per stdin line with one JSON line."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the libraries print goes to stderr, not into the replies
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from shared.models.loading import HFTokenizer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        arm = ARM_CLASSES[arm_name](model, tokenizer)
    except Exception as exc:  # noqa: BLE001 - an arm that cannot start is reported, not fatal
        reply.write(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    pin_all_threads(core)
    reply.write(json.dumps({"ready": True, "kernel_choices": getattr(arm, "choices", None),
                            "native": getattr(arm, "native", None)}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        b, prompts, lengths = job["batch"], job["prompts"], job["lengths"]
        core = job.get("core", core)
        pin_all_threads(core)
        try:
            s0 = time.perf_counter()
            state = arm.prepare(b, prompts, lengths)
            setup = time.perf_counter() - s0
            pin_all_threads(core)  # a manager's thread started in prepare inherits the pin; make sure
            c0, w0 = time.process_time(), time.perf_counter()
            rows = arm.run(state, b, prompts, lengths)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            arm.finish(state)
        except Exception as exc:  # noqa: BLE001 - the parent reports it per cell
            reply.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            continue
        short = [i for i, (r, n) in enumerate(zip(rows, lengths, strict=True)) if len(r) < n]
        reply.write(json.dumps({
            "tokens": sum(lengths), "cpu_s": cpu, "wall_s": wall, "setup_s": setup,
            "short_rows": len(short), "heads": [r[:HEADS] for r in rows],
        }) + "\n")


class Worker:
    """The parent's handle on one arm's process."""

    def __init__(self, arm: str, model_dir: Path, core: int) -> None:
        self.arm = arm
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [python_for(arm), __file__, "--worker", arm, "--model-dir", str(model_dir), "--core", str(core)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.unavailable: str | None = None

    def hello(self) -> None:
        msg = self._read()
        self.unavailable = msg.get("unavailable")
        self.kernel_choices = msg.get("kernel_choices")
        self.native = msg.get("native")

    def job(self, batch: int, prompts: list[list[int]], lengths: list[int], core: int | None = None) -> dict[str, Any]:
        self.send(batch, prompts, lengths, core)
        return self._read()

    def send(self, batch: int, prompts: list[list[int]], lengths: list[int], core: int | None = None) -> None:
        assert self.proc.stdin is not None
        job: dict[str, Any] = {"batch": batch, "prompts": prompts, "lengths": lengths}
        if core is not None:
            job["core"] = core
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.arm} worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the parent: jobs interleaved, tables, the ratio line ---------------------------------------------------
def run_lanes(jobs: list[tuple[int, str, list[list[int]], list[int], str]], workers: dict[str, Worker],
              cores: list[int], rep: int) -> list[tuple[tuple[int, str, str], dict[str, Any]]]:
    """Run ``jobs`` (batch, shape, prompts, lengths, arm) on one lane per core: each lane takes the next job
    whose arm is idle and pins it to its core, so both cores stay busy and no arm runs two jobs at once."""
    lock = threading.Condition()
    pending = list(jobs)
    busy: set[str] = set()
    out: list[tuple[tuple[int, str, str], dict[str, Any]]] = []

    def lane(core: int) -> None:
        while True:
            with lock:
                while True:
                    job = next((j for j in pending if j[4] not in busy), None)
                    if job is not None or not pending:
                        break
                    lock.wait()
                if job is None:
                    return
                pending.remove(job)
                busy.add(job[4])
            b, shape, prompts, lengths, arm = job
            job_prompts, job_lengths = workload(arm, b, prompts, lengths)
            res = workers[arm].job(b, job_prompts, job_lengths, core)
            with lock:
                busy.discard(arm)
                out.append(((b, shape, arm), res))
                lock.notify_all()

    order = cores[rep % len(cores):] + cores[: rep % len(cores)]  # which lane starts with the longest job
    threads = [threading.Thread(target=lane, args=(c,)) for c in order]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    return out


def workload(arm: str, batch: int, prompts: list[list[int]], lengths: list[int]) -> tuple[list[list[int]], list[int]]:
    """What ``arm`` runs of a cell's queue: a static-like arm the first batch-worth (rows cannot join its
    batches, so more batch-worths of the same make only more chunks of the same shape and rate), the others
    the whole queue."""
    if arm in STATIC_LIKE:
        n = max(batch, 2)
        return prompts[:n], lengths[:n]
    return prompts, lengths

def median_ratio(results: dict[str, list[dict[str, Any]]], a: str, b: str) -> float | None:
    """Median over repeats of arm a's tokens per CPU-second over arm b's, in the same repeat."""
    pairs = [(x, y) for x, y in zip(results.get(a, []), results.get(b, []), strict=False)
             if "cpu_s" in x and "cpu_s" in y]
    if not pairs:
        return None
    return statistics.median((x["tokens"] / x["cpu_s"]) / (y["tokens"] / y["cpu_s"]) for x, y in pairs)


def agreement(mine: dict[str, Any], static: dict[str, Any] | None) -> str:
    if static is None or "heads" not in static or "heads" not in mine:
        return "-"
    pairs = list(zip(mine["heads"], static["heads"], strict=False))  # static-like arms run the first rows
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def print_cell(batch: int, shape: str, n: int, lengths: list[int], arms: list[str],
               results: dict[str, list[dict[str, Any]]], unavailable: dict[str, str]) -> None:
    print(f"\nB={batch} {shape}: {n} requests, {sum(lengths)} target tokens "
          f"(rows {min(lengths)}..{max(lengths)}, mean {sum(lengths) / n:.1f})")
    print(f"  {'arm':<14}{'tokens':>7}{'CPU s':>9}{'tok/CPU-s':>11}{'min..max':>15}{'vs static':>11}"
          f"{'wall s':>8}  same start")
    for arm in arms:
        if arm in unavailable:
            print(f"  {arm:<14}unavailable: {unavailable[arm]}")
            continue
        runs = results.get(arm, [])
        errors = [r["error"] for r in runs if "error" in r]
        ok = [r for r in runs if "cpu_s" in r]
        if not ok:
            print(f"  {arm:<14}failed: {errors[0] if errors else 'no result'}")
            continue
        rates = [r["tokens"] / r["cpu_s"] for r in ok]
        short = sum(r["short_rows"] for r in ok)
        vs = median_ratio(results, arm, "static")
        static_last = results.get("static", [{}])[-1] if results.get("static") else None
        print(f"  {arm:<14}{ok[0]['tokens']:>7}{statistics.median(r['cpu_s'] for r in ok):>9.2f}"
              f"{statistics.median(rates):>11.1f}{f'{min(rates):.1f}..{max(rates):.1f}':>15}"
              f"{(f'{vs:.2f}x' if vs is not None else '-'):>11}"
              f"{statistics.median(r['wall_s'] for r in ok):>8.1f}  {agreement(ok[-1], static_last)}"
              + (f"  ({short} rows short!)" if short else "")
              + (f"  ({len(errors)} failed: {errors[0]})" if errors else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,8,32", help="comma-separated max_batch values")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--depth", type=int, default=3, help="batch-worths in the queue of the arms whose rows join (> 1)")
    p.add_argument("--equal", type=int, default=12, help="output tokens of every row, equal shape")
    p.add_argument("--long", type=int, default=256, help="the long row of each batch-worth, longtail shape "
                   f"(at most max(16, {TAIL_PER_ROW} x the batch))")
    p.add_argument("--short-max", type=int, default=SHORT_MAX, help="cap of the Pareto rows, longtail shape")
    p.add_argument("--core", type=int, default=None, help="the core of every arm (default: the last)")
    p.add_argument("--one-core", action="store_true", help="every arm on one core, one at a time (twice as long)")
    p.add_argument("--quick", action="store_true", help="1 repeat, --equal 8 --long 32 --short-max 16")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    core = a.core if a.core is not None else max(os.sched_getaffinity(0))
    if a.worker:
        worker(a.worker, a.model_dir, core)
        return
    if a.quick:
        a.repeats, a.equal, a.long, a.short_max, a.depth = 1, 8, 32, 16, 2
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    arms = [s.strip() for s in a.arms.split(",") if s.strip()]
    if any(s not in SHAPES for s in shapes) or any(x not in ARMS for x in arms) or not arms or not batches:
        p.error(f"--shapes from {','.join(SHAPES)}, --arms from {','.join(ARMS)}, --batches not empty")
    if a.depth < 2 or a.repeats < 1 or min(batches) < 1:
        p.error("--depth must be at least 2 (rows can only join from a deeper queue), --repeats and batches >= 1")
    cores = sorted(os.sched_getaffinity(0))
    pair_cores = [core] if a.one_core or len(cores) < 2 else [c for c in cores if c != core][-1:] + [core]

    from transformers import AutoTokenizer

    from shared.models.loading import HFTokenizer, smollm2_dir

    started = time.perf_counter()
    cfg = demo_config()
    model_dir = smollm2_dir(cache_dir(cfg))
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(model_dir)))
    cells = []
    for b in batches:
        n = a.depth * max(b, 2)
        prompts = prompts_for(cfg, tokenizer, n, seed=b)
        for shape in shapes:
            long = min(a.long, max(16, TAIL_PER_ROW * b))
            # equal rows leave no tail to fill: two batch-worths show the joining arms as well as more would
            q = prompts if shape == "longtail" else prompts[: min(n, 2 * max(b, 2))]
            cells.append((b, shape, q, lengths_for(b, shape, len(q), a.equal, long, a.short_max, seed=0)))
    where = (f"on two lanes, each job pinned to its lane's core ({pair_cores[0]} or {pair_cores[1]})"
             if len(pair_cores) == 2 else f"one at a time, all pinned to core {core}")
    print(f"SmolLM2-135M-Instruct float32, {len(arms)} arms {where}, 1 torch thread each; "
          f"{a.repeats} repeats of {len(cells)} cells; load average {os.getloadavg()[0]:.1f}", flush=True)
    workers = {arm: Worker(arm, model_dir, core) for arm in arms}
    results: dict[tuple[int, str], dict[str, list[dict[str, Any]]]] = {(b, s): {} for b, s, _, _ in cells}
    unavailable: dict[str, str] = {}
    try:
        for w in workers.values():
            w.hello()
            if w.unavailable:
                unavailable[w.arm] = w.unavailable
                print(f"  {w.arm}: unavailable ({w.unavailable})", flush=True)
            if w.kernel_choices:
                print(f"  kernel choices of the {w.arm} engine on this CPU (t:method for t rows, @n padded to n rows;"
                      " rows: Chorus's own kernel):")
                if w.native:
                    print(f"    Chorus's own kernel is not a candidate here: {w.native}")
                for shape, plan in w.kernel_choices.items():
                    print(f"    {shape:<34}{plan}", flush=True)
        live = [arm for arm in arms if arm not in unavailable]
        warm_prompts = prompts_for(cfg, tokenizer, 2, seed=-1)
        for arm in live:  # first-call costs (allocator, lazy imports) outside every measurement
            workers[arm].job(2, warm_prompts, [4, 2])
        print(f"  models loaded and warm in {time.perf_counter() - started:.0f} s", flush=True)
        cost: dict[tuple[int, str, str], float] = {}  # (batch, shape, arm) -> wall seconds of the last repeat
        for rep in range(a.repeats):
            t0 = time.perf_counter()
            jobs = [(b, shape, prompts, lengths, arm) for b, shape, prompts, lengths in cells for arm in live]
            # longest first (the first repeat guesses from the tokens an arm runs), so the cores end together
            jobs.sort(key=lambda j: -cost.get((j[0], j[1], j[4]), sum(workload(j[4], j[0], j[2], j[3])[1])))
            done = run_lanes(jobs, workers, pair_cores, rep)
            for (b, shape, arm), res in done:
                results[(b, shape)].setdefault(arm, []).append(res)
                if "wall_s" in res:
                    cost[(b, shape, arm)] = res["wall_s"]
            print(f"  repeat {rep + 1}/{a.repeats}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        for w in workers.values():
            w.close()
    every = [r for cell in results.values() for runs in cell.values() for r in runs]
    cpu_total = sum(r.get("cpu_s", 0.0) for r in every)
    setup_total = sum(r.get("setup_s", 0.0) for r in every)
    for b, shape, prompts, lengths in cells:
        print_cell(b, shape, len(prompts), lengths, arms, results[(b, shape)], unavailable)
    print(f"\ntotal {time.perf_counter() - started:.0f} s wall: {cpu_total:.0f} s of measured CPU, "
          f"{setup_total:.0f} s of engine set-up (unmeasured); load average {os.getloadavg()[0]:.1f} "
          "(other processes on the core stretch wall time, not the CPU time measured)")
    key = (32, "longtail")
    cell = results.get(key, {})

    def fmt(other: str) -> str:
        r = median_ratio(cell, "continuous", other)
        return "n/a" if r is None else f"{r:.2f}"

    print(f"ratio continuous_vs_static={fmt('static')} vs_hf_generate={fmt('hf_generate')} "
          f"vs_hf_continuous={fmt('hf_continuous')}")
    print(f"ratio chorus_vs_vllm={fmt('vllm')}")


if __name__ == "__main__":
    main()
