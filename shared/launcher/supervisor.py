"""``chorus up``: one run on one machine. Starts nats-server (unless configured), every service as its own
OS process, supervises them (a service that exits unexpectedly is restarted, a crash loop stops the run),
shows progress, stops everything cleanly and summarises the run. ``--resume`` continues a run directory after
the whole run was killed: the embedded server comes back on its store, every service from what it finds there."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue
from rich.console import Console
from rich.live import Live

from shared.kernel import events
from shared.kernel.bus import connect, ensure_run, kv_get_int
from shared.kernel.codec import DecodeError, decode_json
from shared.kernel.config import ChorusConfig, ConfigError, load_config
from shared.kernel.credentials import PASSWORD_PREFIX, password_env
from shared.kernel.memcap import (
    LAST_EXIT_ENV,
    MEMORY_GROUP_ENV,
    MEMORY_LIMIT_ENV,
    MemoryGroup,
    OutOfMemory,
    advice,
    machine_oom_kills,
    out_of_memory,
    rank_groups,
)
from shared.kernel.runbus import run_exists
from shared.kernel.service import EX_RUN_FAILED, START_WAIT_S
from shared.kernel.subjects import Names
from shared.launcher.dashboard import Dashboard, GaugeRecorder
from shared.launcher.deploy import unique_run_id
from shared.launcher.localauth import LocalAuth
from shared.launcher.natsserver import NatsServer, free_port
from shared.launcher.progress import ProgressView, RunTracker, make_console
from shared.launcher.runfiles import read_summary, write_summary
from shared.launcher.views import eval_line, report_tables
from shared.models.loading import smollm2_dir_if_ready
from shared.results.plotting import load_metrics, plot_run, plot_training

STOP_GRACE_S = 20.0
DRAIN_GRACE_S = 10.0  # the coordinator finishes the episodes in hand before it stops
READY_TIMEOUT_S = 120.0
PROGRESS_LINE_S = 10.0  # how often `chorus up` prints a progress line when stdout is not a terminal
TAIL_BYTES = 256 * 1024  # how much of a log Child.tail reads
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """One service process of a run."""

    service: str
    model: str | None = None
    instance: str = "0"

    @property
    def key(self) -> str:
        return f"{self.service}-{self.model}-{self.instance}" if self.model else f"{self.service}-{self.instance}"

    def argv(self, config: Path, nats_url: str) -> list[str]:
        cmd = [sys.executable, "-m", f"services.{self.service}", "--config", str(config), "--nats", nats_url,
               "--instance", self.instance]
        return cmd + (["--model", self.model] if self.model else [])


def plan_services(cfg: ChorusConfig) -> list[ChildSpec]:
    """Start order: actions; the training pool (train.pool.slots); per model mq, trainer (without a pool), rollouters,
    paramsync; the pool of rollouters (``rollouter.pool``,
    named pool<i>, started on :func:`pool_model`, moved by the rollout manager); MARFT's critic (train.loss
    marft); the coordinator last."""
    plan = [ChildSpec("actions")]
    pooled = cfg.train.pool.slots > 0  # one training pool runs every model's trainer
    if pooled:
        plan.append(ChildSpec("trainer"))
    for model, mcfg in cfg.models.items():
        plan.append(ChildSpec("mq", model))
        if not pooled:
            plan.append(ChildSpec("trainer", model))
        plan += [ChildSpec("rollouter", model, str(i)) for i in range(mcfg.rollouter.instances)]
        plan.append(ChildSpec("paramsync", model))
    plan += [ChildSpec("rollouter", pool_model(cfg), f"pool{i}") for i in range(cfg.rollouter.pool)]
    if cfg.marft_on:
        plan.append(ChildSpec("critic"))
    plan.append(ChildSpec("coordinator"))
    return plan


def memory_cap(cfg: ChorusConfig, spec: ChildSpec) -> int | None:
    """The memory cap in bytes of a service's process: a model's trainer with ``trainer.memory_mb``."""
    if spec.service != "trainer" or spec.model is None:
        return None
    mb = cfg.models[spec.model].trainer.memory_mb
    return None if mb is None else mb * 2**20


def report_out_of_memory(cfg: ChorusConfig, child: Child, counts: Counter[str],
                         console: Console) -> dict[str, str] | None:
    """Say, by model and with what to change, that the kernel's OOM killer ended a trainer (or a rank of its
    group); count it (summary.json) and return what the trainer's next start publishes (CHORUS_LAST_EXIT)."""
    found = child.out_of_memory()
    if not found:
        return None
    model = child.key.removeprefix("trainer-").rsplit("-", 1)[0] if child.key.startswith("trainer-") else None
    if model in cfg.models:
        t = cfg.models[model].trainer
        hint = advice(model, t.backend, t.deepspeed.ranks, t.deepspeed.zero_stage)
    else:
        model, hint = None, "give it more memory"
    counts[model or child.key] += len(found)
    for who, oom in found:
        console.print(f"[red]out of memory: {child.key}{f' (model {model})' if model else ''}: {who} was killed by "
                      f"the kernel's out-of-memory killer ({oom.evidence()}); {hint}", highlight=False)
    who, oom = found[0]
    return {LAST_EXIT_ENV: json.dumps({"out_of_memory": oom.as_dict(), "who": who, "evidence": oom.evidence(),
                                       "advice": hint, "count": counts[model or child.key]})}


