"""A two-model tiny run as separate processes, with faults injected and the invariants checked at the end.

A fault is SIGKILL of one process (restarted ``restart_after_s`` later, as systemd or Kubernetes would), SIGSTOP
of one process for longer than its timeouts (then SIGCONT), or either of those on a nats-server node. The harness
also restarts a process that dies by itself, and counts it: a fault must cost time, never a crash elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import yaml

from shared.launcher.natsserver import NatsCluster, NatsServer
from shared.launcher.supervisor import STOP_GRACE_S
from tests.conftest import ROOT
from tests.e2e.cluster import Cluster
from tests.faults.ledger import CriticReport, Ledger, ModelReport, violations
from tests.waits import WAIT_S

MODELS = ["solver_lm", "verifier_lm"]
MARFT_MODELS = ["reasoner_lm", "actor_lm"]  # configs/marft-tiny.yaml
SERVICE_KINDS = ("coordinator", "actions", "mq", "trainer", "rollouter", "paramsync", "critic")
HOST = "host"  # cut: a host of a deployment with hosts, cut off from the others by the network
EVERYTHING = "all"  # every service process at once (term: the whole stack stopped in the middle of a sync)
SLOT = "slot"  # a training pool's slot worker (train.pool.slots), killed in the middle of a micro-batch
POOL_MODELS = ["planner_lm", "solver_lm", "checker_lm", "answer_lm"]  # configs/pool-tiny.yaml
PER_MODEL_KINDS = ("mq", "trainer", "rollouter", "paramsync")  # one process per model; the others serve all
# SIGTERM lands while the target is in the middle of its work, as seen in its status reply: paramsync inside a sync,
# a trainer with micro-batches accumulated towards a step, mq holding samples, a rollouter generating, the coordinator
# and actions with episodes and actions in flight.
BUSY: dict[str, Callable[[dict[str, Any]], bool]] = {
    "paramsync": lambda s: s.get("syncing") is not None,
    "trainer": lambda s: s.get("accumulated", 0) > 0,
    "mq": lambda s: s.get("held", 0) > 0,
    "rollouter": lambda s: s.get("in_flight", 0) + s.get("queued", 0) > 0,
    "coordinator": lambda s: s.get("in_flight", 0) > 0,
    "actions": lambda s: s.get("in_flight", 0) > 0,
    "committing": lambda s: s.get("committing") is not None,  # a trainer between its step and its commit point
}
# The shortest stop grace of the deployments: `chorus up`'s (compose, systemd and Kubernetes give 45 s). A process
# SIGTERMed by the harness that has not exited by then is SIGKILLed, as `chorus up` would: its exit code says so.
TERM_GRACE_S = STOP_GRACE_S
LAGGING = "(lagging)"  # a Fault's model: whichever is furthest from the end, so the fault lands mid-run


async def follower_pid(parent: int, rank: int, timeout_s: float = 60.0) -> int:
    """The pid of rank ``rank`` of the DeepSpeed trainer group whose rank 0 is process ``parent`` (once it runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                args = (proc / "cmdline").read_bytes().split(b"\0")
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == parent and b"services.trainer.zero" in args and args[args.index(
                        b"services.trainer.zero") + 3] == str(rank).encode():
                    return int(proc.name)
        await asyncio.sleep(0.2)
    raise AssertionError(f"no rank {rank} under trainer process {parent} within {timeout_s:.0f}s")


def fault_config(tmp_path: Path, run_id: str, *, max_versions: int, replicas: int = 1, concurrency: int = 8,
                 transport: str = "auto") -> Path:
    """configs/tiny-chain.yaml with timeouts short enough that a fault shows within seconds."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0, "restart_delay_s": 1.0}
    cfg.pop("nats", None)
    # the ledger watches from outside the kinds' permissions (every sample, every rollouter's control subject), so
    # an embedded server (the resume tests) is left open
    cfg["nats"] = {"replicas": replicas, "embedded_auth": False}
    for m in cfg["models"].values():
        m["rollouter"]["request_timeout_s"] = 10.0
    cfg["workflow"]["concurrency"] = concurrency
    cfg["train"].update({"max_versions": max_versions, "global_batch": 32, "micro_batch": 16,
                         "checkpoint_every": 0, "ack_wait_s": 10.0})
    cfg["paramsync"].update({"transport": transport, "pause_timeout_s": 5.0, "load_timeout_s": 10.0})
    cfg["peers"] = {"probe_interval_s": 0.5, "probe_timeout_s": 1.0, "misses": 3, "accept_timeout_s": 3.0}
    cfg["metrics_interval_s"] = 1.0
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def shipped_fault_config(tmp_path: Path, run_id: str, name: str, *, max_versions: int,
                         patch: dict[str, dict[str, Any]] | None = None) -> Path:
    """configs/<name>.yaml, its own models and batch sizes, with the fault config's timeouts; ``patch``: keys set in
    its sections."""
    cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0, "restart_delay_s": 1.0}
    cfg.pop("nats", None)
    for m in cfg["models"].values():
        m["rollouter"]["request_timeout_s"] = 10.0
    cfg["train"].update({"max_versions": max_versions, "checkpoint_every": 0, "ack_wait_s": 10.0})
    cfg["paramsync"] = {"pause_timeout_s": 5.0, "load_timeout_s": 10.0}
    cfg["peers"] = {"probe_interval_s": 0.5, "probe_timeout_s": 1.0, "misses": 3, "accept_timeout_s": 3.0}
    cfg["metrics_interval_s"] = 1.0
    for section, values in (patch or {}).items():
        cfg[section].update(values)
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def pool_fault_config(tmp_path: Path, run_id: str, *, max_versions: int) -> Path:
    """configs/pool-tiny.yaml (four models, a training pool of two slots) with the fault config's timeouts."""
    return shipped_fault_config(tmp_path, run_id, "pool-tiny", max_versions=max_versions)


def marft_fault_config(tmp_path: Path, run_id: str, *, max_versions: int) -> Path:
    """configs/marft-tiny.yaml (MARFT: a critic service, agent-by-agent steps) with the fault config's timeouts."""
    # agent by agent: a model that is not selected takes a null step
    return shipped_fault_config(tmp_path, run_id, "marft-tiny", max_versions=max_versions,
                                patch={"marft": {"agent_interval": 1}})


@dataclass
class Broker:
    """One nats-server, or a three-node cluster; nodes are killed, frozen and restarted by index."""

    nodes: list[NatsServer]
    cluster: NatsCluster | None = None

    @classmethod
    def single(cls, store: Path) -> Broker:
        return cls([NatsServer(store).start()])

    @classmethod
    def three(cls, store: Path) -> Broker:
        c = NatsCluster(store, 3).start()
        return cls(c.nodes, c)

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@dataclass
class Fault:
    """One injected fault: ``target`` is a service kind or ``nats``, ``action`` ``kill``, ``stop`` or ``term``
    (SIGTERM in the middle of the target's work, see :data:`BUSY`: it must exit 0, not be SIGKILLed at the end of
    :data:`TERM_GRACE_S` as a supervisor would)."""

    target: str
    action: str
    at_version: int = 0  # injected once the target model's trained version reaches this
    model: str = MODELS[0]  # LAGGING: the model furthest behind once every model reached ``at_version``
    node: int = 0  # which broker node (target nats)
    instance: str = "0"  # which instance of the service (a rollouter: the first found with requests in flight)
    down_s: float = 5.0  # kill: restarted this much later (< 0: never); stop: frozen this long
    rank: int = 0  # a DeepSpeed trainer group (trainer.backend deepspeed): the rank killed (0: the service itself)
    host: str = ""  # cut: the host cut off from the others (a deployment with hosts: tests/hosts/)
    port: int | None = None  # cut: only TCP to or from this port (6222: a NATS node's routes)
    when: str = ""  # cut: a key of :data:`BUSY` on ``model``'s service of that kind: cut at such a moment
    healed_at: dict[str, int] = field(default_factory=dict)  # cut: trained version of every model at the heal
    cut_at: float = 0.0  # cut: wall time of the cut
    ended_at: float = 0.0  # wall time the process or node was back (restarted, thawed; killed for good: the kill)
    landed_at: dict[str, int] = field(default_factory=dict)  # trained version of every model when it was injected
    end_then: int = 0  # the run's train.max_versions when it was injected (the harness may move it on later)
    recovered_s: float = 0.0  # from then until every model trained a sample generated after it
    stop_s: float = 0.0  # term: seconds from SIGTERM to the exit
    exit_code: int | None = None  # term: the exit code
    busy: str = ""  # term: what the target was doing when the signal came

    @property
    def name(self) -> str:
        if self.action == "cut":
            return f"cut {self.host}" + (f" port {self.port}" if self.port else "") + (f" ({self.when})"
                                                                                      if self.when else "")
        where = f"node {self.node}" if self.target == "nats" else self.target
        return f"{self.action} {where}" + (f" rank {self.rank}" if self.rank else "")

    @property
    def per_model(self) -> bool:
        """The target serves one model (``model``); a shared service or the broker serves every model."""
        return self.target in PER_MODEL_KINDS


@dataclass
class Outcome:
    faults: list[Fault]
    reports: dict[str, ModelReport]
    problems: list[str]
    unexpected_exits: list[str]
    seconds: float
    paused: list[str] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # the max_versions the harness moved the run's end to, in turn


class FaultRun:
    """Runs a config to ``max_versions`` through faults; :meth:`run` returns what happened and what broke."""

    def __init__(self, tmp_path: Path, run_id: str, broker: Broker, config: Path, *, max_versions: int,
                 seed: int = 0, rollouters: int = 1, models: list[str] | None = None, critic: bool = False,
                 pool: bool = False, cluster: Any = None, ledger_url: str | None = None,
                 ledger_options: dict[str, Any] | None = None) -> None:
        self.tmp_path, self.run_id, self.broker, self.config = tmp_path, run_id, broker, config
        self.models = list(models or MODELS)  # the config's models (tiny-chain's by default)
        self.critic = critic  # a MARFT run: its critic is started, and its samples accounted for
        self.critic_report: CriticReport | None = None
        self.pool = pool  # train.pool.slots: one training pool process runs every model's trainer
        self.pool_status: dict[str, Any] = {}  # its metrics snapshot once the run finished
        self.critic_status: dict[str, Any] = {}
        self.max_versions = max_versions
        self.planned = max_versions  # the run's first length; each hold of its end adds as much again
        # A model this close to the end while a fault is still to land: the end is held (:meth:`_hold_end`). Room for
        # the versions trained between a look and the fault's landing, and for its recovery after.
        self.hold_margin = max(2, max_versions // 4)
        self.held: list[int] = []
        self._hold_looked = 0.0
        self._hold_for: Fault | None = None  # the fault still to land or to recover: its models hold the end
        self._statuses_before_holds: list[dict[str, dict[str, Any]]] = []  # counters of processes a hold ended
        self.rollouters = rollouters  # instances per model; a fault on the rollouter hits one with work in flight
        self.coordinator_status: dict[str, Any] = {}  # its metrics snapshot once the run finished
        self.rng = random.Random(seed)
        # the service processes: local ones, or another deployment of the same shape (tests/hosts/deployment.py)
        self.cluster = cluster if cluster is not None else Cluster(config, broker.url, tmp_path / "logs")
        self.ledger = Ledger(run_id, self.models, ledger_url or broker.url, critic=critic, options=ledger_options)
        self.deadline = float("inf")  # monotonic time by which :meth:`run` must be done (its timeout_s)
        self.intended: set[str] = set()  # keys killed on purpose (not unexpected exits)
        self.unexpected: list[str] = []
        self.log: list[str] = []

    # --- processes ------------------------------------------------------------------------
    def _key(self, fault: Fault) -> str:
        return f"{fault.target}-{fault.model}-{fault.instance}" if fault.per_model else f"{fault.target}-{fault.instance}"

    def _start(self, key: str) -> None:
        service, *rest = key.split("-")
        if len(rest) == 1:
            self.cluster.start(service, instance=rest[0])
        else:
            self.cluster.start(service, rest[0], rest[1])

    async def _watch_exits(self) -> None:
        """Restart what dies by itself (after the configured delay), counting it."""
        while True:
            await asyncio.sleep(0.5)
            for c in list(self.cluster.sup.children.values()):
                if not c.alive() and c.key not in self.intended:
                    self.unexpected.append(f"{c.key} exited with {c.popen.returncode}: {c.tail(5)}")
                    self._start(c.key)

    # --- faults ---------------------------------------------------------------------------
    async def _inject(self, fault: Fault) -> None:
        if fault.target == SLOT:
            before = await self._kill_slot(fault)
        elif fault.target == "nats":
            before = await self.ledger.trained()  # read while the node is up
            fault.landed_at, fault.end_then = dict(before), self.max_versions
            self.log.append(f"{time.strftime('%H:%M:%S')} {fault.name} at {before}")
            node = self.broker.nodes[fault.node]
            if fault.action == "kill":
                node.kill()
                if fault.down_s >= 0:
                    await asyncio.sleep(fault.down_s)
                    node.start()
            else:
                node.signal(signal.SIGSTOP)
                await asyncio.sleep(fault.down_s)
                node.signal(signal.SIGCONT)
        elif fault.action == "cut":
            before = await self._cut(fault)
        elif fault.action == "term" and fault.target == EVERYTHING:
            before = await self._terminate_all(fault)
        elif fault.action == "term":
            before = await self._terminate(fault)
        else:
            if fault.target == "rollouter" and fault.action == "kill":
                # hit one with requests in flight: they must run again elsewhere (held stopped while that is checked)
                fault.instance = await self._stopped_busy_instance(fault.model)
            elif fault.target == "rollouter":
                fault.instance = await self._busy_instance(fault.model)  # signalled the moment it is seen busy
            key = self._key(fault)
            child = self.cluster.sup.children[key]
            if fault.action == "kill":
                self.intended.add(key)
            if fault.rank:  # a follower rank: the service (rank 0) sees it gone and exits, and is started again
                os.kill(await follower_pid(child.popen.pid, fault.rank), signal.SIGKILL)
            else:
                child.popen.send_signal(signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
            # the versions trained when it landed (the broker is up: read after the signal, not before a wait)
            before = await self.ledger.trained()
            fault.landed_at, fault.end_then = dict(before), self.max_versions
            self.log.append(f"{time.strftime('%H:%M:%S')} {fault.name} at {before}")
            if fault.action == "kill":
                await asyncio.to_thread(child.popen.wait)
                await asyncio.sleep(fault.down_s)
                self._start(key)
                self.intended.discard(key)
            else:
                await asyncio.sleep(fault.down_s)
                child.popen.send_signal(signal.SIGCONT)
        fault.ended_at = time.time()
        # The next fault waits until every model still training committed a version past this one's.
        await self._until(lambda: self._moved(before), 300, f"training going on after {fault.name}", hold=True)

    async def _terminate(self, fault: Fault) -> dict[str, int]:
        """SIGTERM the target at a random moment while it is busy (:data:`BUSY`), time its exit, start it again."""
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        key = self._key(fault)
        status_model = fault.model if fault.per_model else None
        while True:  # waited for as long as the run may take: a slow machine's moment comes later, not never
            s = await self.ledger.status(fault.target, status_model, fault.instance)
            if s and BUSY[fault.target](s):
                fault.busy = ", ".join(f"{k}={s.get(k)}" for k in ("syncing", "accumulated", "held", "in_flight")
                                       if s.get(k) not in (None, 0))
                break
            if time.monotonic() > self.deadline:
                raise AssertionError(f"{key} never seen busy within the run's timeout\n" + "\n".join(self.log))
            await self._hold_look()
            await asyncio.sleep(0.005)
        child = self.cluster.sup.children[key]
        self.intended.add(key)
        t0 = time.monotonic()
        child.popen.send_signal(signal.SIGTERM)
        before = await self.ledger.trained()
        fault.landed_at, fault.end_then = dict(before), self.max_versions
        code = await self._exit_within_grace(child)
        fault.stop_s, fault.exit_code = round(time.monotonic() - t0, 2), code
        self.log.append(f"{time.strftime('%H:%M:%S')} {fault.name} ({fault.busy}) at {before}: exit {code} after "
                        f"{fault.stop_s}s")
        self._start(key)
        self.intended.discard(key)
        return before

    @staticmethod
    async def _exit_within_grace(child: Any, stacks: int = signal.SIGUSR1) -> int:
        """The exit code of a process SIGTERMed just now; one still running after :data:`TERM_GRACE_S` is SIGKILLed
        as a supervisor would (after ``stacks``: its threads' or its asyncio tasks' stacks, into its log)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(child.popen.wait), TERM_GRACE_S)
        except TimeoutError:
            child.popen.send_signal(stacks)
            await asyncio.sleep(1.0)
            child.popen.kill()
            return await asyncio.to_thread(child.popen.wait)

    async def _cut(self, fault: Fault) -> dict[str, int]:
        """Cut ``fault.host`` off from the other hosts for ``fault.down_s`` (at a ``fault.when`` moment of
        ``fault.target``'s ``fault.instance`` of ``fault.model``, when given), then heal it."""
        if fault.when:
            service = "trainer" if fault.when == "committing" else fault.when
            model = fault.model if service in PER_MODEL_KINDS else None
            while not BUSY[fault.when](status := await self.ledger.status(service, model, fault.instance)):
                if time.monotonic() > self.deadline:
                    raise AssertionError(f"{service} {fault.model}/{fault.instance} never {fault.when} within the "
                                         "run's timeout\n" + "\n".join(self.log))
                await self._hold_look()
                await asyncio.sleep(0.002)
            fault.busy = ", ".join(f"{k}={status.get(k)}" for k in ("committing", "in_flight", "queued", "syncing")
                                   if status.get(k) not in (None, 0))
        # read before the cut (the ledger's own server may be on the far side of it), then cut at once
        before = await self.ledger.trained()
        self.cluster.cut(fault.host, port=fault.port)
        fault.cut_at = time.time()
        fault.landed_at, fault.end_then = dict(before), self.max_versions
        self.log.append(f"{time.strftime('%H:%M:%S')} {fault.name} at {before}")
        await asyncio.sleep(fault.down_s)
        self.cluster.heal(fault.host)
        deadline = time.monotonic() + 120
        while True:  # just after the heal
            try:
                fault.healed_at = await self.ledger.trained()
                break
            except (nats.errors.Error, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        self.log.append(f"{time.strftime('%H:%M:%S')} healed {fault.host} at {fault.healed_at}")
        return before

    async def _terminate_all(self, fault: Fault) -> dict[str, int]:
        """SIGTERM every service process at once while ``fault.model``'s paramsync is inside a sync (as `chorus up`,
        compose or systemd stop a whole deployment), time the slowest exit, start them all again."""
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        while not BUSY["paramsync"](await self.ledger.status("paramsync", fault.model, "0")):
            if time.monotonic() > self.deadline:
                raise AssertionError(f"no sync of {fault.model} seen within the run's timeout\n" + "\n".join(self.log))
            await self._hold_look()
            await asyncio.sleep(0.005)
        children = dict(self.cluster.sup.children)
        self.intended.update(children)
        t0 = time.monotonic()
        for child in children.values():
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
        before = await self.ledger.trained()
        fault.landed_at, fault.busy = dict(before), f"{fault.model} syncing"
        fault.end_then = self.max_versions

        async def stopped(child: Any) -> tuple[float, int]:
            code = await self._exit_within_grace(child, stacks=signal.SIGUSR2)
            return time.monotonic() - t0, code

        results = dict(zip(children, await asyncio.gather(*(stopped(c) for c in children.values())), strict=True))
        slowest = max(results, key=lambda k: results[k][0])
        fault.stop_s = round(results[slowest][0], 2)
        bad = {k: code for k, (_, code) in results.items() if code != 0}
        fault.exit_code = next(iter(bad.values())) if bad else 0
        self.log.append(f"{time.strftime('%H:%M:%S')} {fault.name} ({fault.busy}) at {before}: slowest {slowest} "
                        f"{fault.stop_s}s, non-zero exits {bad or 'none'}")
        for key in children:  # the coordinator last, as at the start
            if not key.startswith("coordinator"):
                self._start(key)
        for key in children:
            if key.startswith("coordinator"):
                self._start(key)
        self.intended.difference_update(children)
        return before

    async def _kill_slot(self, fault: Fault) -> dict[str, int]:
        """SIGKILL a slot worker of the training pool while it runs a micro-batch: asked every few milliseconds which
        slot is inside one, killed at once, and tried again until the pool counts a call lost under it (a kill that
        lands between two calls proves less). Its pool restarts it and runs the call again."""
        # a gang's rank (a DeepSpeed group in the pool): while its slot runs a micro-batch or the step (rank 0 only
        # records a micro-batch's samples; every rank computes them in the step)
        calls = ("micro_batch", "step") if fault.rank else ("micro_batch",)
        while time.monotonic() < self.deadline:  # waited for as long as the run may take, tried until one lands
            s = (await self.ledger.status("trainer")).get("pool", {})
            busy = [x for x in s.get("slots", []) if x.get("call") in calls and x.get("pid")
                    and (not fault.rank or x.get("holder") == fault.model)]
            if not busy:
                await self._hold_look()
                await asyncio.sleep(0.005)
                continue
            lost = s["swap"]["lost"]
            pid = busy[0]["pid"]
            if fault.rank:  # rank ``rank`` of a gang (a DeepSpeed group in the pool): its rank 0 is the slot's process
                pid = await follower_pid(pid, fault.rank, timeout_s=5.0)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            before = await self.ledger.trained()
            fault.landed_at, fault.end_then = dict(before), self.max_versions
            self.log.append(f"{time.strftime('%H:%M:%S')} {fault.name} (pid {pid}, rank {fault.rank} of the slot "
                            f"holding {busy[0]['holder']}) at {before}")
            # a gang's rank: lost at the group's next collective (its step), once the batch is in
            for _ in range(2400 if fault.rank else 100):
                now = (await self.ledger.status("trainer")).get("pool", {}).get("swap", {}).get("lost", lost)
                if now > lost:
                    return before
                await asyncio.sleep(0.05)
        raise AssertionError(f"no slot worker was caught inside {' or '.join(calls)} within the run's timeout\n"
                             + "\n".join(self.log))

    async def _busy_instance(self, model: str) -> str:
        """The first rollouter instance of ``model`` seen with requests in flight or queued (asked every 50 ms in
        turn: a tiny model's batches are short, and training races on while the fault waits)."""
        while time.monotonic() < self.deadline:
            for i in range(self.rollouters):
                s = await self.ledger.status("rollouter", model, str(i))
                if s and s.get("in_flight", 0) + s.get("queued", 0) > 0:
                    return str(i)
            await self._hold_look()
            await asyncio.sleep(0.05)
        raise AssertionError(f"no rollouter of {model} busy within the run's timeout\n" + "\n".join(self.log))

    async def _stopped_busy_instance(self, model: str) -> str:
        """A rollouter instance of ``model`` SIGSTOPped while the coordinator has generation requests in flight on
        it. A tiny model's batch can end between a status answer and the signal, so the instance is stopped first
        and the coordinator asked again once the answers it sent before stopping had time to arrive; one found idle
        is continued and the search goes on."""
        while time.monotonic() < self.deadline:
            await self._hold_look()  # never while an instance is held stopped
            for i in range(self.rollouters):
                if await self._requests_on(model, str(i)) <= 0:
                    continue
                child = self.cluster.sup.children[f"rollouter-{model}-{i}"]
                child.popen.send_signal(signal.SIGSTOP)
                await asyncio.sleep(0.3)
                if await self._requests_on(model, str(i)) > 0:
                    return str(i)
                child.popen.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.05)
        raise AssertionError(f"no rollouter of {model} held requests within the run's timeout\n" + "\n".join(self.log))

    async def _requests_on(self, model: str, instance: str) -> int:
        """The generation requests the coordinator has in flight on one rollouter instance (0 when it does not say)."""
        s = await self.ledger.status("coordinator")
        return int(s.get("balance", {}).get("instances", {}).get(model, {}).get(instance, {}).get("requests", 0))

    def _fault_models(self, fault: Fault, now: dict[str, int] | None = None) -> list[str]:
        """The models a fault must land on while they train, and recover on: its model's (a per-model fault; one
        still LAGGING: whichever is behind ``now``), or every model (a shared service, the broker, a host)."""
        if not fault.per_model:
            return list(self.models)
        if fault.model == LAGGING:
            return [min(self.models, key=lambda m: (now or {}).get(m, 0))]
        return [fault.model]

    async def _hold_end(self) -> None:
        """Hold the run's end while a fault is still to land or to recover (:attr:`_hold_for`): once a model it
        needs trained to within :attr:`hold_margin` versions of ``max_versions``, every service is stopped (SIGTERM,
        as at a node's shutdown), the config's ``train.max_versions`` moved on by the run's first length and every
        service started again. A fault then lands, and recovers, while its models still train, however slow the
        machine; on a quiet one the run's first length is enough and nothing is done. The counters of the stopped
        processes are kept (:meth:`_with_counts_before_holds`)."""
        self._hold_looked = time.monotonic()
        if self._hold_for is None:
            return
        try:
            now = await self.ledger.trained()
        except (nats.errors.Error, TimeoutError):
            return  # a broker node is down (a fault of its own): the next look decides
        if max(now[m] for m in self._fault_models(self._hold_for, now)) < self.max_versions - self.hold_margin:
            return
        target = max(now.values()) + self.planned
        self.log.append(f"{time.strftime('%H:%M:%S')} the run's end held at {now} for {self._hold_for.name}: every "
                        f"service stopped, max_versions {self.max_versions} -> {target}, started again")
        statuses = {"coordinator": await self.ledger.status("coordinator")}
        if self.pool:
            statuses["pool"] = await self.ledger.status("trainer")
        if self.critic:
            statuses["critic"] = await self.ledger.status("critic")
        self._statuses_before_holds.append(statuses)
        children = set(self.cluster.sup.children)
        self.intended.update(children)
        await self.cluster.stop_all()
        cfg = yaml.safe_load(self.config.read_text())
        cfg["train"]["max_versions"] = target
        self.config.write_text(yaml.safe_dump(cfg))
        self.max_versions = target
        self.held.append(target)
        self.cluster.start_all(self.models, rollouters=self.rollouters, critic=self.critic, pool=self.pool)
        self.intended.difference_update(children)

    def _with_counts_before_holds(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """``status`` (a service's final snapshot) with the counts of its processes that holds stopped added in."""
        for before in self._statuses_before_holds:
            status = add_counts(status, before.get(name, {}))
        return status

    async def _hold_look(self) -> None:
        """:meth:`_hold_end`, at most every 2 s: asked by the loops that wait for a fault's moment."""
        if time.monotonic() - self._hold_looked >= 2.0:
            await self._hold_end()

    async def _moved(self, before: dict[str, int]) -> bool:
        now = await self.ledger.trained()
        return all(now[m] > before[m] or now[m] >= self.max_versions for m in self.models)

    async def _until(self, cond: Callable[[], Awaitable[bool]], timeout_s: float, what: str, *,
                     hold: bool = False) -> None:
        """Wait for ``cond``, at most ``timeout_s`` and never past the whole run's deadline (a run that is slow at
        every step fails within its timeout, with the services' logs, instead of summing every wait's timeout).
        ``hold``: a wait for a fault's moment or its recovery, which holds the run's end (:meth:`_hold_end`)."""
        deadline = min(time.monotonic() + timeout_s, self.deadline)
        while time.monotonic() < deadline:
            try:
                if await cond():
                    return
            except Exception:  # a broker node is down: ask again
                pass
            if hold:
                await self._hold_look()
            await asyncio.sleep(0.3)
        spent = "the run's" if deadline == self.deadline else f"{timeout_s:.0f}s"
        raise AssertionError(f"{what} within {spent} timeout\n" + "\n".join(self.log) + "\n" + await self._stacks())

    async def _stacks(self) -> str:
        """Every live process's log tail after it printed each thread's stack (SIGUSR1): where a stalled run is."""
        for c in self.cluster.sup.children.values():
            if c.alive():
                with contextlib.suppress(ProcessLookupError):
                    c.popen.send_signal(signal.SIGUSR1)
        await asyncio.sleep(1.0)
        return self.cluster.logs(lines=80)

    async def run(self, faults: list[Fault], *, timeout_s: float = 900.0) -> Outcome:
        """The run through ``faults``; every wait in it ends by ``timeout_s`` after the start (then it fails)."""
        t0 = time.monotonic()
        self.deadline = t0 + timeout_s
        await self.ledger.start()
        self.cluster.start_all(self.models, rollouters=self.rollouters, critic=self.critic, pool=self.pool)
        watcher = asyncio.create_task(self._watch_exits())
        try:
            for fault in faults:
                if fault.target not in SERVICE_KINDS + ("nats", SLOT, EVERYTHING, HOST):
                    raise ValueError(f"unknown fault target {fault.target!r}")
                self._hold_for = fault
                if fault.model == LAGGING:
                    await self._until(lambda v=fault.at_version: self._reached_all(v), timeout_s,
                                      f"every model reaching v{fault.at_version} before {fault.name}", hold=True)
                    now = await self.ledger.trained()
                    fault.model = min(self.models, key=lambda m: now[m])
                model = fault.model if fault.per_model else self.models[0]
                await self._until(lambda m=model, v=fault.at_version: self._reached(m, v), timeout_s,
                                  f"{model} reaching v{fault.at_version} before {fault.name}", hold=True)
                await self._hold_end()
                await self._inject(fault)
                self._hold_for = None
            await self._until(lambda: self._reached_all(self.max_versions), timeout_s, "the run finishing")
            # Samples of tasks still in flight are dropped as finished; then the streams run empty.
            await self._until(self._quiet, 120, "the streams emptying after the run")
            paused = await self._paused_once_answering()
            reports = await self.ledger.report()
            if self.critic:
                self.critic_report = await self.ledger.critic_report()
            self.coordinator_status = self._with_counts_before_holds(
                "coordinator", await self.ledger.status("coordinator"))
            if self.critic:
                self.critic_status = self._with_counts_before_holds("critic", await self.ledger.status("critic"))
            if self.pool:
                self.pool_status = self._with_counts_before_holds("pool", await self.ledger.status("trainer"))
            for fault in faults:
                fault.recovered_s = self.ledger.loop_turned(fault.ended_at, self._fault_models(fault))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await self.cluster.stop_all()
            await self.ledger.close()
        problems = violations(reports, self.max_versions)
        problems += self.critic_report.problems() if self.critic_report is not None else []
        problems += [f"rollouter {p}" for p in paused]
        problems += [f"fault {f.name} never recovered" for f in faults if f.recovered_s == float("inf")]
        problems += [f"{f.target} exited {f.exit_code} on SIGTERM ({f.busy}; after {f.stop_s}s, killed at its grace "
                     f"of {TERM_GRACE_S:.0f}s if still running)" for f in faults
                     if f.action == "term" and f.exit_code != 0]
        problems += [f"fault {f.name} landed after the run had finished ({f.landed_at})" for f in faults
                     if not self._mid_run(f)]
        return Outcome(faults, reports, problems, self.unexpected, round(time.monotonic() - t0, 1), paused,
                       self.held)

    async def _paused_once_answering(self) -> list[str]:
        """The rollouter instances that say they are paused, asked once every instance answers: a restarted one
        answers when it has started (a vLLM one loads its engine for seconds), which may be after the run ended.
        The instances are those the coordinator routes to, by model: the balancer may have moved one to the other
        model under a new name. Fewer than were started, or one that does not answer, after :data:`WAIT_S`, is
        reported as such."""
        started = self.rollouters * len(self.models)
        deadline = min(time.monotonic() + WAIT_S, self.deadline)
        while True:
            routed = (await self.ledger.status("coordinator")).get("balance", {}).get("instances", {})
            instances = {m: sorted(routed.get(m, {})) for m in self.models}
            paused = await self.ledger.paused_instances(instances)
            silent = [p for p in paused if not p.endswith(": paused")]
            count = sum(len(v) for v in instances.values())
            missing = [] if count >= started else [f"{count} of the {started} instances routed: {instances}"]
            if (not silent and not missing) or time.monotonic() > deadline:
                return paused + missing
            await asyncio.sleep(0.5)

    def _mid_run(self, fault: Fault) -> bool:
        """A fault proves something only while training goes on: its model's (a shared service's or the broker's:
        every model's) trained version was below the end when it was injected."""
        end = fault.end_then or self.max_versions
        return all(fault.landed_at.get(m, end) < end for m in self._fault_models(fault))

    async def _reached(self, model: str, version: int) -> bool:
        return (await self.ledger.trained())[model] >= version

    async def _reached_all(self, version: int) -> bool:
        return all(v >= version for v in (await self.ledger.trained()).values())

    async def _quiet(self) -> bool:
        """Nothing left in the streams, twice in a row 1 s apart (in-flight tasks publish their last samples)."""
        if await self.ledger.stream_messages():
            return False
        await asyncio.sleep(1.0)
        return await self.ledger.stream_messages() == 0


COUNTED = ("counters", "swap")  # the parts of a status snapshot that count since the process started


def add_counts(status: dict[str, Any], earlier: dict[str, Any], counting: bool = False) -> dict[str, Any]:
    """``status`` with the numbers under its ``counters`` and ``swap`` parts (at any depth) summed with
    ``earlier``'s, a snapshot of a process it replaced; everything else as ``status`` has it."""
    out = dict(status)
    for key, value in earlier.items():
        mine = out.get(key)
        inside = counting or key in COUNTED
        if isinstance(value, dict) and isinstance(mine, dict):
            out[key] = add_counts(mine, value, inside)
        elif inside and isinstance(value, int | float) and not isinstance(value, bool):
            if mine is None or (isinstance(mine, int | float) and not isinstance(mine, bool)):
                out[key] = (mine or 0) + value
    return out


def table(outcomes: list[tuple[str, Outcome]]) -> str:
    """The cases as a Markdown table: samples published / stored / trained / dropped, regressions, recovery."""
    rows = ["| case | published | stored | trained | dropped (reasons) | missing | trained twice | version "
            "regression | loop back after (s) | unexpected exits | run s | end held at | invariants |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, o in outcomes:
        rs = o.reports.values()
        dropped: dict[str, int] = {}
        for r in rs:
            for k, v in r.dropped.items():
                dropped[k] = dropped.get(k, 0) + v
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "-"
        rows.append(
            f"| {name} | {sum(r.published for r in rs)} | {sum(r.stored for r in rs)} | "
            f"{sum(r.trained for r in rs)} | {sum(dropped.values())} ({reasons}) | "
            f"{sum(len(r.missing) for r in rs)} | {sum(len(r.trained_twice) for r in rs)} | "
            f"{max(max(r.served_regression, r.trained_regression) for r in rs)} | "
            f"{', '.join(str(f.recovered_s) for f in o.faults)} | {len(o.unexpected_exits)} | {o.seconds} | "
            f"{', '.join(f'v{v}' for v in o.held) or '-'} | {'hold' if not o.problems else 'BROKEN'} |")
    return "\n".join(rows)


def describe(outcome: Outcome) -> dict[str, Any]:
    return {"problems": outcome.problems, "unexpected_exits": outcome.unexpected_exits,
            "faults": [(f.name, f.landed_at, f.recovered_s) for f in outcome.faults]}
