"""The coordinator against a real nats-server, a real ActionsService and a stand-in rollouter that runs
the real tiny model (sampled decoding written here: the rollouter service is tested on its own)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
import torch
from nats.aio.msg import Msg

from services.actions.service import ActionsService
from services.coordinator.service import CoordinatorService
from shared.kernel.bus import kv_put_int_max, pull_consumer
from shared.kernel.codec import decode, encode, encode_json
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import Array, DepthReport, GenOutput, GenRequest, GenResponse, Sample
from shared.kernel.subjects import Names
from shared.models.modeling import build_model
from shared.models.tokenizer import EOS_ID, ByteTokenizer
from tests.waits import wait_until

MODELS = ("solver_lm", "verifier_lm")
G = 4


def write_config(tmp_path, run_id: str, max_versions: int = 100) -> ChorusConfig:
    arch = "{arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: 64}, " \
           "rollouter: {request_timeout_s: 5.0}}"
    p = tmp_path / "c.yaml"
    p.write_text(f"""
run: {{id: {run_id}, dir: {tmp_path}, seed: 3}}
models: {{solver_lm: {arch}, verifier_lm: {arch}}}
agents:
  solver: {{model: solver_lm}}
  verifier: {{model: verifier_lm, prompt: "check:"}}
workflow: {{concurrency: 2, group_size: {G}, max_new_tokens: 3, temperature: 1.0}}
task: {{max_operand: 4, ops: ["+"], modulo: 10}}
train: {{max_versions: {max_versions}, global_batch: 8, micro_batch: 8}}
mq: {{report_interval_s: 0.1}}
actions: {{cores: 1, timeout_s: 2.0, memory_mb: 256}}
metrics_interval_s: 0.5
""")
    return load_config(p)


@dataclass
class StandInRollouter:
    """Answers GenRequest on ``gen(model)`` with sampled tokens and their log-probs from the tiny model."""

    cfg: ChorusConfig
    model: str
    version: int
    fail_first: int = 0
    requests: int = 0
    net: torch.nn.Module = field(init=False)

    def __post_init__(self) -> None:
        self.net = build_model(self.cfg, self.model).eval()

    def generate(self, req: GenRequest) -> list[GenOutput]:
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(self.requests)
        outs = []
        with torch.no_grad():
            for prompt in req.prompts:
                ids = [int(i) for i in prompt.tolist()]
                new, logps = [], []
                for _ in range(req.max_new_tokens):
                    logits = self.net(torch.tensor([ids])).logits[0, -1] / max(req.temperature, 1e-5)
                    logp = torch.log_softmax(logits, -1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    ids.append(tok)
                    new.append(tok)
                    logps.append(float(logp[tok]))
                    if tok in req.stop_ids:
                        break
                finish = "stop" if new[-1] in req.stop_ids else "length"
                outs.append(GenOutput(ids=Array.of(new, "int32"), logprobs=Array.of(logps, "float32"), finish=finish))
        return outs

    async def handle(self, msg: Msg) -> None:
        req = decode(GenRequest, msg.data)
        self.requests += 1
        if self.requests <= self.fail_first:
            await msg.respond(encode(GenResponse(request_id=req.request_id, error="warming up")))
            return
        outs = await asyncio.to_thread(self.generate, req)
        await msg.respond(encode(GenResponse(request_id=req.request_id, outputs=outs, version=self.version)))


async def start(svc) -> asyncio.Task[int]:
    task = asyncio.create_task(svc.serve())
    await wait_until(lambda: getattr(svc, "ready", False) or task.done(), f"{svc.name} started")
    assert not task.done(), f"{svc.name} exited with {task.result()}"
    return task


@pytest.fixture
async def cluster(nats_url: str, run_id: str, tmp_path) -> AsyncIterator[dict]:
    cfg = write_config(tmp_path, run_id)
    names = Names(run_id)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    actions = ActionsService(cfg, nats_url=nats_url)
    actions_task = await start(actions)
    kv = actions.kv
    await kv_put_int_max(kv, names.version_key("solver_lm"), 2)
    await kv_put_int_max(kv, names.version_key("verifier_lm"), 5)
    stand_ins = {"solver_lm": StandInRollouter(cfg, "solver_lm", 2, fail_first=1),
                 "verifier_lm": StandInRollouter(cfg, "verifier_lm", 5)}
    for m, s in stand_ins.items():
        await nc.subscribe(names.gen(m), queue="rollouter", cb=s.handle)
    subs = {m: await pull_consumer(js, stream=names.traj_stream(m), subject=names.traj(m), durable=f"t_{m}",
                                   ack_wait_s=30, max_ack_pending=10_000) for m in MODELS}
    coord = CoordinatorService(cfg, nats_url=nats_url)
    coord_task = await start(coord)
    yield {"cfg": cfg, "names": names, "nc": nc, "kv": kv, "subs": subs, "coord": coord, "stand_ins": stand_ins,
           "coord_task": coord_task}
    coord.stop()
    assert await asyncio.wait_for(coord_task, 40) == 0
    actions.stop()
    assert await asyncio.wait_for(actions_task, 30) == 0
    await nc.close()


async def drain(sub, want: int, timeout_s: float = 60) -> list[Msg]:
    got: list[Msg] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        try:
            got += await sub.fetch(want - len(got), timeout=1)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
    for m in got:
        await m.ack()
    return got


async def test_samples_of_both_agents_reach_their_models_streams(cluster: dict):
    names, subs, coord = cluster["names"], cluster["subs"], cluster["coord"]
    msgs = {m: await drain(subs[m], 2 * G) for m in MODELS}
    for m in MODELS:
        assert len(msgs[m]) == 2 * G, f"{m}: {len(msgs[m])} samples, counters {dict(coord.counters)}"
    for model, turn, agent, version in (("solver_lm", 0, "solver", 2), ("verifier_lm", 1, "verifier", 5)):
        samples = [decode(Sample, msg.data) for msg in msgs[model]]
        for msg, s in zip(msgs[model], samples, strict=True):
            assert msg.headers["Nats-Msg-Id"] == s.sample_id
            task_id = s.group_key.split(":")[0]
            assert s.group_key == f"{task_id}:{agent}:{turn}"
            assert s.sample_id == Sample.make_id(task_id, turn, s.rollout_idx)
            assert s.episode == f"{task_id}/{s.rollout_idx}"
            assert (s.model, s.agent, s.turn, s.group_size, s.run) == (model, agent, turn, G, names.run)
            assert s.version == version and s.versions == {"solver_lm": 2, "verifier_lm": 5}
            assert 0.0 <= s.reward <= 1.0
            assert len(s.response_ids) == len(s.behavior_logprobs) >= 1
            assert all(lp <= 0.0 for lp in s.behavior_logprobs.tolist())
            assert s.prompt_ids.tolist()[0] == 257  # BOS
            assert s.response_ids.tolist()[-1] == EOS_ID or len(s.response_ids) == 3
        # Whole groups: every task contributes exactly G rollouts 0..G-1.
        by_group: dict[str, list[int]] = {}
        for s in samples:
            by_group.setdefault(s.group_key, []).append(s.rollout_idx)
        first = sorted(by_group)[0]
        assert sorted(by_group[first]) == list(range(G))
    # The stand-in's first reply was an error: the coordinator retried rather than dropping the task.
    assert coord.counters["gen_error_replies"] >= 1
    # counted once the stream acknowledged them, which can be after the consumer above read them
    await wait_until(lambda: coord.counters["samples_published"] >= 4 * G, "the samples read counted as published")
    snap = coord.metrics_snapshot()
    assert set(snap["reward_ema"]) == {"solver", "verifier"} and 0.0 <= snap["final_correct_ema"] <= 1.0


async def test_full_mqs_stop_new_tasks_until_the_backlogs_drain(cluster: dict):
    names, nc, coord = cluster["names"], cluster["nc"], cluster["coord"]
    await drain(cluster["subs"]["solver_lm"], 2 * G)
    stop_reporting = asyncio.Event()
    # trained version of each model's reports (at least the version served: a report taken before the served
    # version was trained is outdated); the verifier's trainer steps until it is frozen
    trained = {"solver_lm": 2, "verifier_lm": 5}
    reporting = {"verifier_lm"}

    async def report() -> None:
        while not stop_reporting.is_set():
            for m in sorted(reporting):
                await nc.publish(names.depth(m), encode_json(
                    DepthReport(model=m, depth=64, capacity=64, trained_version=trained[m])))
            await asyncio.sleep(0.1)

    async def until(cond, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    reporter = asyncio.create_task(report())
    try:
        # One model full while its trainer steps (a slow trainer): every task feeds it, so pacing holds back
        # every task until it has room; tasks already in flight finish.
        for v in range(1, 5):
            await asyncio.sleep(0.25)
            trained["verifier_lm"] = 5 + v
        await until(lambda: coord.in_flight == 0, 60)
        started = coord.counters["tasks_started"]
        await asyncio.sleep(1.0)
        assert coord.counters["tasks_started"] == started
        pacing = coord.metrics_snapshot()["pacing"]
        assert pacing["held_by"] == ["verifier_lm"] and pacing["capacity"]["verifier_lm"] < 0, pacing
        assert coord.counters["tasks_paced"] >= 1
        # Its trainer makes no new version (stopped): after max(5 s, 4 steps) it paces no more, its mq sheds,
        # and the other model's training is not held back.
        await until(lambda: coord.counters["tasks_started"] > started, 60)
        assert coord.counters["tasks_started"] > started
        snap = coord.metrics_snapshot()
        assert snap["pacing"]["stuck"] == ["verifier_lm"] and snap["backpressured"] == ["verifier_lm"]
        # Every model full: tasks already in flight finish, then nothing new starts.
        reporting.add("solver_lm")
        await asyncio.sleep(0.3)
        await until(lambda: coord.in_flight == 0, 60)
        started = coord.counters["tasks_started"]
        await asyncio.sleep(1.5)
        assert coord.counters["tasks_started"] == started
        assert coord.counters["backpressure_waits"] >= 1
        assert coord.metrics_snapshot()["backpressured"] == ["solver_lm", "verifier_lm"]
    finally:
        stop_reporting.set()
        await reporter
    for m in MODELS:
        await nc.publish(names.depth(m), encode_json(
            DepthReport(model=m, depth=3, capacity=64, trained_version=trained[m])))
    await until(lambda: coord.counters["tasks_started"] > started, 60)
    assert coord.counters["tasks_started"] > started


async def test_no_new_tasks_once_every_model_trained_max_versions(cluster: dict):
    names, kv, coord = cluster["names"], cluster["kv"], cluster["coord"]
    await kv_put_int_max(kv, names.trained_key("solver_lm"), 100)
    await asyncio.sleep(0.5)
    assert coord.counters["tasks_started"] > 0 or coord.in_flight > 0
    await kv_put_int_max(kv, names.trained_key("verifier_lm"), 100)
    await wait_until(lambda: coord.in_flight == 0 and not coord.metrics_snapshot()["admitting"],
                     "the coordinator idle")
    started = coord.counters["tasks_started"]
    await asyncio.sleep(1.0)
    assert coord.counters["tasks_started"] == started
    assert not coord.stopping  # idle, not exited: it waits for SIGTERM


async def test_malformed_depth_report_goes_to_the_dlq(cluster: dict):
    names, nc, coord = cluster["names"], cluster["nc"], cluster["coord"]
    dlq = await nc.subscribe(names.dlq("coordinator"))
    await nc.publish(names.depth("solver_lm"), b"{not json")
    entry = await dlq.next_msg(timeout=3)
    assert "DepthReport" in entry.headers["Chorus-Reason"]
    assert coord.counters["dlq"] == 1


# --- a debate through real rollouters -------------------------------------------------------------------------
DEBATE_G = 2
DEBATE_TURNS = {0: "a", 1: "b", 2: "c", 3: "a", 4: "b", 5: "c"}  # 3 agents x 2 rounds


def write_debate_config(tmp_path, run_id: str) -> ChorusConfig:
    arch = "arch: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: 96}, " \
           "rollouter: {request_timeout_s: 20.0, batch_window_ms: 5.0}"
    p = tmp_path / "debate.yaml"
    p.write_text(f"""