def pool_model(cfg: ChorusConfig) -> str:
    """Where the pool starts: the model most of the workflow's agents use (the first named on ties)."""
    counts = Counter(cfg.agents[a].model for a in cfg.workflow.agents if a in cfg.agents)
    return max(sorted(cfg.models), key=lambda m: counts.get(m, 0))


def _die_with_parent() -> None:
    # Children live in their own session (Ctrl-C reaches only the supervisor, which stops them in order);
    # PDEATHSIG still takes them down if the supervisor itself is killed.
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    key: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    memory: MemoryGroup | None = None  # its cgroup memory group (models.<m>.trainer.memory_mb)
    machine_oom: int = 0  # the machine's OOM-kill count when it started

    def out_of_memory(self) -> list[tuple[str, OutOfMemory]]:
        """(who, evidence) for each of its processes the OOM killer ended: the child itself ("rank 0" of a group,
        or the process), and each rank of its DeepSpeed group in the groups beside its own (``<group>-rank<r>``,
        made new by each start of the group)."""
        if self.memory is None:
            oom = out_of_memory(self.popen.returncode, machine_before=self.machine_oom)
            return [("the process", oom)] if oom is not None else []
        found = []
        oom = out_of_memory(self.popen.returncode, self.memory)
        if oom is not None:
            found.append(("the process" if not rank_groups(self.memory) else "rank 0", oom))
        for rank, group in rank_groups(self.memory):
            kills = group.oom_kills()
            if kills:
                found.append((f"rank {rank}", OutOfMemory(group.limit(), kills, group.failcnt(), group.max_usage(),
                                                          None)))
        return found

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The log's last ``lines`` lines (read from its last 256 KiB: a log may be large)."""
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Supervisor:
    """Starts child processes with their output in ``log_dir/<key>.log`` and stops them (TERM, then KILL)."""

    log_dir: Path
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    # kind -> NATS password (the embedded server's generated credentials): each child gets only its own kind's,
    # as CHORUS_NATS_PASSWORD_<KIND>, and none of the others'
    passwords: Mapping[str, str] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)
    stopped: dict[str, Child] = field(default_factory=dict)  # stopped one by one (stop_one) before the end
    stopping: bool = False
    memory_bytes: dict[str, int | None] = field(default_factory=dict)  # key -> its memory cap
    run: str = ""

    def remove_groups(self) -> None:
        """The memory groups of the children, once every child has exited."""
        for c in [*self.stopped.values(), *self.children.values()]:
            if c.memory is not None and not c.alive():
                for _, g in rank_groups(c.memory):
                    g.remove(parents=False)
                c.memory.remove()

    def start(self, key: str, argv: Sequence[str], memory_bytes: int | None = None, run: str = "",
              env: Mapping[str, str] | None = None) -> Child:
        """Start one child; must be called from the main thread (PDEATHSIG follows the creating thread). With
        ``memory_bytes`` it runs in a memory group of its own (``chorus/<run>/<key>``, made new) with that limit,
        entered before it runs anything; its DeepSpeed ranks make theirs beside it (``CHORUS_MEMORY_GROUP``)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{key}.log"
        group = None
        child_env = {**self.env_of(key), **(env or {})}
        if memory_bytes is not None:
            group = MemoryGroup.for_process(run, key).create(memory_bytes, fresh=True)
            for _, stale in rank_groups(group):
                stale.remove(parents=False)
            child_env |= {MEMORY_GROUP_ENV: str(group.path), MEMORY_LIMIT_ENV: str(memory_bytes)}

        def preexec() -> None:
            _die_with_parent()
            if group is not None:
                group.enter()

        machine = machine_oom_kills()
        with open(log, "ab") as fh:
            popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, env=child_env,
                                     stdin=subprocess.DEVNULL, preexec_fn=preexec)
        child = Child(key, list(argv), log, popen, group, machine)
        self.children[key] = child
        self.memory_bytes[key] = memory_bytes
        self.run = run or self.run
        return child

    def env_of(self, key: str) -> dict[str, str]:
        """The environment of child ``key`` (``<kind>-...``): with generated passwords, its kind's only."""
        if not self.passwords:
            return dict(self.env)
        kind = key.split("-", 1)[0]
        env = {k: v for k, v in self.env.items() if not k.startswith(PASSWORD_PREFIX)}
        if kind in self.passwords:
            env[password_env(kind)] = self.passwords[kind]
        return env

    def exited(self) -> list[Child]:
        """Children that have exited while the run was not stopping (any exit code is unexpected)."""
        if self.stopping:
            return []
        return [c for c in self.children.values() if not c.alive()]

    def restart(self, child: Child, env: Mapping[str, str] | None = None) -> Child:
        """Start an exited child again with the same command line and memory cap (its log goes on in the same
        file); ``env``: what it is told besides (CHORUS_LAST_EXIT)."""
        return self.start(child.key, child.argv, self.memory_bytes.get(child.key), self.run, env)

    async def stop_one(self, key: str, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM one child while the others run on (it is not restarted), SIGKILL after ``grace_s``."""
        child = self.children.pop(key)
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(child.popen.wait), grace_s)
            except TimeoutError:
                child.popen.kill()
                await asyncio.to_thread(child.popen.wait)
        self.stopped[key] = child
        return int(child.popen.returncode)

    async def stop_all(self, grace_s: float = STOP_GRACE_S) -> dict[str, int]:
        """SIGTERM every child, wait up to ``grace_s``, SIGKILL the rest; returns exit codes per key."""
        self.stopping = True
        for c in self.children.values():
            if c.alive():
                with contextlib.suppress(ProcessLookupError):
                    c.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(c.alive() for c in self.children.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for c in self.children.values():
            if c.alive():
                with contextlib.suppress(ProcessLookupError):
                    c.popen.kill()
                await asyncio.to_thread(c.popen.wait)
        return {k: int(c.popen.returncode) for k, c in {**self.stopped, **self.children}.items()}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; empty where there is none): a run's services, its broker."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@contextlib.contextmanager
def env_override(**values: str) -> Iterator[None]:
    """Temporarily set environment variables (the config loader reads ``CHORUS_*`` from os.environ)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def ping_run(nc: NATS, run: str, service: str | None = None, window_s: float = 0.5) -> list[dict[str, Any]]:
    """Collect ``$SRV.PING`` answers of one run's services for ``window_s`` seconds."""
    answers: list[dict[str, Any]] = []
    inbox = nc.new_inbox()

    async def on_reply(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            data = json.loads(msg.data)
            if isinstance(data, dict) and (data.get("metadata") or {}).get("run") == run:
                answers.append(data)

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(Names.srv_ping(service), b"", reply=inbox)
    await asyncio.sleep(window_s)
    await sub.unsubscribe()
    return answers


def _ready(answers: list[dict[str, Any]], expected: Counter[str]) -> bool:
    seen = Counter(str(a.get("name", "")).removeprefix("chorus-") for a in answers)
    return all(seen[svc] >= n for svc, n in expected.items())


@dataclass
class Restarts:
    """When a child that exited is started again, and when exits come too fast to be a passing fault."""

    max_restarts: int
    window_s: float
    delay_s: float
    times: dict[str, list[float]] = field(default_factory=dict)  # key -> exit times within the window
    due: dict[str, float] = field(default_factory=dict)  # key -> when to start it again

    def exited(self, key: str, now: float) -> bool:
        """Note an exit; False when it is one exit too many (a crash loop)."""
        recent = [t for t in self.times.get(key, []) if now - t <= self.window_s] + [now]
        self.times[key] = recent
        if len(recent) > self.max_restarts:
            return False
        self.due[key] = now + self.delay_s
        return True

    def ready(self, now: float) -> list[str]:
        """Keys whose restart is due; each is returned once."""
        keys = [k for k, t in self.due.items() if t <= now]
        for k in keys:
            del self.due[k]
        return keys


def resolve_run(config_path: Path, run_id: str | None = None) -> ChorusConfig:
    """Load the config with a unique run id (``<run.id>-<YYYYmmdd-HHMMSS>``, or ``run_id`` as given) and an
    absolute run dir."""
    base = load_config(config_path)
    overrides = {"CHORUS_RUN__ID": run_id or unique_run_id(base.run.id),
                 "CHORUS_RUN__DIR": str(base.run.dir.resolve())}
    with env_override(**overrides):
        return load_config(config_path)


def resume_run(run_dir: Path) -> tuple[ChorusConfig, bool]:
    """The config of a run directory written by ``chorus up``, and whether its broker was the embedded one
    (its store is ``<run_dir>/nats``)."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: --resume takes a run directory that `chorus up` wrote "
                          "(runs/<run-id>)")
    cfg = load_config(config_file)
    return cfg, (run_dir / "nats" / "jetstream").is_dir()


def _port_of(url: str | None) -> int | None:
    try:
        port = int(str(url).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    return port if _port_free(port) else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def child_env(cfg: ChorusConfig) -> dict[str, str]:
    """Environment of every service: the resolved run id and dir win over anything in the YAML; the NATS secrets
    that config.yaml leaves out (nats.password, nats.token) are passed here."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **cfg.secret_env(), "CHORUS_RUN__ID": cfg.run.id, "CHORUS_RUN__DIR": str(cfg.run.dir),
            "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def check_backends_installed(cfg: ChorusConfig) -> None:
    """Refuse a run whose rollouters or trainers this environment cannot start (before any service does), naming the fix."""
    import importlib.util

    vllm = sorted(m for m, mc in cfg.models.items() if mc.rollouter.backend == "vllm")
    if vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"models.{vllm[0]}.rollouter.backend is vllm, but vllm is not installed in this environment "
                          f"({sys.executable}): `make venv-vllm` builds .venv-vllm with it; run "
                          "`.venv-vllm/bin/chorus up ...`")
    deepspeed = sorted(m for m, mc in cfg.models.items() if mc.trainer.backend == "deepspeed")
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(f"models.{deepspeed[0]}.trainer.backend is deepspeed, but deepspeed is not installed in this "
                          f"environment ({sys.executable}): `make venv-deepspeed` adds it (pip install "
                          "'chorus[deepspeed]'), or set backend: torch")


async def run_up(config_path: Path | None, *, timeout_s: float | None = None, console: Console | None = None,
                 resume: Path | None = None, run_id: str | None = None, dashboard: tuple[str, int] | None = None) -> int:
    """Run a whole config to ``train.max_versions``, or continue the run in directory ``resume``. A new run whose
    id already has streams or buckets on the server is refused (exit 1): resume it, or ``chorus clean`` it.
    ``dashboard`` (host, port): serve ``chorus dashboard``'s page for the run while it runs. The services' gauges
    go to ``<run dir>/gauges.jsonl`` every few seconds (the dashboard of the finished run draws them).
    Exit code: 0 done, 1 failure/timeout/refused, 130 interrupted."""
    console = console or make_console()
    started = time.time()
    embedded = False
    if resume is not None:
        cfg, embedded = resume_run(resume)
        console.print(f"resuming run [bold]{cfg.run.id}[/] in {cfg.run_dir}")
    else:
        assert config_path is not None
        cfg = resolve_run(config_path, run_id)
        embedded = not cfg.nats.url
        console.print(f"run [bold]{cfg.run.id}[/] in {cfg.run_dir}")
    check_backends_installed(cfg)
    names = Names(cfg.run.id)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    server: NatsServer | None = None
    url = cfg.nats.url
    auth = LocalAuth.generate() if embedded and cfg.nats.embedded_auth else None
    own_nats = cfg.nats
    if embedded:
        # Started from this (the main) thread: it dies with `chorus up` however that ends.
        server = NatsServer(run_dir / "nats", max_payload_mb=cfg.nats.max_payload_mb,
                            port=_port_of(url) if resume is not None else None,
                            auth=auth.conf() if auth else None, env=auth.server_env() if auth else None,
                            sync_always=cfg.nats.sync_always, websocket_port=free_port())
        server.start()
        url = server.url
        if auth is not None:  # the password files first: whoever reads the server's address may use them at once
            auth.apply(cfg, run_dir)
            own_nats = auth.as_kind(cfg.nats, "supervisor")
        console.print(f"embedded nats-server at {url} (WebSocket {server.websocket_url}; log {server.log_file})",
                      highlight=False)
        if auth is not None:
            console.print(f"a password per service kind; the read-only observer's is in {run_dir}/nats/observer.password"
                          " (user observer)", highlight=False)
    assert url, "no broker: neither nats.url nor an embedded server"  # embedded is `not cfg.nats.url`
    cfg.nats.url = url  # so that `chorus status --config <run_dir>/config.yaml` finds the live run
    config_file = run_dir / "config.yaml"  # written once the run id is known to be new (or resumed)

    sup = Supervisor(run_dir / "logs", env=child_env(cfg), passwords=auth.passwords if auth else {})
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals: list[int] = []

    def on_signal(sig: int) -> None:
        signals.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    nc: NATS | None = None
    tracker: RunTracker | None = None
    recorder: GaugeRecorder | None = None
    dash: Dashboard | None = None
    background: list[asyncio.Task[None]] = []
    oom_counts: Counter[str] = Counter()  # model -> processes of its trainer the OOM killer ended
    code = 1
    try:
        nc = await connect(url, "chorus-up", timeout_s=cfg.nats.connect_timeout_s, nats_cfg=own_nats,
                           kind="supervisor")
        if resume is None and await _run_exists(nc, cfg.run.id):
            # a new run never inherits another's KV versions, streams or objects
            console.print(f"[red]run {cfg.run.id} already exists on the NATS server at {url}: continue it with "
                          f"`chorus up --resume {run_dir}`, or remove it first with `chorus clean {cfg.run.id} "
                          f"--config {config_path}`")
            return 1
        config_file.write_text(cfg.dump_yaml())
        kv, _ = await ensure_run(nc.jetstream(timeout=10.0), cfg)  # before any child: no creation races
        tracker = RunTracker.for_models(list(cfg.models), cfg.train.max_versions)
        if resume is not None:  # the summary counts every sample trained since the run started
            tracker.seed(load_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else [],
                         read_summary(run_dir))

        async def on_event(msg: Msg) -> None:
            with contextlib.suppress(DecodeError):
                tracker.on_event(decode_json(msg.data))

        await nc.subscribe(names.events("trainer"), cb=on_event)
        await nc.subscribe(names.events("mq"), cb=on_event)  # drop records
        evals: list[dict[str, Any]] = []

        async def on_coordinator(msg: Msg) -> None:
            with contextlib.suppress(DecodeError):
                ev = decode_json(msg.data)
                if isinstance(ev, dict) and ev.get("kind") == "eval":
                    evals.append(ev)
                    console.print(eval_line(ev))
                elif isinstance(ev, dict) and ev.get("kind") == events.WARNING and isinstance(ev.get("text"), str):
                    console.print(f"warning: {ev['text']}", style="yellow", markup=False, highlight=False)

        await nc.subscribe(names.events("coordinator"), cb=on_coordinator)
        recorder = GaugeRecorder(run_dir)

        async def on_metrics(msg: Msg) -> None:
            with contextlib.suppress(DecodeError):
                m = decode_json(msg.data)
                recorder.on_metrics(m)
                tracker.on_metrics(m)

        await nc.subscribe(names.metrics_all(), cb=on_metrics)
        background.append(asyncio.create_task(_flush_every(recorder, GAUGES_FLUSH_S)))
        if dashboard is not None:
            dash = Dashboard(cfg, url, host=dashboard[0], port=dashboard[1], run_dir=run_dir)
            try:
                await dash.start()
                console.print(f"dashboard at {dash.address} (live while the run is; after it: `chorus dashboard "
                              f"{run_dir}`)", highlight=False)
            except OSError as exc:
                console.print(f"[yellow]no dashboard: cannot listen on {dashboard[0]}:{dashboard[1]}: {exc}")
                dash = None
        code = await _supervise(cfg, nc, kv, sup, tracker, config_file, url, stop, timeout_s, console, oom_counts)
        if code == 0 and cfg.eval.every:
            code = await _await_last_eval(evals, cfg.eval.final_timeout_s, stop, console)
        if code == 0:
            await _settle(cfg, nc, sup, console)
        if code == 130 and signals and signals[-1] == signal.SIGTERM:
            code = 143
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if recorder is not None:
            await asyncio.to_thread(recorder.flush)
        if dash is not None:
            await dash.close()
        console.print("stopping services ...")
        codes = await sup.stop_all()
        sup.remove_groups()
        bad = {k: c for k, c in codes.items() if c not in (0, -signal.SIGTERM)}
        if bad and code == 0:
            console.print(f"[yellow]services that did not exit cleanly: {bad}")
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5)
        if server is not None:
            await asyncio.to_thread(server.stop)
    _report(run_dir, console)
    if tracker is not None:
        for line in tracker.sample_lines():
            console.print(line)
        write_summary(run_dir, code=code, started=started, models={m: {"version": p.version, "trained": p.trained,
                                                      "dropped": dict(p.dropped), "out_of_memory": oom_counts[m]}
                                                      for m, p in tracker.models.items()},
                      coordinator_dropped=tracker.coordinator_total())
        console.print(f"`chorus status {run_dir}` reads the results from the run directory once the run's "
                      f"server is gone; `chorus samples {run_dir}` shows what the agents said", highlight=False)
    if code in (130, 143):  # interrupted: every committed version is kept
        console.print(f"interrupted at the versions above; continue the run with `chorus up --resume {run_dir}`",
                      style="yellow", highlight=False, markup=False)
    return code


