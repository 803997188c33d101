"""Continuous chaos: for ``minutes``, every 10-40 s one random fault (a service process or a broker node SIGKILLed
and restarted, or SIGSTOPped for a few seconds then SIGCONTed; on a deployment with hosts, a host or a NATS node's
routes cut off for a few seconds), the next once training went on after it. Then the run is brought to an end:
every service stopped (SIGTERM), ``train.max_versions`` set to 20 past the furthest model, every service started
again, and the ledger's invariants checked over the whole run. :func:`chaos_table` says what was done when."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from tests.faults.harness import HOST, PER_MODEL_KINDS, Fault, FaultRun, Outcome
from tests.faults.ledger import violations

KINDS = ("coordinator", "actions", "mq", "trainer", "rollouter", "paramsync")
TAIL_VERSIONS = 20  # versions trained after the chaos, to a target set then


@dataclass
class Chaos:
    """What one chaos run did."""

    seed: int
    minutes: float
    faults: list[tuple[float, Fault]] = field(default_factory=list)  # (seconds since the chaos began, fault)
    target: int = 0  # train.max_versions the run was ended at
    chaos_s: float = 0.0
    tail_s: float = 0.0


class ChaosRun(FaultRun):
    """A :class:`FaultRun` whose faults are drawn at random for a while, instead of given."""

    def __init__(self, *args: Any, hosts: list[str] | None = None, routes: dict[str, str] | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.seed = int(kw.get("seed", 0))  # FaultRun's rng is seeded with it: the same seed draws the same faults
        self.hosts = hosts or []  # hosts that may be cut off (a deployment with hosts)
        self.routes = routes or {}  # NATS node index -> its host (its routes may be cut)

    def draw(self) -> Fault:
        """One fault, at random (this run's seed)."""
        r = self.rng
        menu = ["kill", "stop"] * 3 + ["nats-kill", "nats-stop"] + (["cut", "cut-routes"] if self.hosts else [])
        what = r.choice(menu)
        if what.startswith("nats"):
            return Fault("nats", what.split("-")[1], node=r.randrange(len(self.broker.nodes)),
                         down_s=round(r.uniform(2, 5) if what == "nats-kill" else r.uniform(2, 8), 1))
        if what == "cut":
            return Fault(HOST, "cut", host=r.choice(self.hosts), down_s=round(r.uniform(5, 15), 1))
        if what == "cut-routes":
            node = r.choice(sorted(self.routes))
            return Fault(HOST, "cut", host=self.routes[node], port=6222, down_s=round(r.uniform(5, 15), 1))
        kind = r.choice(KINDS)
        model = r.choice(self.models)
        instance = str(r.randrange(self.rollouters)) if kind == "rollouter" else "0"
        return Fault(kind, what, model=model, instance=instance,
                     down_s=round(r.uniform(1, 5) if what == "kill" else r.uniform(2, 8), 1))

    async def run_chaos(self, minutes: float, *, timeout_s: float = 3600.0) -> tuple[Outcome, Chaos]:
        chaos = Chaos(self.seed, minutes)
        t0 = time.monotonic()
        self.deadline = t0 + minutes * 60 + timeout_s
        await self.ledger.start()
        self.cluster.start_all(self.models, rollouters=self.rollouters)
        watcher = asyncio.create_task(self._watch_exits())
        faults: list[Fault] = []
        try:
            await self._until(lambda: self._reached_all(3), 600, "every model training before the chaos")
            began = time.monotonic()
            while time.monotonic() - began < minutes * 60:
                await asyncio.sleep(self.rng.uniform(10, 40))
                if time.monotonic() - began >= minutes * 60:
                    break
                fault = self.draw()
                at = round(time.monotonic() - began, 1)
                await self._inject(fault)  # returns once training went on after it
                chaos.faults.append((at, fault))
                faults.append(fault)
            chaos.chaos_s = round(time.monotonic() - began, 1)
            # the end: every service stopped, the target set past the furthest model, every service again
            t_tail = time.monotonic()
            now = await self.ledger.trained()
            chaos.target = max(now.values()) + TAIL_VERSIONS
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await self.cluster.stop_all()
            cfg = yaml.safe_load(self.config.read_text())
            cfg["train"]["max_versions"] = chaos.target
            self.config.write_text(yaml.safe_dump(cfg))
            self.max_versions = chaos.target
            self.cluster.start_all(self.models, rollouters=self.rollouters)
            watcher = asyncio.create_task(self._watch_exits())
            await self._until(lambda: self._reached_all(chaos.target), 900, "the run finishing after the chaos")
            await self._until(self._quiet, 120, "the streams emptying after the run")
            chaos.tail_s = round(time.monotonic() - t_tail, 1)
            paused = await self._paused_once_answering()
            reports = await self.ledger.report()
            self.coordinator_status = await self.ledger.status("coordinator")
            for fault in faults:
                fault.recovered_s = self.ledger.loop_turned(fault.ended_at)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await self.cluster.stop_all()
            await self.ledger.close()
        problems = violations(reports, chaos.target) + [f"rollouter {p}" for p in paused]
        return Outcome(faults, reports, problems, self.unexpected, round(time.monotonic() - t0, 1), paused), chaos


def chaos_table(chaos: Chaos, outcome: Outcome) -> str:
    """What was done when (seconds since the chaos began), and the run's figures."""
    rows = [f"chaos seed {chaos.seed}: {len(chaos.faults)} faults in {chaos.chaos_s:.0f} s, then every service "
            f"stopped and started again to end at v{chaos.target} ({chaos.tail_s:.0f} s)", "",
            "| at (s) | fault | target | for (s) | trained versions then | training again after (s) |",
            "|---|---|---|---|---|---|"]
    for at, f in chaos.faults:
        if f.action == "cut":
            target = f.host + (" (routes)" if f.port else "")
        elif f.target == "nats":
            target = f"nats node {f.node}"
        else:
            target = f"{f.target} {f.model}/{f.instance}" if f.target in PER_MODEL_KINDS else f.target
        versions = ", ".join(f"{m} {v}" for m, v in sorted(f.landed_at.items()))
        rows.append(f"| {at} | {f.action} | {target} | {f.down_s} | {versions} | {f.recovered_s} |")
    rs = outcome.reports.values()
    dropped: dict[str, int] = {}
    for r in rs:
        for k, v in r.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
    kinds: dict[str, int] = {}
    for _, f in chaos.faults:
        name = "cut" if f.action == "cut" else f"{f.action} {'nats' if f.target == 'nats' else 'service'}"
        kinds[name] = kinds.get(name, 0) + 1
    rows += ["", f"faults by kind: {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}",
             f"samples: {sum(r.published for r in rs)} published, {sum(r.stored for r in rs)} stored, "
             f"{sum(r.trained for r in rs)} trained, {sum(dropped.values())} dropped "
             f"({', '.join(f'{k} {v}' for k, v in sorted(dropped.items())) or '-'}), "
             f"{sum(len(r.missing) for r in rs)} missing, {sum(len(r.trained_twice) for r in rs)} trained twice, "
             f"version regressions {max((max(r.served_regression, r.trained_regression) for r in rs), default=0)}",
             f"processes that exited by themselves (restarted): {len(outcome.unexpected_exits)}",
             f"invariants: {'hold' if not outcome.problems else 'BROKEN: ' + '; '.join(outcome.problems)}"]
    return "\n".join(rows)
