"""What a fault run must keep: every published sample trained exactly once or dropped with a reason, versions
that never go back, a run that completes and no rollouter left paused. Read from the bus, as an operator would.

Published samples are seen on ``traj.<model>`` (a core subscription) and counted by the traj stream's last
sequence; trained and dropped ones come from the events stream, where the trainer and mq write their step and
drop records before they acknowledge anything, so a record is never lost with the process that wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import api as jsapi

from shared.kernel.bus import kv_get_int
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.schemas import CriticBatch, RolloutControl, RolloutControlReply, Sample
from shared.kernel.subjects import Names


@dataclass
class ModelReport:
    """One model's account of a run."""

    published: int = 0  # sample ids seen published on traj.<model>
    stored: int = 0  # messages the traj stream ever stored (its last sequence)
    trained: int = 0  # distinct sample ids in step records
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> distinct sample ids
    missing: list[str] = field(default_factory=list)  # published, neither trained nor dropped
    # Seen on the wire before a kill that took the broker and the publisher together, never stored by the stream
    # (so never acknowledged to a publisher that is gone): not work the run accepted. Only with ``killed_at``.
    unstored_at_kill: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)  # in the records of two versions
    conflicting_versions: list[int] = field(default_factory=list)  # two different records of one version
    versions: list[int] = field(default_factory=list)  # versions with a step record
    served_regression: int = 0  # largest drop of the served version seen in KV
    trained_regression: int = 0  # largest drop of the trained version seen in KV
    last_trained: int = 0

    @property
    def accounted(self) -> int:
        return self.trained + sum(self.dropped.values())


@dataclass
class CriticReport:
    """MARFT's critic's account of a run: its samples (published once per episode) trained once each by a committed
    step, or still waiting in its stream."""

    published: int = 0
    trained: int = 0
    pending: int = 0  # in messages still in the critic's stream (a batch not yet full when the run ended)
    missing: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    conflicting_versions: list[int] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        if self.missing:
            out.append(f"critic: {len(self.missing)} published samples neither trained nor waiting, e.g. "
                       f"{self.missing[:3]}")
        if self.trained_twice:
            out.append(f"critic: {len(self.trained_twice)} samples trained twice, e.g. {self.trained_twice[:3]}")
        if self.conflicting_versions:
            out.append(f"critic: versions recorded twice with different samples: {self.conflicting_versions[:5]}")
        if self.versions != list(range(1, len(self.versions) + 1)):
            out.append(f"critic: step versions are not 1..N: {self.versions[:10]}")
        return out


