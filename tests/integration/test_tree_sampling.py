"""Tree-structured sampling through the real services: coordinator, rollouters of two tiny models, actions and
mq against a real nats-server. Every agent step is a group of G candidates that reaches the trainer's ready
stream whole, with the episode's AT-GRPO advantages, and the episode goes on from one candidate per step."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from services.actions.actions import score_answer
from services.actions.service import ActionsService
from services.coordinator.service import CoordinatorService
from services.coordinator.workflows import verifier_prompt
from services.coordinator.workflows.api import best_of
from services.mq.service import MqService
from services.rollouter.service import RollouterService
from shared.kernel.bus import pull_consumer
from shared.kernel.codec import decode
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import MicroBatch, Sample
from shared.kernel.subjects import Names
from shared.models.tokenizer import ByteTokenizer
from shared.rlmath.advantages import group_advantages

G = 3
TOK = ByteTokenizer()
MODELS = {"solver_lm": ("solver", 0), "verifier_lm": ("verifier", 1)}  # model -> (agent, turn)


def write_config(tmp_path: Path, run_id: str) -> ChorusConfig:
    arch = "arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: 64}, " \
           "rollouter: {request_timeout_s: 20.0, batch_window_ms: 5.0}"
    p = tmp_path / "tree.yaml"
    p.write_text(f"""
run: {{id: {run_id}, dir: {tmp_path}, seed: 7}}
models: {{solver_lm: {{{arch}}}, verifier_lm: {{{arch}}}}}
agents:
  solver: {{model: solver_lm}}
  verifier: {{model: verifier_lm, prompt: "check:"}}
workflow: {{concurrency: 1, group_size: {G}, max_new_tokens: 3, temperature: 1.0, sampling: tree}}
task: {{max_operand: 4, ops: ["+"], modulo: 10}}
train: {{max_versions: 100, global_batch: {2 * G}, micro_batch: {G}}}
mq: {{report_interval_s: 0.1}}
actions: {{cores: 1, timeout_s: 2.0, memory_mb: 256}}
metrics_interval_s: 0.5
""")
    return load_config(p)


async def started(svc: Any, ready: Callable[[], Awaitable[bool]]) -> tuple[Any, asyncio.Task[int]]:
    """Serve ``svc`` in this loop; return once ``ready()`` says it is up."""
    task = asyncio.create_task(svc.serve())
    for _ in range(1200):
        if task.done():
            raise AssertionError(f"{svc.name} exited with {task.result()}")
        if await ready():
            return svc, task
        await asyncio.sleep(0.05)
    raise AssertionError(f"{svc.name} did not start")


async def has(svc: Any, attr: str) -> bool:
    return getattr(svc, attr, None) is not None


async def is_ready(svc: Any) -> bool:
    return bool(getattr(svc, "ready", False))


async def routing(svc: Any) -> bool:
    return bool(svc.routing)


async def micro_batches(sub: Any, want: int, timeout_s: float = 90) -> list[MicroBatch]:
    got: list[MicroBatch] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        try:
            msgs = await sub.fetch(want - len(got), timeout=1)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        for m in msgs:
            got.append(decode(MicroBatch, m.data))
            await m.ack()
    return got


async def test_tree_sampled_steps_reach_the_trainer_as_whole_groups_with_one_continuation(
        nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, run_id)
    names = Names(run_id)
    running: list[tuple[Any, asyncio.Task[int]]] = []
    nc = await nats.connect(nats_url)
    try:
        actions = ActionsService(cfg, nats_url=nats_url)
        running.append(await started(actions, lambda: is_ready(actions)))
        for model in MODELS:
            svc = RollouterService(cfg, nats_url=nats_url, instance="0", model=model)
            running.append(await started(svc, lambda svc=svc: routing(svc)))
            mq = MqService(cfg, nats_url=nats_url, model=model)
            running.append(await started(mq, lambda mq=mq: has(mq, "sub")))
        js = nc.jetstream()
        subs = {m: await pull_consumer(js, stream=names.ready_stream(m), subject=names.ready(m), durable=f"tr_{m}",
                                       ack_wait_s=30, max_ack_pending=1000) for m in MODELS}
        coord = CoordinatorService(cfg, nats_url=nats_url)
        running.append(await started(coord, lambda: is_ready(coord)))
        # Two tasks: micro_batch = G, so each micro-batch holds one step's group.
        got = {m: await micro_batches(subs[m], 2) for m in MODELS}
    finally:
        for svc, task in reversed(running):
            svc.stop()
            assert await asyncio.wait_for(task, 40) == 0
        await nc.close()

    assert all(len(b) == 2 for b in got.values()), (dict(coord.counters), {m: len(b) for m, b in got.items()})
    steps: dict[str, dict[int, list[Sample]]] = defaultdict(dict)  # task -> turn -> the step's candidates
    for model, batches in got.items():
        agent, turn = MODELS[model]
        for mb in batches:
            samples = sorted(mb.samples, key=lambda s: s.rollout_idx)
            task_id = samples[0].group_key.split(":")[0]
            # One whole group of G candidates of one (env, agent, turn), ids {task}_{turn}_{candidate}.
            assert {s.group_key for s in samples} == {f"{task_id}:{agent}:{turn}"}
            assert [s.sample_id for s in samples] == [f"{task_id}_{turn}_{c}" for c in range(G)]
            assert all((s.model, s.agent, s.turn, s.group_size) == (model, agent, turn, G) for s in samples)
            # The candidates of a step answered one prompt; the coordinator set their GRPO advantages.
            assert len({tuple(s.prompt_ids.tolist()) for s in samples}) == 1
            expected = group_advantages([s.reward for s in samples], [s.group_key for s in samples])
            assert [s.advantage for s in samples] == pytest.approx(expected.tolist(), abs=1e-9)
            steps[task_id][turn] = samples
    assert coord.counters["groups_incomplete_dropped"] == 0 and coord.counters["tasks_done"] >= 2
    both = [t for t, by_turn in steps.items() if set(by_turn) == {0, 1}]
    assert both, f"no task with both steps dispatched: {sorted(steps)}"
    for task_id in both:
        solver, verifier = steps[task_id][0], steps[task_id][1]
        question = TOK.decode(solver[0].prompt_ids.tolist())  # the solver has no system prompt
        a, b = (int(x) for x in question.rstrip("=").split("+"))
        texts = [TOK.decode(s.response_ids.tolist()) for s in solver]
        # Each candidate earned the check of its own answer (the actions service ran it).
        assert [s.reward for s in solver] == pytest.approx([score_answer(str((a + b) % 10), t)["reward"]
                                                            for t in texts])
        # The verifier went on from the best solver candidate only (ties to the lowest index).
        best = texts[best_of([s.reward for s in solver])]
        assert verifier[0].prompt_ids.tolist() == TOK.encode("check:" + verifier_prompt("", question, best))
