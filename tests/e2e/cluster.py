"""Start Chorus services as separate OS processes (`chorus serve ...`) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CHORUS = str(Path(sys.executable).parent / "chorus")


@dataclass
class Proc:
    key: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Cluster:
    """A set of service processes sharing one config and one nats-server."""

    config: Path
    nats_url: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, service: str, model: str | None = None, instance: str = "0") -> Proc:
        key = f"{service}-{model}-{instance}" if model else f"{service}-{instance}"
        argv = [CHORUS, "serve", service, "--config", str(self.config), "--nats", self.nats_url, "--instance", instance]
        if model:
            argv += ["--model", model]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{key}.log"
        env = {**os.environ, **self.env}
        with open(log, "ab") as fh:
            popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
        proc = Proc(key, argv, log, popen)
        self.procs[key] = proc
        return proc

    def start_all(self, models: list[str], *, rollouters: int = 1) -> None:
        self.start("actions")
        for m in models:
            self.start("mq", m)
            self.start("trainer", m)
            for i in range(rollouters):
                self.start("rollouter", m, str(i))
            self.start("paramsync", m)
        self.start("coordinator")

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[key]
        p.popen.send_signal(sig)
        p.popen.wait(timeout=30)

    def dead(self) -> list[Proc]:
        return [p for p in self.procs.values() if not p.alive()]

    def stop_all(self, timeout_s: float = 30.0) -> dict[str, int]:
        """SIGTERM everything, wait, SIGKILL stragglers; returns exit codes."""
        for p in self.procs.values():
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        for key, p in self.procs.items():
            try:
                codes[key] = p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[key] = p.popen.wait()
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- {k}\n{p.tail()}" for k, p in self.procs.items())
