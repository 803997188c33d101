"""Start Chorus services as separate OS processes (`chorus serve ...`) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared.launcher.supervisor import Child, Supervisor

CHORUS = str(Path(sys.executable).parent / "chorus")


@dataclass
class Cluster:
    """A set of service processes sharing one config and one nats-server, run by the `chorus up` supervisor."""

    config: Path
    nats_url: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: list[int] | None = None  # started under `taskset -c` (a test that times one process on a 2-core machine)
    sup: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.sup = Supervisor(self.log_dir, env={**os.environ, **self.env})

    def start(self, service: str, model: str | None = None, instance: str = "0", *,
              cpus: list[int] | None = None) -> Child:
        key = f"{service}-{model}-{instance}" if model else f"{service}-{instance}"
        argv = [CHORUS, "serve", service, "--config", str(self.config), "--nats", self.nats_url, "--instance", instance]
        if model:
            argv += ["--model", model]
        pinned = self.cpus if cpus is None else cpus
        if pinned:
            argv = ["taskset", "-c", ",".join(map(str, pinned)), *argv]  # it execs the command too
        return self.sup.start(key, argv)

    def start_all(self, models: list[str], *, rollouters: int = 1, critic: bool = False, pool: bool = False) -> None:
        self.start("actions")
        if pool:  # train.pool.slots: one training pool runs every model's trainer
            self.start("trainer")
        for m in models:
            self.start("mq", m)
            if not pool:
                self.start("trainer", m)
            for i in range(rollouters):
                self.start("rollouter", m, str(i))
            self.start("paramsync", m)
        if critic:  # MARFT's central critic (train.loss marft)
            self.start("critic")
        self.start("coordinator")

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        child = self.sup.children[key]
        child.popen.send_signal(sig)
        child.popen.wait(timeout=30)

    def dead(self) -> list[Child]:
        return [c for c in self.sup.children.values() if not c.alive()]

    async def stop_all(self, timeout_s: float = 30.0) -> dict[str, int]:
        """SIGTERM everything, wait, SIGKILL stragglers; returns exit codes."""
        return await self.sup.stop_all(timeout_s)

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {k}\n{c.tail(lines)}" for k, c in self.sup.children.items())
