"""Every subject every service listens to, fuzzed on a live tiny run: each bad message reaches ``dlq.<service>``
with a reason, no service dies of it, and the weights stay finite.

All six services run in-process on one background event loop against their own nats-server (with its HTTP
monitoring on, so the test can ask the server what each service really subscribes to). Bad messages: hypothesis
garbage, truncated msgpack of a valid message, a wrong schema version, an oversized payload, non-finite numbers,
out-of-range token ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Imported here, once: transformers' lazy imports race when two services' worker threads load models at once (in
# a deployment every service is a process of its own).
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402, F401, I001

from services.actions.service import ActionsService
from services.coordinator.service import CoordinatorService
from services.critic.service import CriticService
from services.mq.service import MqService
from services.paramsync.service import ParamSyncService
from services.rollouter.service import RollouterService
from services.trainer.service import TrainerService
from shared.kernel.codec import DecodeError, decode, encode, encode_json
from shared.kernel.config import ChorusConfig, load_config
from shared.kernel.schemas import (
    ActionRequest,
    Array,
    CriticBatch,
    CriticRequest,
    CriticRow,
    CriticSample,
    DepthReport,
    GenRequest,
    LoadReport,
    MicroBatch,
    RolloutControl,
    Sample,
    SyncDone,
    WeightsAnnounce,
    WeightsMetaRequest,
    WeightsPull,
)
from shared.kernel.service import Service
from shared.kernel.subjects import BUILDERS, LISTENS, WATCHED_ONLY, Names
from shared.launcher.natsserver import NatsServer, free_port
from shared.models.tokenizer import BOS_ID

M = "m"
G = 2
CONTEXT = 64
RUN = "fuzz"
NaN, INF = float("nan"), float("inf")


def write_config(tmp_path, transport: str, marft: bool = False) -> ChorusConfig:
    """The world's run; ``marft``: the same run with train.loss marft, for the critic (the other services keep the
    default loss: the critic's subjects are fuzzed without MARFT's traffic)."""
    p = tmp_path / ("fuzz-marft.yaml" if marft else "fuzz.yaml")
    p.write_text(f"""
run: {{id: {RUN}, dir: {tmp_path}, seed: 1}}
models:
  {M}: {{arch: {{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position: {CONTEXT}}},
        rollouter: {{threads: 1}}}}