GAUGES_FLUSH_S = 5.0  # gauges.jsonl is appended this often


async def _flush_every(recorder: GaugeRecorder, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(recorder.flush)


async def _run_exists(nc: NATS, run: str) -> bool:
    """Whether the server holds anything of ``run``, asked until JetStream answers (a cluster that just started
    is still electing its meta leader) for up to ``START_WAIT_S``."""
    deadline = time.monotonic() + START_WAIT_S
    while True:
        try:
            return await run_exists(nc.jetstream(timeout=5.0), run)
        except (NatsError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def _await_last_eval(evals: list[dict[str, Any]], timeout_s: float, stop: asyncio.Event,
                           console: Console) -> int:
    """After the last version: wait for the coordinator's evaluation of the final weights."""
    console.print("waiting for the held-out evaluation of the final weights ...")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.get("last") for e in evals):
            return 0
        if stop.is_set():
            return 130
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    console.print(f"[red]no evaluation of the final weights within {timeout_s:.0f}s")
    return 1


async def _supervise(cfg: ChorusConfig, nc: NATS, kv: KeyValue, sup: Supervisor, tracker: RunTracker,
                     config_file: Path, url: str, stop: asyncio.Event, timeout_s: float | None,
                     console: Console, oom_counts: Counter[str]) -> int:
    plan = plan_services(cfg)
    restarts = Restarts(cfg.run.max_restarts, cfg.run.restart_window_s, cfg.run.restart_delay_s)
    last_exit: dict[str, dict[str, str] | None] = {}  # key -> what its next start is told of its last exit
    first, last = [s for s in plan if s.service != "coordinator"], [s for s in plan if s.service == "coordinator"]
    for spec in first:
        sup.start(spec.key, spec.argv(config_file, url), memory_cap(cfg, spec), cfg.run.id)
    console.print(f"started {len(first)} services; logs in {sup.log_dir}")
    console.print("starting: each service imports its libraries and loads its model"
                  + ("; the embedded SmolLM2 is dequantised into runs/_cache first (once, about 30 s)"
                     if any(m.source == "smollm2" for m in cfg.models.values())
                     and smollm2_dir_if_ready(cfg.cache_dir) is None else ""),
                  highlight=False)
    expected = Counter(s.service for s in first)
    started_at = time.monotonic()
    coordinator_started = False
    view = ProgressView(tracker)
    next_kv = 0.0
    # a terminal gets live bars; a log file or a container's stdout gets a line every PROGRESS_LINE_S instead
    bars = console.is_terminal
    next_line, last_line = 0.0, ""
    with Live(view.progress, console=console, refresh_per_second=4, transient=False) if bars \
            else contextlib.nullcontext():
        while True:
            now = time.monotonic()
            for c in sup.exited():
                if c.key in restarts.due:
                    continue  # already waiting for its restart
                last_exit[c.key] = report_out_of_memory(cfg, c, oom_counts, console)
                if c.popen.returncode == EX_RUN_FAILED:
                    console.print(f"[red]service {c.key} stopped the run (exit {EX_RUN_FAILED}: restarting it cannot "
                                  f"help); last lines of {c.log}:[/]\n{c.tail()}")
                    return 1
                if not restarts.exited(c.key, now):
                    console.print(f"[red]service {c.key} exited unexpectedly with code {c.popen.returncode}, "
                                  f"{len(restarts.times[c.key])} times within {cfg.run.restart_window_s:.0f}s "
                                  f"(run.max_restarts {cfg.run.max_restarts}); last lines of {c.log}:[/]\n{c.tail()}")
                    return 1
                console.print(f"[yellow]service {c.key} exited unexpectedly with code {c.popen.returncode}; "
                              f"restarting it in {cfg.run.restart_delay_s:g}s (last lines of {c.log}):[/]\n"
                              f"{c.tail(5)}")
            for key in restarts.ready(now):
                sup.restart(sup.children[key], last_exit.pop(key, None))
            if stop.is_set():
                console.print("[yellow]interrupted")
                return 130
            if timeout_s is not None and time.monotonic() - started_at > timeout_s:
                console.print(f"[red]run did not finish within {timeout_s:.0f}s")
                return 1
            if not coordinator_started:
                answers = await ping_run(nc, cfg.run.id, window_s=0.3)
                late = time.monotonic() - started_at > READY_TIMEOUT_S
                if _ready(answers, expected) or late:
                    if late:
                        console.print("[yellow]not every service answered a ping in time; starting the coordinator")
                    else:
                        console.print(f"every service is up after {time.monotonic() - started_at:.0f}s; starting the "
                                      "coordinator" + (f", which first evaluates version 0 on {cfg.eval.tasks} held-out "
                                                       "tasks" if cfg.eval.every and not any(
                                                           tracker.models[m].version for m in tracker.models) else ""),
                                      highlight=False)
                    for spec in last:
                        sup.start(spec.key, spec.argv(config_file, url))
                    coordinator_started = True
            if time.monotonic() >= next_kv:
                next_kv = time.monotonic() + 1.0
                for m in cfg.models:
                    tracker.on_trained_version(m, await kv_get_int(kv, Names.trained_key(m)))
            view.refresh()
            if not bars and (time.monotonic() >= next_line or tracker.finished):
                line = view.log_line()
                if line != last_line or time.monotonic() >= next_line:
                    console.print(line, highlight=False)
                last_line, next_line = line, time.monotonic() + PROGRESS_LINE_S
            if tracker.finished:
                console.print("[green]every model reached train.max_versions")
                return 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


SETTLE_S = 30.0  # how long a finished run waits for its streams to empty


async def _settle(cfg: ChorusConfig, nc: NATS, sup: Supervisor, console: Console) -> None:
    """Close the books of a finished run: stop the coordinator (it publishes the samples of the tasks it has in
    hand), then wait until mq and the trainers have dropped what is left in the streams as finished, so every
    sample the run published is trained or recorded as dropped."""
    names = Names(cfg.run.id)
    for key in [k for k in sup.children if k.startswith("coordinator-")]:
        await sup.stop_one(key, STOP_GRACE_S + DRAIN_GRACE_S)
    js = nc.jetstream(timeout=5.0)
    streams = [s for m in cfg.models for s in (names.traj_stream(m), names.ready_stream(m))]
    deadline = time.monotonic() + SETTLE_S
    left = -1
    while time.monotonic() < deadline:
        try:
            left = sum([(await js.stream_info(s)).state.messages for s in streams])
        except Exception:  # noqa: BLE001 - the books are best effort once the run is done
            left = -1
        if left == 0:
            return
        await asyncio.sleep(0.5)
    console.print(f"[yellow]{left} messages still in the streams after {SETTLE_S:.0f}s; stopping anyway")


def _report(run_dir: Path, console: Console) -> None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        console.print(f"[yellow]no {metrics}: no step was recorded")
        return
    try:
        png = plot_run(metrics, run_dir / "reward.png")
        console.print(f"reward plot: {png}")
        console.print(f"training plot: {plot_training(metrics, run_dir / 'training.png')}")
    except ValueError as exc:
        console.print(f"[yellow]no plot: {exc}")
    for table in report_tables(metrics):
        console.print(table)
