"""``chorus dashboard``: a page in the browser for a live run or a finished one.

A small HTTP server on loopback serves the page (``shared/launcher/dashboard_static``: HTML, CSS and JavaScript
written here, no build step, nothing from a CDN) and what it draws:

- ``GET /api/state``: everything known so far, each long series decimated to at most ``MAX_POINTS`` points;
- ``GET /api/stream``: Server-Sent Events, one JSON list of updates every ``PUSH_S`` seconds.

What it knows comes from two places, merged and deduplicated: the run directory (the trainers' and the
coordinator's ``metrics.jsonl``, the sampled episodes of ``samples.jsonl``, the gauges ``chorus up`` records in
``gauges.jsonl``), and, while the run is live, its subjects on the bus (``metrics.>``, ``events.>`` and
``samples``), read as the read-only ``observer`` user. The browser never talks to NATS and never holds a
credential (docs/operations.md says why); with the bus gone, the page shows what the run directory holds.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import mimetypes
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.launcher.runfiles import SUMMARY
from shared.launcher.views import section
from shared.results.promexport import read_request

STATIC = Path(__file__).with_name("dashboard_static")
MAX_POINTS = 1500  # points per series in /api/state; the page decimates the same way as updates arrive
RECENT = 300  # the newest points of a series are never decimated
KEEP_EPISODES = 400  # sampled episodes held for the trajectory view
GAUGE_EVERY_S = 2.0  # one gauge point per service instance at most this often
PUSH_S = 0.5  # updates are pushed to the pages in one message this often
CLIENT_QUEUE = 256  # pushes a slow page may be behind before it is dropped (it reconnects and reloads the state)
GAUGES_FILE = "gauges.jsonl"


def decimate(points: list[Any], limit: int = MAX_POINTS, recent: int = RECENT) -> list[Any]:
    """At most ``limit`` of ``points``: the newest ``recent`` as they are, the older ones at an even stride (the
    first always kept), so that a run of 10,000 versions costs the page no more than one of 1,500."""
    if len(points) <= limit:
        return list(points)
    recent = min(recent, limit - 1)
    old, new = points[: len(points) - recent], points[len(points) - recent:]
    room = limit - recent
    stride = -(-len(old) // room)  # ceil
    return old[::stride][:room] + new


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def compact_gauge(m: Mapping[str, Any]) -> dict[str, Any] | None:
    """The fields of one service's metrics message the page draws, by service kind; None for anything else."""
    service, counters = m.get("service"), section(m, "counters")
    out: dict[str, Any] = {}
    if service == "mq":
        out = {"depth": m.get("depth"), "held": m.get("held"), "trained_version": m.get("trained_version")}
    elif service == "coordinator":
        out = {"in_flight": m.get("in_flight"), "tasks_started": counters.get("tasks_started"),
               "tasks_done": counters.get("tasks_done"), "admitting": m.get("admitting"),
               "backpressured": m.get("backpressured"), "tokens_generated": m.get("tokens_generated"),
               "backpressure_waits": counters.get("backpressure_waits")}
    elif service == "rollouter":
        out = {"tokens_per_s": m.get("tokens_per_s"), "version": m.get("version"), "sync_s": m.get("sync_s"),
               "loads": counters.get("loads"), "queued": m.get("queued"), "routing": m.get("routing")}
    elif service == "trainer":
        out = {"version": m.get("version")}
        pool = m.get("pool")
        if isinstance(pool, Mapping) and isinstance(pool.get("slots"), list):
            out["slots"] = [s.get("holder") if isinstance(s, Mapping) else None for s in pool["slots"]]
    elif service == "actions":
        kinds = m.get("queued_kinds")
        out = {"busy_cores": m.get("busy_cores"), "cores": m.get("cores"), "queue_len": m.get("queue_len"),
               "queued_kinds": dict(kinds) if isinstance(kinds, Mapping) else {}, "scheduler": m.get("scheduler")}
    elif service == "paramsync":
        out = {"synced_version": m.get("synced_version"), "syncs": counters.get("syncs")}
    elif service == "critic":
        out = {"version": m.get("version")}
    else:
        return None
    return {"service": service, "instance": str(m.get("instance", "")), "model": m.get("model"),
            "time": _num(m.get("time")) or time.time(), **{k: v for k, v in out.items() if v is not None}}