class Ledger:
    """Watches one run from its own connection; :meth:`report` reads the records and checks the invariants."""

    def __init__(self, run_id: str, models: list[str], url: str, *, critic: bool = False,
                 options: dict[str, Any] | None = None) -> None:
        self.options = options or {}  # more of nats.connect: a user and password on a secured server
        self.critic = critic  # a MARFT run: its critic samples are watched too (:meth:`critic_report`)
        self.critic_published: set[str] = set()
        self.names = Names(run_id)
        self.models = models
        self.url = url
        self.published: dict[str, set[str]] = {m: set() for m in models}
        self.published_at: dict[str, float] = {}  # sample id -> wall time it was seen published
        self.steps: dict[str, list[tuple[float, list[str]]]] = {m: [] for m in models}  # (time, ids) per record
        self.seen: dict[str, dict[str, int]] = {m: {"served": 0, "trained": 0} for m in models}
        self.regression: dict[str, dict[str, int]] = {m: {"served": 0, "trained": 0} for m in models}
        self.served_at: dict[str, list[tuple[float, int]]] = {m: [] for m in models}  # (wall time, served) changes
        self.nc: NATS | None = None
        self._poll: asyncio.Task[None] | None = None

    async def start(self) -> Ledger:
        # Reconnects forever once connected; the first connection must come within 10 s.
        self.nc = await asyncio.wait_for(nats.connect(servers=self.url.split(","), max_reconnect_attempts=-1,
                                                      reconnect_time_wait=0.2, **self.options), 10)
        for m in self.models:
            await self.nc.subscribe(self.names.traj(m), cb=self._on_sample)
        if self.critic:
            await self.nc.subscribe(self.names.critic_samples(), cb=self._on_critic)
        self._poll = asyncio.create_task(self._poll_versions())
        return self

    async def close(self) -> None:
        if self._poll is not None:
            # Cancelled in the middle of a request to a broker that was killed, the poll may not end (nats-py's
            # reconnect holds it): it gets 5 s, as the close below does, and is left behind after that.
            self._poll.cancel()
            await asyncio.wait({self._poll}, timeout=5)
        if self.nc is not None:
            # Closing a client of a broker that was killed can wait for ever on its transport (a reconnect stuck in
            # wait_closed, nats-io/nats.py#671) or end cancelled from inside nats-py: it runs as a task of its own,
            # given 5 s, and whatever it ends with is not the test's (the connection is dropped either way).
            closing = asyncio.ensure_future(self.nc.close())
            await asyncio.wait({closing}, timeout=5)
            if not closing.done():
                closing.cancel()
            elif not closing.cancelled():
                closing.exception()  # retrieved: a failed close is not an error of the run

    async def _on_sample(self, msg: Any) -> None:
        with contextlib.suppress(DecodeError):
            s = decode(Sample, msg.data)
            if s.model in self.published:
                self.published[s.model].add(s.sample_id)
                self.published_at.setdefault(s.sample_id, time.time())

    async def _on_critic(self, msg: Any) -> None:
        with contextlib.suppress(DecodeError):
            self.critic_published.update(s.sample_id for s in decode(CriticBatch, msg.data).samples)

    async def critic_report(self) -> CriticReport:
        """The critic's invariants, from its step records and what is left in its stream."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=10)
        out = CriticReport(published=len(self.critic_published))
        trained_at: dict[str, set[int]] = defaultdict(set)
        steps: dict[int, list[str]] = {}
        for rec in await self.records():
            if rec.get("kind") != "critic_step":
                continue
            v, ids = int(rec["version"]), sorted(rec["sample_ids"])
            if v in steps and steps[v] != ids:
                out.conflicting_versions.append(v)
            steps[v] = ids
            for sid in ids:
                trained_at[sid].add(v)
        pending: set[str] = set()
        state = (await js.stream_info(self.names.critic_stream())).state
        for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
            with contextlib.suppress(nats.errors.Error, DecodeError):
                msg = await js.get_msg(self.names.critic_stream(), seq)
                pending.update(s.sample_id for s in decode(CriticBatch, msg.data or b"").samples)
        out.trained, out.pending = len(trained_at), len(pending - set(trained_at))
        out.trained_twice = sorted(sid for sid, vs in trained_at.items() if len(vs) > 1)
        out.missing = sorted(self.critic_published - set(trained_at) - pending)
        out.versions = sorted(steps)
        return out

    async def _poll_versions(self) -> None:
        """Served and trained versions from KV every 0.2 s: neither may ever go down."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=5)
        kv = None
        while True:
            await asyncio.sleep(0.2)
            try:
                kv = kv or await js.key_value(self.names.kv_bucket)
                for m in self.models:
                    for what, key in (("served", Names.version_key(m)), ("trained", Names.trained_key(m))):
                        v = await kv_get_int(kv, key, -1)
                        if v < 0:
                            continue
                        seen = self.seen[m][what]
                        self.regression[m][what] = max(self.regression[m][what], seen - v)
                        self.seen[m][what] = max(seen, v)
                        if what == "served" and (not self.served_at[m] or self.served_at[m][-1][1] != v):
                            self.served_at[m].append((time.time(), v))
            except (nats.errors.Error, TimeoutError, ValueError):
                continue  # the broker is down or failing over: read again later

    async def trained(self) -> dict[str, int]:
        assert self.nc is not None
        kv = await self.nc.jetstream(timeout=5).key_value(self.names.kv_bucket)
        return {m: await kv_get_int(kv, Names.trained_key(m)) for m in self.models}

    async def stream_messages(self) -> int:
        """Messages left in the run's traj and ready streams."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=5)
        total = 0
        for m in self.models:
            for stream in (self.names.traj_stream(m), self.names.ready_stream(m)):
                total += (await js.stream_info(stream)).state.messages
        return total

    async def status(self, service: str, model: str | None = None, instance: str = "0") -> dict[str, Any]:
        """A service instance's metrics snapshot from its status endpoint ({} when it does not answer, or answers
        without a snapshot: a service stopping or starting answers an empty error reply)."""
        assert self.nc is not None
        try:
            msg = await self.nc.request(self.names.status(service, model, instance), b"", timeout=5)
        except (nats.errors.Error, TimeoutError):
            return {}
        try:
            snapshot = json.loads(msg.data)
        except ValueError:
            return {}
        return snapshot if isinstance(snapshot, dict) else {}

    async def paused_instances(self, instances: dict[str, list[str]]) -> list[str]:
        """Rollouter instances (``model -> instance names``) that say they are paused, or do not answer."""
        assert self.nc is not None
        out = []
        for m, names in instances.items():
            for i in names:
                subject = self.names.rollout_control(m, i, "info")
                try:
                    msg = await self.nc.request(subject, encode(RolloutControl(verb="info")), timeout=5)
                    if decode(RolloutControlReply, msg.data).paused:
                        out.append(f"{m}/{i}: paused")
                except (nats.errors.Error, TimeoutError, DecodeError) as exc:
                    out.append(f"{m}/{i}: {type(exc).__name__}")
        return out

    async def records(self) -> list[dict[str, Any]]:
        """Every record of the events stream (steps, drops and the rest), read with a consumer deleted after."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=10)
        stream = self.names.events_stream()
        name = f"ledger_{int(time.time() * 1000)}"
        await js.add_consumer(stream, config=jsapi.ConsumerConfig(
            name=name, filter_subject=self.names.events_all(), ack_policy=jsapi.AckPolicy.NONE,
            deliver_policy=jsapi.DeliverPolicy.ALL, inactive_threshold=60))
        sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
        out: list[dict[str, Any]] = []
        try:
            last = (await js.stream_info(stream)).state.last_seq
            while True:
                try:
                    msgs = await sub.fetch(500, timeout=2)
                except (nats.errors.TimeoutError, TimeoutError):
                    break
                for msg in msgs:
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(msg.data))
                if msgs and msgs[-1].metadata.sequence.stream >= last:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, name)
        return out

    def served_before(self, model: str, when: float) -> int:
        """The served version of ``model`` last seen before wall time ``when`` (0 before any)."""
        return max((v for t, v in self.served_at[model] if t <= when), default=0)

    def loop_turned(self, since: float, models: list[str] | None = None) -> float:
        """Seconds from wall time ``since`` until every model (of ``models``: default all) still training then
        committed a step with a sample published after ``since``: the whole loop (generation, rewards, mq,
        training, commit) worked again. Needs :meth:`report` first; inf if some model trained on but never did."""
        worst = 0.0
        for model, recs in self.steps.items():
            if models is not None and model not in models:
                continue
            if not any(t > since for t, _ in recs):
                continue  # the model had finished already
            times = [t for t, ids in recs if t > since and any(self.published_at.get(i, 0.0) > since for i in ids)]
            worst = max(worst, min(times, default=float("inf")) - since)
        return round(worst, 1)

    async def report(self, killed_at: float | None = None) -> dict[str, ModelReport]:
        """Check every invariant per model from the records. ``killed_at``: wall time at which the whole run (the
        broker and every publisher) was killed; a sample seen published before it that the traj stream never
        stored goes to ``unstored_at_kill`` instead of ``missing`` (the stream's count proves it was not stored)."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=10)
        records = await self.records()
        trained_at: dict[str, dict[str, set[int]]] = {m: defaultdict(set) for m in self.models}
        steps: dict[str, dict[int, list[str]]] = {m: {} for m in self.models}
        out = {m: ModelReport() for m in self.models}
        dropped: dict[str, dict[str, str]] = {m: {} for m in self.models}
        for rec in records:
            m = rec.get("model")
            if m not in out:
                continue
            if rec.get("kind") == "step":
                v, ids = int(rec["version"]), sorted(rec["sample_ids"])
                if v in steps[m] and steps[m][v] != ids:
                    out[m].conflicting_versions.append(v)
                steps[m][v] = ids
                self.steps[m].append((float(rec.get("time") or 0.0), ids))
                for sid in ids:
                    trained_at[m][sid].add(v)
            elif rec.get("kind") == "drop":
                reason = str(rec.get("reason") or "?")  # one word (DropEvent.reason)
                for sid in rec.get("sample_ids") or []:
                    dropped[m].setdefault(sid, reason)
        for m, r in out.items():
            r.published = len(self.published[m])
            r.stored = (await js.stream_info(self.names.traj_stream(m))).state.last_seq
            r.trained = len(trained_at[m])
            r.trained_twice = sorted(sid for sid, vs in trained_at[m].items() if len(vs) > 1)
            for sid, reason in dropped[m].items():
                if sid not in trained_at[m]:
                    r.dropped[reason] += 1
            r.missing = sorted(self.published[m] - set(trained_at[m]) - set(dropped[m]))
            if killed_at is not None and r.accounted == r.stored:
                # Every message the stream stored is trained or dropped, so what is missing was never stored.
                r.unstored_at_kill = [s for s in r.missing if self.published_at.get(s, float("inf")) <= killed_at]
                r.missing = [s for s in r.missing if s not in set(r.unstored_at_kill)]
            r.versions = sorted(steps[m])
            r.served_regression = self.regression[m]["served"]
            r.trained_regression = self.regression[m]["trained"]
            r.last_trained = self.seen[m]["trained"]
        return out


def violations(reports: dict[str, ModelReport], max_versions: int) -> list[str]:
    """Every broken invariant, as readable lines (empty: the run kept them all)."""
    out = []
    for m, r in reports.items():
        if r.missing:
            out.append(f"{m}: {len(r.missing)} published samples neither trained nor dropped, e.g. {r.missing[:3]}")
        if r.trained_twice:
            out.append(f"{m}: {len(r.trained_twice)} samples trained twice, e.g. {r.trained_twice[:3]}")
        if r.conflicting_versions:
            out.append(f"{m}: versions recorded twice with different samples: {r.conflicting_versions[:5]}")
        if r.versions != list(range(1, max_versions + 1)):
            gaps = sorted(set(range(1, max_versions + 1)) - set(r.versions))
            out.append(f"{m}: step records cover {len(r.versions)} of versions 1..{max_versions} (missing {gaps[:5]})")
        if r.served_regression or r.trained_regression:
            out.append(f"{m}: versions went back (served by {r.served_regression}, trained by {r.trained_regression})")
        if r.accounted != r.stored:
            out.append(f"{m}: {r.stored} samples stored in the traj stream, {r.accounted} trained or dropped")
    return out