agents: {{solver: {{model: {M}}}, verifier: {{model: {M}, prompt: "v:"}}}}
workflow: {{concurrency: 1, group_size: {G}, max_new_tokens: 2}}
task: {{max_operand: 3, ops: ["+"], modulo: 10}}
train: {{max_versions: 100000, global_batch: 4, micro_batch: 4, checkpoint_every: 0, max_staleness: 4{", loss: marft" if marft else ""}}}
mq: {{report_interval_s: 0.2}}
actions: {{cores: 1, timeout_s: 2.0}}
paramsync: {{transport: {transport}}}
metrics_interval_s: 0.5
""")
    return load_config(p)


# --- the world: six services on one loop in a thread -------------------------------------------------------------
@dataclass
class World:
    cfg: ChorusConfig
    marft_cfg: ChorusConfig  # the critic's (MARFT's service)
    server: NatsServer
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    services: dict[str, Service] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[int]] = field(default_factory=dict)
    dlq: dict[str, Counter[str]] = field(default_factory=dict)  # service -> sha256 of rejected payloads
    reasons: dict[str, list[str]] = field(default_factory=dict)
    sent_bad = 0  # bad messages sent (each expected in a DLQ); the run's own traffic must never land there

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        cfg, url = self.cfg, self.server.url
        self.nc = await nats.connect(url, name="fuzzer")
        self.js = self.nc.jetstream()
        for name in LISTENS:
            self.dlq[name], self.reasons[name] = Counter(), []
        await self.nc.subscribe(Names(RUN).dlq("*"), cb=self._on_dlq)
        order: list[tuple[str, Callable[[], Service]]] = [
            ("actions", lambda: ActionsService(cfg, nats_url=url)),
            ("trainer", lambda: TrainerService(cfg, nats_url=url, model=M)),
            ("rollouter", lambda: RollouterService(cfg, nats_url=url, model=M)),
            ("paramsync", lambda: ParamSyncService(cfg, nats_url=url, model=M)),
            ("mq", lambda: MqService(cfg, nats_url=url, model=M)),
            ("critic", lambda: CriticService(self.marft_cfg, nats_url=url)),
            ("coordinator", lambda: CoordinatorService(cfg, nats_url=url)),
        ]
        for name, make in order:
            svc = make()
            self.services[name] = svc
            self.tasks[name] = asyncio.create_task(svc.serve())
            deadline = time.monotonic() + 60
            while not any(t.get_name() == f"{svc.name}:metrics" for t in svc._tasks):  # set up and serving
                assert not self.tasks[name].done() and time.monotonic() < deadline, f"{name} did not start"
                await asyncio.sleep(0.05)

    async def _on_dlq(self, msg: Any) -> None:
        service = msg.subject.rsplit(".", 1)[-1]
        self.dlq[service][digest(msg.data)] += 1
        self.reasons[service].append(msg.headers.get("Chorus-Reason", "") if msg.headers else "")

    async def stop(self) -> dict[str, int]:
        for name in reversed(list(self.services)):
            self.services[name].stop()
        codes = {n: await asyncio.wait_for(t, 60) for n, t in self.tasks.items()}
        await self.nc.close()
        return codes


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The trainer serves these only with paramsync.transport ucx (it needs ucxx): their cases are marked ucx and run on a
# world of that transport (`make test-ucx`); every other case runs on a world of transport nats.
UCX_ONLY = ("weights_meta", "weights_pull")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], World]]:
    """A world per paramsync transport, started when a test first asks for it."""
    made: dict[str, tuple[World, threading.Thread]] = {}

    def get(transport: str) -> World:
        if transport not in made:
            tmp = tmp_path_factory.mktemp(f"fuzz-{transport}")
            server = NatsServer(tmp / "nats", monitor_port=free_port()).start()
            w = World(write_config(tmp, transport), write_config(tmp, transport, marft=True), server)
            thread = threading.Thread(target=w.loop.run_forever, daemon=True)
            thread.start()
            made[transport] = w, thread
            w.call(w.start(), timeout=180)
        return made[transport][0]

    try:
        yield get
        for w, _ in made.values():
            codes = w.call(w.stop(), timeout=180)
            assert all(c == 0 for c in codes.values()), codes
            rejected = sum(sum(c.values()) for c in w.dlq.values())
            assert rejected == w.sent_bad, f"{rejected - w.sent_bad} messages of the run itself went to a DLQ"
    finally:
        for w, thread in made.values():
            w.loop.call_soon_threadsafe(w.loop.stop)
            thread.join(10)
            w.server.stop()


@pytest.fixture
def world(worlds: Callable[[str], World], request: pytest.FixtureRequest) -> World:
    return worlds("ucx" if request.node.get_closest_marker("ucx") else "nats")


# --- what each subject takes -------------------------------------------------------------------------------------
def sample(i: int = 0, **update: Any) -> Sample:
    s = Sample(run=RUN, episode="fz/0", sample_id=Sample.make_id("fz", 0, i), env_idx=0, rollout_idx=i,
               agent="solver", model=M, turn=0, prompt_ids=Array.of([BOS_ID, 50, 43, 50]),
               response_ids=Array.of([52, 53]), behavior_logprobs=Array.of([-0.5, -0.2], "float32"), reward=1.0,
               group_key="fz:solver:0", group_size=G, version=0)
    return s.model_copy(update=update)


@dataclass(frozen=True)
class Case:
    """A subject a service listens to: a valid message for it, and bad variants of it (not garbage or cuts)."""

    service: str
    method: str
    subject: Callable[[Names], str]
    valid: Callable[[], bytes]
    bad: Callable[[], list[bytes]]  # wrong schema, oversized, non-finite, out-of-range ids
    stream: bool = False  # published to JetStream (mq and trainer consume it)
    json: bool = False


def msgpack_with(message: Any, **raw_update: Any) -> bytes:
    """``message`` encoded with fields replaced at the msgpack level (values pydantic would refuse to build)."""
    raw = msgpack.unpackb(encode(message), raw=False)
    raw.update(raw_update)
    return msgpack.packb(raw, use_bin_type=True)


def gen_request(**update: Any) -> GenRequest:
    return GenRequest(request_id="fz", prompts=[Array.of([BOS_ID, 50, 43])], max_new_tokens=2).model_copy(
        update=update)


def control(verb: str) -> RolloutControl:
    # migrate to the model it serves: refused, as any migrate would be in a run of one model
    return RolloutControl(verb=verb, version=1, target=M if verb == "migrate" else None)  # type: ignore[arg-type]


def bad_gen() -> list[bytes]:
    req = gen_request()
    return [
        msgpack_with(req, schema=2),
        msgpack_with(req, temperature=NaN), msgpack_with(req, top_p=INF), msgpack_with(req, deadline=NaN),
        encode(gen_request(prompts=[Array.of([BOS_ID, 10**6])])),  # a token id beyond the vocabulary
        encode(gen_request(prompts=[Array.of([-3, 50])])),
        encode(gen_request(prompts=[Array.of([BOS_ID] * (CONTEXT + 1))])),  # longer than the context
        msgpack_with(req, prompts=[encode_array([1, 2])] * 5000),  # more prompts than a request may hold
    ]


def encode_array(ids: list[int]) -> dict[str, Any]:
    return Array.of(ids).model_dump()


def bad_control(verb: str) -> Callable[[], list[bytes]]:
    def make() -> list[bytes]:
        ctl = control(verb)
        other = "resume" if verb != "resume" else "pause"
        return [msgpack_with(ctl, schema=0), msgpack_with(ctl, timeout_s=INF), msgpack_with(ctl, timeout_s=NaN),
                msgpack_with(ctl, object_name="x" * 70_000), encode(control(other)), msgpack_with(ctl, version=-1.5),
                msgpack_with(ctl, target="x" * 1000)]
    return make


def bad_samples() -> list[Sample]:
    """Samples that decode but that no coordinator of the run could have produced."""
    return [
        sample(0, reward=NaN), sample(1, reward=-INF), sample(0, advantage=INF),
        sample(1, response_ids=Array.of([52, 10**6])), sample(0, prompt_ids=Array.of([-1, 50])),
        sample(1, prompt_ids=Array.of([BOS_ID] * (CONTEXT + 1))),  # longer than the context
        sample(0, response_ids=Array.of([52] * 5000), behavior_logprobs=Array.of([-0.1] * 5000, "float32")),
        sample(1, behavior_logprobs=Array.of([NaN, -0.2], "float32")),
        sample(0, run="another-run"), sample(1, group_size=G + 3), sample(0, agent="intruder"),
        sample(1, sample_id="forged"), sample(0, version=10**6),  # weights from the future
    ]


def bad_traj() -> list[bytes]:
    s = sample()
    return [msgpack_with(s, schema=3), msgpack_with(s, reward="high"),
            *[encode(b) for b in bad_samples() if b.version == 0]]


def bad_ready() -> list[bytes]:
    mb = MicroBatch(batch_id="fz", model=M, samples=[sample()])
    return [msgpack_with(mb, schema=9), msgpack_with(mb, created_at=NaN), msgpack_with(mb, model="other"),
            *[encode(MicroBatch(batch_id=f"fz{i}", model=M, samples=[b])) for i, b in enumerate(bad_samples())]]


def ready_dlq_payloads(data: bytes) -> list[bytes]:
    """What the trainer puts in its DLQ for a micro-batch: the whole message, or its bad samples one by one."""
    try:
        mb = decode(MicroBatch, data)
    except DecodeError:
        return [data]
    return [data] if mb.model != M else [encode(s) for s in mb.samples]


def critic_row(**update: Any) -> CriticRow:
    return CriticRow(ids=Array.of([BOS_ID, 50, 43, 50]), positions=[3]).model_copy(update=update)


def critic_sample(**update: Any) -> CriticSample:
    return CriticSample(sample_id="fz_0_0", row=critic_row(), old_values=[0.1], returns=[0.5]).model_copy(update=update)


def bad_critic_values() -> list[bytes]:
    req = CriticRequest(rows=[critic_row()])
    return [msgpack_with(req, schema=2), msgpack_with(req, rows="x"),
            encode(CriticRequest(rows=[critic_row(ids=Array.of([BOS_ID, 10**6]))])),  # beyond the vocabulary
            encode(CriticRequest(rows=[critic_row(ids=Array.of([-3, 50]))])),
            encode(CriticRequest(rows=[critic_row(positions=[4])])),  # after the row's last token
            encode(CriticRequest(rows=[critic_row(positions=[])])),
            encode(CriticRequest(rows=[critic_row(ids=Array.of([], "int32"))]))]


def bad_critic_samples() -> list[bytes]:
    batch = CriticBatch(batch_id="fz", samples=[critic_sample()])
    one = [critic_sample(old_values=[0.1, 0.2]), critic_sample(returns=[]),
           critic_sample(row=critic_row(ids=Array.of([BOS_ID, 10**6]), positions=[1])),
           critic_sample(row=critic_row(positions=[9]))]
    return [msgpack_with(batch, schema=3), msgpack_with(batch, samples=[{"sample_id": "x"}]),
            msgpack_with(batch, samples=[{**msgpack.unpackb(encode(critic_sample()), raw=False), "returns": [NaN]}]),
            *[encode(CriticBatch(batch_id=f"fz{i}", samples=[s])) for i, s in enumerate(one)]]


def critic_dlq_payloads(data: bytes) -> list[bytes]:
    """What the critic puts in its DLQ for a batch: the whole message, or its bad samples one by one."""
    try:
        batch = decode(CriticBatch, data)
    except DecodeError:
        return [data]
    return [encode(s) for s in batch.samples]


def depth_report(**update: Any) -> dict[str, Any]:
    return {**json.loads(encode_json(DepthReport(model=M, depth=0, capacity=10, trained_version=0))), **update}


def bad_depth() -> list[bytes]:
    return [json.dumps(depth_report(schema=5)).encode(), json.dumps(depth_report(depth=NaN)).encode(),
            json.dumps(depth_report(capacity=INF)).encode(), json.dumps(depth_report(model="x" * 70_000)).encode(),
            json.dumps(depth_report(extra=1)).encode()]


def load_report(**update: Any) -> dict[str, Any]:
    return {**json.loads(encode_json(LoadReport(model=M, instance="0", queued_rows=0, running_rows=0))), **update}


def bad_load() -> list[bytes]:
    return [json.dumps(load_report(**u)).encode() for u in (
        {"schema": 5}, {"queued_rows": NaN}, {"running_rows": -1}, {"tokens": INF}, {"model": "x" * 70_000},
        {"instance": None}, {"extra": 1})]


def bad_sync_done() -> list[bytes]:
    done = SyncDone(model=M, version=1, loaded=["0"])
    return [msgpack_with(done, schema=2), msgpack_with(done, seconds=NaN), msgpack_with(done, model="other"),
            msgpack_with(done, loaded=["x" * 1000] * 100)]


def bad_announce() -> list[bytes]:
    ann = WeightsAnnounce(model=M, version=1, checksum="c", nbytes=4)
    return [msgpack_with(ann, schema=2), msgpack_with(ann, created_at=INF), msgpack_with(ann, model="other"),
            msgpack_with(ann, checksum="c" * 70_000)]


def bad_meta() -> list[bytes]:
    req = WeightsMetaRequest(model=M, version=0)
    return [msgpack_with(req, schema=2), msgpack_with(req, version=NaN), msgpack_with(req, model="x" * 70_000)]


def bad_pull() -> list[bytes]:
    req = WeightsPull(model=M, version=0, instance="z", address=b"addr", tag=1)
    return [msgpack_with(req, schema=2), msgpack_with(req, tag=2**64 - 1), msgpack_with(req, version=INF),
            msgpack_with(req, address=b"a" * 70_000)]


def bad_actions() -> list[bytes]:
    req = ActionRequest(action_id="fz", kind="echo", payloads=[{"x": 1}])
    return [msgpack_with(req, schema=2), msgpack_with(req, timeout_s=INF), msgpack_with(req, timeout_s=NaN),
            msgpack_with(req, payloads=[{}] * 5000), msgpack_with(req, kind="format_disk")]


CASES: list[Case] = [
    Case("coordinator", "depth", lambda n: n.depth(M), lambda: json.dumps(depth_report()).encode(), bad_depth,
         json=True),
    Case("coordinator", "rollout_load", lambda n: n.rollout_load(M), lambda: json.dumps(load_report()).encode(),
         bad_load, json=True),
    Case("coordinator", "sync_done", lambda n: n.sync_done(M), lambda: encode(SyncDone(model=M, version=1, loaded=[])),
         bad_sync_done),
    # a sync's end: a rollouter whose version is below it checks at once whether it is behind
    Case("rollouter", "sync_done", lambda n: n.sync_done(M), lambda: encode(SyncDone(model=M, version=1, loaded=[])),
         bad_sync_done),
    Case("rollouter", "gen", lambda n: n.gen(M), lambda: encode(gen_request()), bad_gen),
    Case("rollouter", "gen_direct", lambda n: n.gen_direct(M, "0"), lambda: encode(gen_request()), bad_gen),
    *[Case("rollouter", "rollout_control", lambda n, v=verb: n.rollout_control(M, "0", v),
           lambda v=verb: encode(control(v)), bad_control(verb))
      for verb in ("pause", "load", "resume", "info", "migrate")],
    Case("mq", "traj", lambda n: n.traj(M), lambda: encode(sample()), bad_traj, stream=True),
    Case("trainer", "ready", lambda n: n.ready(M),
         lambda: encode(MicroBatch(batch_id="fz", model=M, samples=[sample()])), bad_ready, stream=True),
    Case("trainer", "weights_meta", lambda n: n.weights_meta(M),
         lambda: encode(WeightsMetaRequest(model=M, version=0)), bad_meta),
    Case("trainer", "weights_pull", lambda n: n.weights_pull(M),
         lambda: encode(WeightsPull(model=M, version=0, instance="z", address=b"a", tag=1)), bad_pull),
    Case("paramsync", "sync_announce", lambda n: n.sync_announce(M),
         lambda: encode(WeightsAnnounce(model=M, version=1, checksum="c", nbytes=4)), bad_announce),
    Case("actions", "actions_submit", lambda n: n.actions_submit(), lambda: encode(ActionRequest(
        action_id="fz", kind="echo", payloads=[{}])), bad_actions),
    Case("critic", "critic_values", lambda n: n.critic_values(), lambda: encode(CriticRequest(rows=[critic_row()])),
         bad_critic_values),
    Case("critic", "critic_samples", lambda n: n.critic_samples(),
         lambda: encode(CriticBatch(batch_id="fz", samples=[critic_sample()])), bad_critic_samples, stream=True),
]
CASE_IDS = [f"{c.service}:{c.subject(Names(RUN)).removeprefix(f'chorus.{RUN}.')}" for c in CASES]
CASE_PARAMS = [pytest.param(c, id=i, marks=[pytest.mark.ucx] if c.method in UCX_ONLY else []) for c, i in
               zip(CASES, CASE_IDS, strict=True)]


# --- sending and checking -----------------------------------------------------------------------------------------
async def send(w: World, case: Case, payloads: list[bytes]) -> None:
    """Publish each payload on the case's subject and wait until the service has put each in its DLQ."""
    subject = case.subject(Names(RUN))
    want: Counter[str] = Counter()
    for data in payloads:
        expected = (ready_dlq_payloads(data) if case.method == "ready" else
                    critic_dlq_payloads(data) if case.method == "critic_samples" else [data])
        want.update(digest(e) for e in expected)
    # every service listening to the subject (a core subject may have several) puts each in its own DLQ
    listeners = sorted({c.service for c in CASES if c.subject(Names(RUN)) == subject}) if not case.stream else [
        case.service]
    before = {s: Counter(w.dlq[s]) for s in listeners}
    first_reason = len(w.reasons[case.service])
    for data in payloads:
        if case.stream:
            await w.js.publish(subject, data)
        else:
            await w.nc.publish(subject, data, reply=w.nc.new_inbox())
    w.sent_bad += sum(want.values()) * len(listeners)
    deadline = time.monotonic() + 20
    while True:
        missing = sum(((want - (w.dlq[s] - before[s])) for s in listeners), Counter())
        if not missing:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} of {sum(want.values())} bad messages on {subject} did not reach "
                                 f"dlq.{case.service}; the reasons it gave: {w.reasons[case.service][first_reason:]}")
        await asyncio.sleep(0.02)


