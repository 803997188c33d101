"""A persistent pool of action worker subprocesses, scheduled FCFS over the core budget.

Each worker runs one action at a time (one core). A worker that times out is killed and replaced; one
that dies mid-action is replaced and the action answers an error, never the service.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import structlog

from services.actions.resources import CpuManager, local_node
from services.actions.scheduler import FcfsScheduler

HEADER = struct.Struct(">I")
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0
log = structlog.get_logger("actions.pool")


@dataclass
class Outcome:
    """What one action produced: a result dict, or an error string."""

    result: dict[str, Any] | None
    error: str | None
    seconds: float


class Worker:
    """One ``python -m services.actions.worker`` subprocess speaking length-prefixed msgpack."""

    def __init__(self, memory_mb: int, python: str = sys.executable) -> None:
        self.memory_mb = memory_mb
        self.python = python
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Spawn the subprocess and wait for its ready frame."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "services.actions.worker", "--memory-mb", str(self.memory_mb),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=str(ROOT), env=env,
        )
        try:
            hello = await asyncio.wait_for(self._read(), START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError) as exc:
            await self.kill()
            raise RuntimeError(f"action worker did not start: {type(exc).__name__}") from exc
        if not isinstance(hello, dict) or not hello.get("ready"):
            await self.kill()
            raise RuntimeError(f"action worker sent {hello!r} instead of its ready frame")
        self.pid = int(hello.get("pid", self.proc.pid))

    async def _read(self) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        (n,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        return msgpack.unpackb(await self.proc.stdout.readexactly(n), raw=False, strict_map_key=False)

    async def _write(self, obj: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = msgpack.packb(obj, use_bin_type=True)
        self.proc.stdin.write(HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()

    async def kill(self) -> None:
        """Kill the subprocess (if running) and reap it."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            log.warning("action worker did not exit after SIGKILL", pid=self.proc.pid)

    async def close(self) -> None:
        """Ask the worker to exit (end of input), then make sure it did."""
        if self.alive and self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 2)
            except TimeoutError:
                pass
        await self.kill()

    async def call(self, kind: str, payload: dict[str, Any], timeout_s: float,
                   cpus: list[int] | None = None) -> Outcome:
        """Run one action (bound to ``cpus`` when given); on timeout the worker is killed (the caller replaces
        it)."""
        if not self.alive:
            await self.start()
        t0 = time.monotonic()
        try:
            request: dict[str, Any] = {"kind": kind, "payload": payload, "timeout_s": timeout_s}
            if cpus is not None:
                request["cpus"] = cpus
            await self._write(request)
            reply = await asyncio.wait_for(self._read(), timeout_s)
        except TimeoutError:
            await self.kill()
            return Outcome(None, f"timeout after {timeout_s:g}s", time.monotonic() - t0)
        except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
            await self.kill()
            code = self.proc.returncode if self.proc is not None else None
            return Outcome(None, f"action worker exited with code {code} while running {kind!r}",
                           time.monotonic() - t0)
        except asyncio.CancelledError:
            await self.kill()  # mid-request: its next frame would belong to the wrong caller
            raise
        seconds = time.monotonic() - t0
        if not isinstance(reply, dict):
            return Outcome(None, f"action worker replied {type(reply).__name__}, expected a map", seconds)
        if reply.get("ok"):
            result = reply.get("result")
            if not isinstance(result, dict):
                return Outcome(None, f"action {kind!r} returned {type(result).__name__}, expected a dict", seconds)
            return Outcome(result, None, seconds)
        return Outcome(None, str(reply.get("error") or "action failed without a reason"), seconds)


class WorkerPool:
    """``size`` persistent workers; :meth:`run` waits FCFS for a core, then runs on an idle worker."""

    def __init__(self, size: int, memory_mb: int, python: str = sys.executable) -> None:
        self.scheduler = FcfsScheduler(size)
        # allocate-on-execution (ARL-Tangram §5.2): each action's process is bound to exactly the cores it holds
        self.cpu = CpuManager([local_node(size)])
        self.workers = [Worker(memory_mb, python) for _ in range(size)]
        self._idle = list(self.workers)
        self.counters: Counter[str] = Counter()

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self.workers))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)

    def pids(self) -> list[int | None]:
        return [w.proc.pid if w.alive and w.proc is not None else None for w in self.workers]

    async def run(self, kind: str, payload: dict[str, Any], timeout_s: float) -> Outcome:
        """Run one action (1 core) in arrival order; errors come back in the :class:`Outcome`."""
        async with self.scheduler.slot(1):
            # The scheduler grants at most `size` slots, so an idle worker always exists here.
            worker = self._idle.pop()
            cores = self.cpu.allocate("local", 1)
            assert cores is not None  # the scheduler grants no more cores than the CPU manager holds
            try:
                try:
                    outcome = await worker.call(kind, payload, timeout_s, self.cpu.nodes["local"].cpus(cores))
                except RuntimeError as exc:  # the worker could not (re)start
                    self.counters["start_failures"] += 1
                    return Outcome(None, str(exc), 0.0)
                self._count(outcome)
                if not worker.alive:
                    await self._replace(worker)
                return outcome
            finally:
                self.cpu.release("local", cores)
                self._idle.append(worker)

    def _count(self, outcome: Outcome) -> None:
        if outcome.error is None:
            self.counters["ok"] += 1
        elif outcome.error.startswith("timeout after"):
            self.counters["timeouts"] += 1
        elif "exited with code" in outcome.error:
            self.counters["crashes"] += 1
        else:
            self.counters["errors"] += 1

    async def _replace(self, worker: Worker) -> None:
        self.counters["restarts"] += 1
        try:
            await worker.start()
        except RuntimeError as exc:  # retried lazily on its next action
            self.counters["start_failures"] += 1
            log.warning("action worker restart failed", error=str(exc))