def slots_moved(before: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether a training pool's slots changed hands: such a gauge is kept whatever the interval (the timeline)."""
    return "slots" in now and before.get("slots") != now["slots"]


def gauge_key(g: Mapping[str, Any]) -> str:
    model = g.get("model")
    return f"{g['service']}.{model}-{g['instance']}" if model else f"{g['service']}.{g['instance']}"


STEP_FIELDS = ("version", "time", "reward_mean", "staleness_mean", "staleness_max", "step_seconds", "samples",
               "loss", "truncated")


@dataclass
class DashState:
    """What the page draws, fed by records (run directory) and messages (bus) alike; every ``on_*`` returns the
    updates it made (for the pages connected now), or nothing for a record it already had."""

    models: list[str]
    agents: dict[str, str]  # agent -> its model
    max_versions: int
    run: str
    steps: dict[str, list[list[Any]]] = field(default_factory=dict)  # model -> [STEP_FIELDS...] by version
    step_versions: dict[str, set[int]] = field(default_factory=dict)
    step_times: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # sorted (time, version)
    evals: list[dict[str, Any]] = field(default_factory=list)
    drops: dict[str, dict[str, int]] = field(default_factory=dict)  # model -> reason -> samples
    drop_keys: set[str] = field(default_factory=set)
    critic: list[list[Any]] = field(default_factory=list)  # [version, time, value_loss, explained_variance]
    gauges: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # instance key -> points
    episodes: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEEP_EPISODES))
    episode_keys: set[tuple[Any, ...]] = field(default_factory=set)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    live: str = "starting"
    started: float = field(default_factory=time.time)

    @classmethod
    def for_config(cls, cfg: Any) -> DashState:
        return cls(models=list(cfg.models), agents={a: s.model for a, s in cfg.agents.items()},
                   max_versions=cfg.train.max_versions, run=cfg.run.id)

    # --- the trainers' steps and the coordinator's evaluations -----------------------------------------------
    def on_step(self, rec: Mapping[str, Any]) -> list[dict[str, Any]]:
        model, version = rec.get("model"), rec.get("version")
        if not isinstance(model, str) or not isinstance(version, int):
            return []
        seen = self.step_versions.setdefault(model, set())
        if version in seen:
            return []
        seen.add(version)
        row = [rec.get(k) for k in STEP_FIELDS]
        if row[1] is None:
            row[1] = time.time()
        rows = self.steps.setdefault(model, [])
        rows.append(row)
        if len(rows) > 1 and rows[-2][0] > version:
            rows.sort(key=lambda r: r[0])
        bisect.insort(self.step_times.setdefault(model, []), (float(row[1] or 0.0), version))
        return [{"t": "step", "model": model, "row": row}]

    def on_eval(self, rec: Mapping[str, Any]) -> list[dict[str, Any]]:
        if not isinstance(rec.get("version"), int):
            return []
        ev = {"version": rec["version"], "time": _num(rec.get("time")) or time.time(), "final": _num(rec.get("final")),
              "pass1": {a: v for a, v in (rec.get("pass1") or {}).items() if _num(v) is not None},
              "n": rec.get("n"), "last": bool(rec.get("last"))}
        if any(e["version"] == ev["version"] and abs(e["time"] - ev["time"]) < 1e-3 for e in self.evals):
            return []
        self.evals.append(ev)
        self.evals.sort(key=lambda e: (e["version"], e["time"]))
        return [{"t": "eval", "eval": ev}]

    def on_drop(self, rec: Mapping[str, Any]) -> list[dict[str, Any]]:
        model, reason, count = rec.get("model"), rec.get("reason"), rec.get("count")
        if not isinstance(model, str) or not isinstance(reason, str) or not isinstance(count, int):
            return []
        key = f"{model}:{reason}:{','.join(sorted(map(str, rec.get('sample_ids') or [])))}"
        if key in self.drop_keys:
            return []
        self.drop_keys.add(key)
        by = self.drops.setdefault(model, {})
        by[reason] = by.get(reason, 0) + count
        return [{"t": "drop", "model": model, "reason": reason, "count": count}]

    def on_critic(self, rec: Mapping[str, Any]) -> list[dict[str, Any]]:
        if not isinstance(rec.get("version"), int) or any(r[0] == rec["version"] for r in self.critic[-50:]):
            return []
        row = [rec["version"], _num(rec.get("time")) or time.time(), _num(rec.get("value_loss")),
               _num(rec.get("explained_variance"))]
        self.critic.append(row)
        return [{"t": "critic", "row": row}]

    def on_record(self, rec: Any) -> list[dict[str, Any]]:
        """One line of metrics.jsonl or one event from the bus."""
        if not isinstance(rec, Mapping):
            return []
        kind = rec.get("kind", "step")
        if kind == "step":
            return self.on_step(rec)
        if kind == "eval":
            return self.on_eval(rec)
        if kind == "drop":
            return self.on_drop(rec)
        if kind == "critic_step":
            return self.on_critic(rec)
        return []

    def on_event(self, service: str, ev: Any) -> list[dict[str, Any]]:
        """An event of ``events.<service>``: the records above, and the latest few of every kind for the log."""
        if not isinstance(ev, Mapping):
            return []
        out = self.on_record(ev) if ev.get("kind") in ("step", "eval", "drop", "critic_step") else []
        brief = {"service": service, "kind": ev.get("kind"), "model": ev.get("model"),
                 "time": _num(ev.get("time")) or time.time(),
                 "text": ", ".join(f"{k}={_brief(v)}" for k, v in ev.items()
                                   if k not in ("kind", "model", "time", "instance", "sample_ids", "agent_reward",
                                                "final_by_task", "errors") and not isinstance(v, dict | list))[:240]}
        self.events.append(brief)
        return [*out, {"t": "event", "event": brief}]

    # --- services' gauges ----------------------------------------------------------------------------------
    def on_gauge(self, g: Mapping[str, Any] | None, *, every_s: float = GAUGE_EVERY_S) -> list[dict[str, Any]]:
        if g is None:
            return []
        key = gauge_key(g)
        points = self.gauges.setdefault(key, [])
        if points and g["time"] - points[-1]["time"] < every_s and not slots_moved(points[-1], g):
            return []
        points.append(dict(g))
        if len(points) > 2 * MAX_POINTS:
            self.gauges[key] = decimate(points)
        return [{"t": "gauge", "key": key, "point": dict(g)}]

    # --- the sampled episodes ------------------------------------------------------------------------------
    def staleness(self, model: str | None, version: Any, at: float) -> int | None:
        """How many versions the model had trained past ``version`` when the episode was recorded."""
        if not isinstance(version, int) or model is None:
            return None
        times = self.step_times.get(model) or []
        i = bisect.bisect_right(times, (at, float("inf")))
        latest = max((v for _, v in times[:i][-8:]), default=0)
        return max(0, latest - version)

    def on_episode(self, rec: Any) -> list[dict[str, Any]]:
        if not isinstance(rec, Mapping) or not isinstance(rec.get("turns"), list):
            return []
        key = (rec.get("task_id"), rec.get("rollout"), rec.get("time"), rec.get("eval"))
        if key in self.episode_keys:
            return []
        self.episode_keys.add(key)
        at = _num(rec.get("time")) or time.time()
        turns = []
        for t in rec["turns"]:
            if isinstance(t, Mapping):
                turns.append({k: t.get(k) for k in ("turn", "agent", "model", "version", "prompt_tail", "response",
                                                     "reward", "advantage", "answer", "correct", "trained",
                                                     "reward_error") if k in t}
                             | {"staleness": self.staleness(t.get("model"), t.get("version"), at)})
        ep = {"time": at, "task_id": rec.get("task_id"), "rollout": rec.get("rollout"), "eval": bool(rec.get("eval")),
              "question": str(rec.get("question", ""))[-2000:], "reference": str(rec.get("reference", ""))[:500],
              "final_reward": rec.get("final_reward"), "final_answer": rec.get("final_answer"),
              "versions": rec.get("versions") or {}, "turns": turns}
        if len(self.episodes) == self.episodes.maxlen:
            old = self.episodes[0]
            self.episode_keys.discard((old["task_id"], old["rollout"], old["time"], old["eval"]))
        self.episodes.append(ep)
        return [{"t": "episode", "episode": ep}]

    # --- what a page loads first ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "run": self.run, "models": self.models, "agents": self.agents, "max_versions": self.max_versions,
            "live": self.live, "now": time.time(), "started": self.started,
            "steps": {m: decimate(rows) for m, rows in self.steps.items()}, "step_fields": list(STEP_FIELDS),
            "evals": self.evals, "drops": self.drops, "critic": decimate(self.critic),
            "gauges": {k: decimate(v) for k, v in self.gauges.items()},
            "episodes": sorted(self.episodes, key=lambda e: e["time"]), "events": list(self.events),
        }