run: {{id: {run_id}, dir: {tmp_path}, seed: 5}}
models: {{debate_lm: {{{arch}}}, critic_lm: {{{arch}, lora: {{r: 2}}}}}}
agents:
  a: {{model: debate_lm, prompt: "A:"}}
  b: {{model: debate_lm, prompt: "B:"}}
  c: {{model: critic_lm, adapter: cx, prompt: "C:"}}
workflow: {{name: debate, agents: [a, b, c], rounds: 2, concurrency: 1, group_size: {DEBATE_G}, max_new_tokens: 3,
           echo_chars: 4}}
task: {{max_operand: 4, ops: ["+"], modulo: 10}}
train: {{max_versions: 100, global_batch: 4, micro_batch: 4}}
mq: {{report_interval_s: 0.1}}
actions: {{cores: 1, timeout_s: 2.0, memory_mb: 256}}
metrics_interval_s: 0.5
""")
    return load_config(p)


async def test_a_debate_through_real_rollouters_publishes_whole_groups_of_every_agent_turn(
        nats_url: str, run_id: str, tmp_path) -> None:
    from services.rollouter.service import RollouterService

    cfg = write_debate_config(tmp_path, run_id)
    names = Names(run_id)
    actions = ActionsService(cfg, nats_url=nats_url)
    running = [(actions, await start(actions))]
    nc = await nats.connect(nats_url)
    try:
        for model in ("debate_lm", "critic_lm"):
            svc = RollouterService(cfg, nats_url=nats_url, instance="0", model=model)
            task = asyncio.create_task(svc.serve())
            running.append((svc, task))
            for _ in range(1200):
                if task.done():
                    raise AssertionError(f"rollouter {model} exited with {task.result()}")
                if svc.routing:  # registered and serving
                    break
                await asyncio.sleep(0.05)
        js = nc.jetstream()
        subs = {m: await pull_consumer(js, stream=names.traj_stream(m), subject=names.traj(m), durable=f"d_{m}",
                                       ack_wait_s=30, max_ack_pending=10_000) for m in ("debate_lm", "critic_lm")}
        coord = CoordinatorService(cfg, nats_url=nats_url)
        running.append((coord, await start(coord)))
        # One task: a and b take turns 0, 1, 3, 4 on debate_lm; c takes turns 2 and 5 on critic_lm.
        got = {"debate_lm": await drain(subs["debate_lm"], 4 * DEBATE_G),
               "critic_lm": await drain(subs["critic_lm"], 2 * DEBATE_G)}
    finally:
        for svc, task in reversed(running):
            svc.stop()
            assert await asyncio.wait_for(task, 40) == 0
        await nc.close()

    samples = [decode(Sample, m.data) for msgs in got.values() for m in msgs]
    assert len(got["debate_lm"]) == 4 * DEBATE_G and len(got["critic_lm"]) == 2 * DEBATE_G, dict(coord.counters)
    task_id = samples[0].group_key.split(":")[0]
    groups: dict[str, list[int]] = {}
    for model, msgs in got.items():
        for msg in msgs:
            s = decode(Sample, msg.data)
            assert s.model == model and msg.headers["Nats-Msg-Id"] == s.sample_id
            assert s.agent == DEBATE_TURNS[s.turn] and s.group_key == f"{task_id}:{s.agent}:{s.turn}"
            assert s.sample_id == f"{task_id}_{s.turn}_{s.rollout_idx}" and s.group_size == DEBATE_G
            assert s.adapter == ("cx" if s.agent == "c" else None)
            assert 0.0 <= s.reward <= 1.0 and len(s.response_ids) == len(s.behavior_logprobs) >= 1
            groups.setdefault(s.group_key, []).append(s.rollout_idx)
            # Round 1 sees the other two agents' round-0 answers; round 0 only the question.
            prompt = ByteTokenizer().decode(s.prompt_ids.tolist())
            system = {"a": "A:", "b": "B:", "c": "C:"}[s.agent]
            others = [f"\n{x}: " for x in "abc" if x != s.agent]
            assert prompt.startswith(system) and prompt.endswith("\n" if s.turn >= 3 else "=")
            assert all(o in prompt for o in others) == (s.turn >= 3)
    assert {k: sorted(v) for k, v in groups.items()} == {
        f"{task_id}:{a}:{t}": list(range(DEBATE_G)) for t, a in DEBATE_TURNS.items()}
    assert coord.counters["tasks_done"] >= 1 and coord.counters["groups_incomplete_dropped"] == 0
    assert set(coord.metrics_snapshot()["reward_ema"]) == {"a", "b", "c"}


# --- user workflows that fail -----------------------------------------------------------------------------------
HANGING = '''
import asyncio
STARTED, CANCELLED = [], []

async def hangs(ctx, task):
    STARTED.append(task.task_id)
    try:
        await asyncio.Event().wait()  # never set: the workflow never returns
    except asyncio.CancelledError:
        CANCELLED.append(task.task_id)
        raise
'''


async def test_a_workflow_that_never_returns_is_cancelled_at_its_timeout_and_counted(nats_url, run_id, tmp_path):
    (tmp_path / "hang.py").write_text(HANGING)
    cfg = write_config(tmp_path, run_id)
    cfg.workflow = cfg.workflow.model_copy(update={
        "name": "custom", "function": f"{tmp_path / 'hang.py'}:hangs", "agents": ["solver"], "concurrency": 1,
        "step_timeout_s": 0.5, "retries": 1, "backoff_s": 0.05, "max_failures": 1000})
    coord = CoordinatorService(cfg, nats_url=nats_url)
    task = await start(coord)
    glob = coord.workflow.__globals__
    try:
        deadline = time.monotonic() + 20
        while coord.counters["workflow_timeouts"] < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        timeouts = coord.counters["workflow_timeouts"]
        assert timeouts >= 4, dict(coord.counters)
        # Every rollout of every call was cancelled, none left running; a timed-out task was tried once more.
        assert len(glob["CANCELLED"]) >= G * (timeouts - 1), (len(glob["CANCELLED"]), timeouts)
        assert coord.counters["tasks_retried"] >= 1 and coord.counters["tasks_failed"] >= 1
        assert coord.counters["workflow_errors"] == 0  # a timeout is counted as such
        snapshot = coord.metrics_snapshot()["workflow_failures"]
        (entry,) = snapshot.values()
        assert entry["count"] >= timeouts  # one distinct error, counted each time
        assert "WorkflowTimeout" in entry["first"] and "step_timeout_s 0.5s" in entry["first"]
    finally:
        coord.stop()
        assert await asyncio.wait_for(task, 40) == 0
    started = len(glob["STARTED"])
    assert started == len(glob["CANCELLED"]), (started, len(glob["CANCELLED"]))  # none outlives the service


async def test_tasks_in_flight_when_the_coordinator_stops_are_left_not_abandoned(nats_url, run_id, tmp_path):
    """Nobody serves generation (the rollouters gone at the run's end): the tasks waiting on it when the coordinator
    stops are counted as left, not as abandoned by the services, and logged as such."""
    cfg = write_config(tmp_path, run_id)
    coord = CoordinatorService(cfg, nats_url=nats_url)
    task = await start(coord)
    try:
        await wait_until(lambda: coord.counters["gen_no_responders"] >= 2, "requests waiting on a rollouter")
    finally:
        coord.stop()
        assert await asyncio.wait_for(task, 40) == 0
    assert coord.counters["tasks_left_stopping"] == cfg.workflow.concurrency, dict(coord.counters)
    assert coord.counters["tasks_abandoned"] == 0, dict(coord.counters)
