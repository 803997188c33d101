"""`chorus eval`: a model (the base of a config, or a run's version N or best) played on a dataset's held-out or
test split without training, in this one process: Chorus's own engine generates in a worker thread, the actions
registry scores in worker processes, and the coordinator's evaluation code computes pass@1, pass@k and maj@k as
in a run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.kernel.config import ChorusConfig


class EvalError(ValueError):
    """What the user asked for cannot be evaluated (no such split, version or model)."""


def _act_one(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    from services.actions.actions import REGISTRY

    try:
        return REGISTRY[kind](payload)
    except Exception as exc:  # noqa: BLE001 - a failing check scores 0, as a row error does in a run
        return {"error": f"{type(exc).__name__}: {exc}", "reward": 0.0, "correct": False}


@dataclass
class Batcher:
    """Generation requests of concurrent episodes, run together: one engine call per model for everything waiting
    (up to ``max_rows``), in a worker thread."""

    engines: dict[str, Any]
    eos: dict[str, int]
    versions: dict[str, int]
    max_rows: int
    tokens: int = 0
    on_tokens: Callable[[int], None] | None = None
    _queue: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    _running: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def __call__(self, model: str, adapter: str | None, prompts: list[list[int]], *, max_new_tokens: int,
                       temperature: float, top_p: float, stop: list[str] | None = None) -> list[Any]:
        from services.rollouter.engine import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                stop_ids=(self.eos[model],), stop=tuple(stop or ()))
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queue.setdefault(model, []).append((prompts, params, adapter, fut))
        if model not in self._running or self._running[model].done():
            self._running[model] = asyncio.create_task(self._drain(model))
        return await fut

    async def _drain(self, model: str) -> None:
        from services.coordinator.workflows import GenResult

        await asyncio.sleep(0.005)  # let the other episodes of this moment queue their rows too
        while self._queue.get(model):
            waiting = self._queue[model]
            take: list[Any] = []
            rows = 0
            while waiting and (not take or rows + len(waiting[0][0]) <= self.max_rows):
                req = waiting.pop(0)
                take.append(req)
                rows += len(req[0])
            prompts = [p for req in take for p in req[0]]
            params = [req[1] for req in take for _ in req[0]]
            adapters = [req[2] for req in take for _ in req[0]]
            t0 = time.monotonic()
            try:
                out = await asyncio.to_thread(self.engines[model].generate, prompts, params, adapters)
            except Exception as exc:  # noqa: BLE001 - every waiting episode hears of it
                for req in take:
                    if not req[3].done():
                        req[3].set_exception(exc)
                continue
            seconds = time.monotonic() - t0
            i = 0
            for req in take:
                rows_out = [GenResult(ids=list(o.ids), logprobs=list(o.logprobs), finished=o.finish == "stop",
                                      version=self.versions[model], seconds=seconds) for o in out[i:i + len(req[0])]]
                i += len(req[0])
                self.tokens += sum(len(r.ids) for r in rows_out)
                if not req[3].done():
                    req[3].set_result(rows_out)
            if self.on_tokens is not None:
                self.on_tokens(self.tokens)


def eval_settings(cfg: ChorusConfig, *, samples: int | None, temperature: float | None,
                  pass_k: list[int] | None, max_new_tokens: int | None) -> ChorusConfig:
    """``cfg`` with the command's eval settings, validated by the config's own models (a clear error when wrong)."""
    from shared.kernel.config import EvalSection, WorkflowConfig

    ev = cfg.eval.model_dump()
    if samples is not None:
        ev["samples"] = samples
    if temperature is not None:
        ev["temperature"] = temperature
    if pass_k:
        ev["pass_k"] = pass_k
    eval_section = EvalSection(**ev)
    wf = cfg.workflow
    if max_new_tokens is not None:
        wf = WorkflowConfig(**{**wf.model_dump(), "max_new_tokens": max_new_tokens})
    return cfg.model_copy(update={"eval": eval_section, "workflow": wf})


def eval_tasks(cfg: ChorusConfig, split: str, n: int | None, offset: int = 0) -> list[Any]:
    from services.coordinator.datasets import dataset_split
    from services.coordinator.tasks import heldout_tasks

    if split == "heldout":
        count = cfg.eval.tasks if n is None else n
        task = cfg.task
        if task.heldout < count:
            if task.name in ("jsonl", "verl", "gsm8k", "humaneval", "reasoning_gym"):
                raise EvalError(f"--split heldout: task.heldout is {task.heldout}, fewer than the {count} tasks asked "
                                "for (--tasks N, raise task.heldout, or --split test)")
            # procedural tasks: the held-out seed space, which a run trained with task.heldout < N did not leave out
            task = task.model_copy(update={"heldout": count})
        return heldout_tasks(task, count, cfg.run.seed)
    if split != "test":
        raise EvalError(f"--split {split!r}: expected heldout or test")
    if cfg.task.name in ("arithmetic", "word", "code"):
        raise EvalError(f"--split test: task {cfg.task.name!r} is procedural and has no test split; its held-out "
                        "tasks are --split heldout")
    try:
        tasks = dataset_split(cfg.task, "test", cfg.run.seed)
    except (ValueError, AssertionError) as exc:
        raise EvalError(f"--split test: {exc}") from None
    tasks = tasks[offset:]
    return tasks if n is None else tasks[:n]


def load_nets(cfg: ChorusConfig, run_dir: Path | None, version: str) -> tuple[dict[str, Any], dict[str, int]]:
    """Every model's network: the base (``version`` "base", or a config) or the run's checkpoint N / best."""
    from shared.models.export import ExportError, load_checkpoint, pick_best, pick_checkpoint
    from shared.models.loading import load_model

    nets: dict[str, Any] = {}
    versions: dict[str, int] = {}
    for model in sorted(cfg.models):
        if run_dir is None or version == "base":
            nets[model], versions[model] = load_model(cfg, model, "cpu"), 0
            continue
        try:
            if version == "best":
                v, path = pick_best(run_dir, cfg, model)
            else:
                v, path = pick_checkpoint(run_dir, cfg, model, None if version == "last" else int(version))
        except (ExportError, ValueError) as exc:
            raise EvalError(str(exc)) from None
        nets[model], versions[model] = load_checkpoint(cfg, model, path), v
    return nets, versions


async def run_eval(cfg: ChorusConfig, tasks: list[Any], nets: dict[str, Any], versions: dict[str, int], *,
                   batch: int, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """evaluate() of the coordinator on ``tasks`` with in-process generation and actions; its record plus the
    generated tokens and the wall time."""
    from services.coordinator.evaluation import evaluate
    from services.coordinator.workflows import Tokenizers, workflow_of
    from services.rollouter.backends import chorus_engine
    from shared.models.loading import load_tokenizer

    toks = {m: await asyncio.to_thread(load_tokenizer, cfg, m) for m in nets}
    engines = {m: chorus_engine(cfg, m, nets[m], toks[m], seed=cfg.run.seed, fallbacks=[]) for m in nets}
    tokens_seen = [0]
    gen = Batcher(engines, {m: t.eos_id for m, t in toks.items()}, versions, max_rows=max(batch, 1) * max(cfg.eval.samples, 1),
                  on_tokens=lambda n: tokens_seen.__setitem__(0, n))
    done = [0]
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=max(1, cfg.actions.cores))
    loop = asyncio.get_running_loop()

    async def act(kind: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(loop.run_in_executor(pool, _act_one, kind, p) for p in payloads)))

    async def on_episode(_: Any) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], tokens_seen[0])

    t0 = time.monotonic()
    try:
        record = await evaluate(cfg, tasks, workflow_of(cfg), gen, act, lambda: dict(versions),
                                Tokenizers(cfg, toks), on_episode=on_episode, concurrency=batch)
    finally:
        pool.shutdown(cancel_futures=True)
    record["tokens_total"] = gen.tokens
    record["seconds"] = round(time.monotonic() - t0, 3)
    record["tokens_per_s"] = round(gen.tokens / max(record["seconds"], 1e-9), 1)
    return record


def write_record(out: Path, record: dict[str, Any]) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out