def _brief(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)[:40]


# --- the run directory ---------------------------------------------------------------------------------------
def _json_lines(path: Path) -> Iterable[Any]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def read_run_dir(run_dir: Path) -> tuple[list[Any], list[Any], list[Any]]:
    """What the run directory holds, parsed (off the event loop): the records of metrics.jsonl (steps,
    evaluations, drops, critic steps), the recorded gauges (gauges.jsonl) and the sampled episodes
    (samples.1.jsonl, then samples.jsonl)."""
    gauges = [g for g in _json_lines(run_dir / GAUGES_FILE)
              if isinstance(g, dict) and isinstance(g.get("service"), str) and _num(g.get("time")) is not None]
    episodes = [e for name in ("samples.1.jsonl", "samples.jsonl") for e in _json_lines(run_dir / name)]
    return list(_json_lines(run_dir / "metrics.jsonl")), gauges, episodes[-KEEP_EPISODES:]


def apply_run_dir(state: DashState, parsed: tuple[list[Any], list[Any], list[Any]]) -> None:
    records, gauges, episodes = parsed
    for rec in records:
        state.on_record(rec)
    for g in gauges:
        state.on_gauge(g, every_s=0.0)
    for ep in episodes:
        state.on_episode(ep)


def load_run_dir(state: DashState, run_dir: Path) -> None:
    apply_run_dir(state, read_run_dir(run_dir))