def alive(w: World) -> None:
    dead = {n: t.result() if not t.cancelled() else "cancelled" for n, t in w.tasks.items() if t.done()}
    assert not dead, f"services exited: {dead}"
    failures = {n: s.counters["task_failures"] for n, s in w.services.items() if s.counters["task_failures"]}
    assert not failures, failures


FUZZ = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("case", CASE_PARAMS)
@FUZZ
@given(garbage=st.binary(min_size=0, max_size=2048), cut=st.floats(0.0, 1.0, exclude_max=True))
def test_garbage_and_truncated_messages_go_to_the_dlq(world: World, case: Case, garbage: bytes, cut: float) -> None:
    valid = case.valid()
    truncated = valid[: int(len(valid) * cut)]
    world.call(send(world, case, [garbage, truncated]))
    alive(world)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_wrong_schema_oversized_non_finite_and_out_of_range_messages_go_to_the_dlq(world: World, case: Case) -> None:
    bad = case.bad()
    assert len(bad) >= 3
    world.call(send(world, case, bad))
    reasons = world.reasons[case.service][-len(bad):]
    assert all(r for r in reasons), reasons  # every rejection says why
    alive(world)


@pytest.mark.parametrize("transport", ["nats", pytest.param("ucx", marks=pytest.mark.ucx)])
def test_every_subscribed_subject_of_every_service_has_a_fuzz_case(worlds: Callable[[str], World],
                                                                   transport: str) -> None:
    world = worlds(transport)
    names = Names(RUN)
    fuzzed = {(c.service, c.method) for c in CASES} | {(s, "status") for s in LISTENS}
    # Every subject of shared/kernel/subjects.py is either listened to by a service (then it needs a case) or declared
    # as only watched; a new subject must be put in one of the two.
    subjects = []
    for method, _ in inspect.getmembers(Names, predicate=inspect.isfunction):
        if method.startswith("_"):
            continue
        bound = getattr(names, method)
        value = bound(*["x"] * len(inspect.signature(bound).parameters))
        if isinstance(value, str) and (value.startswith(names.prefix + ".") or value.startswith("$SRV")):
            subjects.append(method)
    assert subjects, "no subject builders found on Names"
    listened = {m for methods in LISTENS.values() for m in methods}
    unclassified = set(subjects) - listened - set(WATCHED_ONLY) - set(BUILDERS)
    assert not unclassified, f"subjects neither in LISTENS nor WATCHED_ONLY: {sorted(unclassified)}"
    missing = {(s, m) for s, methods in LISTENS.items() for m in methods} - fuzzed
    assert not missing, f"subscribed subjects without a fuzz case: {sorted(missing)}"

    # What the services really subscribe to, as the server sees it: each must be a listed, fuzzed subject.
    known: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)  # subject -> service -> its case
    for c in CASES:
        known[c.subject(names)][c.service] = (c.service, c.method)
    for service, svc in world.services.items():
        known[svc.status_subject][service] = (service, "status")
    url = f"http://127.0.0.1:{world.server.monitor_port}/connz?subs=detail&limit=1024"
    conns = json.loads(urllib.request.urlopen(url, timeout=10).read())["connections"]
    seen: set[tuple[str, str]] = set()
    for conn in conns:
        service = conn.get("name", "").split(".")[0]
        if service not in LISTENS:
            continue
        for sub in conn.get("subscriptions_list_detail", []):
            subject = sub["subject"]
            if subject.startswith(("_INBOX.", "$SRV.")):
                continue  # replies to its own requests, the micro API's ping/info/stats
            assert service in known.get(subject, {}), f"{service} subscribes to {subject}, which has no fuzz case"
            seen.add(known[subject][service])
    for stream in [*names.streams([M]), names.critic_stream()]:
        for info in world.call(world.js.consumers_info(stream)):
            subject = info.config.filter_subject
            if subject and subject.startswith(names.prefix):
                assert subject in known, f"consumer {info.name} of {stream} reads {subject}, which has no fuzz case"
                seen.update(known[subject].values())
    # Every listed subject was found live (a stale LISTENS entry would be fuzzing nothing).
    live = {(c.service, c.method) for c in CASES if transport == "ucx" or c.method not in UCX_ONLY}
    assert seen >= live, live - seen


def test_status_answers_any_payload_and_the_weights_stay_finite(world: World) -> None:
    async def probe() -> None:
        for svc in world.services.values():
            for payload in (b"", b"\xff\x00garbage", b"x" * 100_000):
                reply = await world.nc.request(svc.status_subject, payload, timeout=10)
                assert json.loads(reply.data)["service"] == svc.name
    world.call(probe())
    alive(world)
    trainer, rollouter = world.services["trainer"], world.services["rollouter"]
    assert trainer.learner.version > 0  # type: ignore[attr-defined]  # the run trained while it was fuzzed
    assert all(torch.isfinite(t).all() for t in trainer.learner.named_tensors().values())  # type: ignore[attr-defined]
    assert all(torch.isfinite(t).all() for t in rollouter.engine.named_tensors().values())  # type: ignore[attr-defined]