class GaugeRecorder:
    """``chorus up``'s record of the services' gauges (``<run dir>/gauges.jsonl``): one line per instance every
    ``every_s`` at most, so that a finished run's dashboard still has its queues, throughput and pool."""

    def __init__(self, run_dir: Path, every_s: float = 5.0) -> None:
        self.path = Path(run_dir) / GAUGES_FILE
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.slots: dict[str, Mapping[str, Any]] = {}  # the last pool gauge written, per instance
        self.pending: list[str] = []
        self.errors = 0

    def on_metrics(self, m: Any) -> None:
        g = compact_gauge(m) if isinstance(m, Mapping) else None
        if g is None:
            return
        key = gauge_key(g)
        if g["time"] - self.last.get(key, 0.0) < self.every_s and not slots_moved(self.slots.get(key, {}), g):
            return
        self.last[key] = g["time"]
        if "slots" in g:
            self.slots[key] = g
        self.pending.append(json.dumps(g, separators=(",", ":"), default=str))

    def flush(self) -> None:
        lines, self.pending = self.pending, []
        if lines:
            try:
                with open(self.path, "a") as f:
                    f.write("\n".join(lines) + "\n")
            except OSError:
                self.errors += 1


# --- the bus -------------------------------------------------------------------------------------------------
class Feed:
    """The updates of a live run, from its subjects, pushed to every page connected."""

    def __init__(self, state: DashState) -> None:
        self.state = state
        self.clients: set[asyncio.Queue[bytes | None]] = set()
        self.pending: list[dict[str, Any]] = []
        self.dropped_clients = 0
        self.bad_messages = 0

    def add(self, updates: list[dict[str, Any]]) -> None:
        self.pending.extend(updates)

    def on_message(self, subject: str, data: bytes, prefix: str) -> None:
        rel = subject.removeprefix(prefix + ".")
        try:
            if rel == "samples":
                for line in data.decode(errors="replace").splitlines():
                    self.add(self.state.on_episode(json.loads(line)))
                return
            payload = json.loads(data)
        except ValueError:
            self.bad_messages += 1
            return
        if rel.startswith("metrics."):
            self.add(self.state.on_gauge(compact_gauge(payload) if isinstance(payload, Mapping) else None))
        elif rel.startswith("events."):
            self.add(self.state.on_event(rel.split(".", 1)[1], payload))

    def set_live(self, live: str) -> None:
        if self.state.live != live:
            self.state.live = live
            self.add([{"t": "live", "live": live}])

    def push(self) -> None:
        """Send what came in since the last push to every page, as one message."""
        if not self.pending:
            return
        body = f"data: {json.dumps(self.pending, separators=(',', ':'), default=str)}\n\n".encode()
        self.pending = []
        for q in list(self.clients):
            try:
                q.put_nowait(body)
            except asyncio.QueueFull:  # a page that does not read: it is closed, reconnects and reloads
                self.clients.discard(q)
                self.dropped_clients += 1
                with contextlib.suppress(asyncio.QueueFull):
                    q.get_nowait()
                    q.put_nowait(None)

    async def push_loop(self) -> None:
        while True:
            await asyncio.sleep(PUSH_S)
            self.push()


async def follow_bus(feed: Feed, cfg: Any, url: str, stop: asyncio.Event,
                     ended: Callable[[], bool] = lambda: False) -> None:
    """Subscribe to the run's metrics, events and sampled episodes as the observer until ``stop``; the state says
    whether the run has ended ("finished": `chorus up` wrote its summary; a server left running does not make an
    ended run live), the bus is there ("live"), gone ("bus gone") or never answered ("offline")."""
    from shared.kernel.bus import connect
    from shared.kernel.subjects import Names

    names = Names(cfg.run.id)
    try:
        nc = await asyncio.wait_for(connect(url, "chorus-dashboard", timeout_s=cfg.nats.connect_timeout_s,
                                            nats_cfg=cfg.nats, kind="observer"), cfg.nats.connect_timeout_s + 5)
    except Exception as exc:  # no server, refused credentials: the run directory is all there is
        feed.set_live("offline")
        feed.add([{"t": "note", "text": f"no NATS server at {url} ({type(exc).__name__}): showing the run directory"}])
        return
    try:
        async def on_msg(msg: Any) -> None:
            feed.on_message(msg.subject, msg.data, names.prefix)

        for subject in (names.metrics_all(), names.events_all(), names.samples()):
            await nc.subscribe(subject, cb=on_msg)
        await nc.flush()
        feed.set_live("finished" if ended() else "live")
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            feed.set_live("finished" if ended() else "live" if nc.is_connected else "bus gone")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)


# --- HTTP ----------------------------------------------------------------------------------------------------
async def serve(feed: Feed, host: str, port: int) -> asyncio.Server:
    """The page, its files, /api/state and /api/stream. GET only; every other path 404."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await read_request(reader)
            if method != "GET":
                await _respond(writer, "405 Method Not Allowed", "text/plain", b"GET only\n")
            elif path == "/api/stream":
                await _stream(feed, writer)
            elif path == "/api/state":
                body = json.dumps(feed.state.snapshot(), separators=(",", ":"), default=str).encode()
                await _respond(writer, "200 OK", "application/json", body)
            else:
                name = "index.html" if path in ("/", "") else path.lstrip("/")
                file = (STATIC / name).resolve()
                if STATIC.resolve() not in file.parents or not file.is_file():
                    await _respond(writer, "404 Not Found", "text/plain", b"not found\n")
                else:
                    ctype = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
                    await _respond(writer, "200 OK", ctype + ("; charset=utf-8" if ctype.startswith("text") or
                                                             ctype.endswith("javascript") else ""), file.read_bytes())
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that went away or sent no request
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def _respond(writer: asyncio.StreamWriter, status: str, ctype: str, body: bytes) -> None:
    writer.write((f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                  "Cache-Control: no-store\r\nConnection: close\r\n\r\n").encode() + body)
    await writer.drain()


async def _stream(feed: Feed, writer: asyncio.StreamWriter) -> None:
    q: asyncio.Queue[bytes | None] = asyncio.Queue(CLIENT_QUEUE)
    feed.clients.add(q)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
                 b"Connection: keep-alive\r\n\r\nretry: 2000\n\n")
    try:
        await writer.drain()
        while True:
            try:
                body = await asyncio.wait_for(q.get(), 15)
            except TimeoutError:
                body = b": keep-alive\n\n"
            if body is None:
                return
            writer.write(body)
            await writer.drain()
    finally:
        feed.clients.discard(q)


@dataclass
class Dashboard:
    """The state, the feed and the server of one run's dashboard (``chorus dashboard``, ``chorus up --dashboard``)."""

    cfg: Any
    url: str | None
    host: str = "127.0.0.1"
    port: int = 0
    run_dir: Path | None = None
    state: DashState = field(init=False)
    feed: Feed = field(init=False)
    server: asyncio.Server | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    pusher: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.state = DashState.for_config(self.cfg)
        self.feed = Feed(self.state)

    @property
    def address(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{port}/"

    async def start(self) -> Dashboard:
        run_dir = self.run_dir if self.run_dir is not None else Path(self.cfg.run_dir)
        if self.url:  # subscribe first, then read the files: what arrives in between is deduplicated
            summary = run_dir / SUMMARY
            self.tasks.append(asyncio.create_task(follow_bus(self.feed, self.cfg, self.url, self.stop,
                                                             ended=summary.is_file)))
        else:
            self.state.live = "offline"
        apply_run_dir(self.state, await asyncio.to_thread(read_run_dir, run_dir))
        self.feed.pending = [u for u in self.feed.pending if u["t"] in ("live", "note")]
        self.server = await serve(self.feed, self.host, self.port)
        self.pusher = asyncio.create_task(self.feed.push_loop())
        return self

    async def close(self) -> None:
        self.stop.set()
        if self.server is not None:
            self.server.close()
        for q in list(self.feed.clients):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)
        if self.pusher is not None:
            self.pusher.cancel()
        await asyncio.gather(*self.tasks, *([self.pusher] if self.pusher else []), return_exceptions=True)
