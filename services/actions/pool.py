"""A persistent pool of action worker subprocesses, scheduled FCFS over the core budget.

Each worker runs one action at a time (one core). A worker that times out is killed and replaced; one
that dies mid-action is replaced and the action answers an error, never the service.
"""

from __future__ import annotations

import asyncio
import math
import os
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import structlog

from services.actions.actions import tests_spec
from services.actions.elastic import (
    CHORUS,
    PAPER,
    Action,
    DurationProfile,
    Elasticity,
    MalleableSuite,
    Units,
    schedule,
)
from services.actions.resources import CpuManager, local_node
from services.actions.scheduler import FcfsScheduler

HEADER = struct.Struct(">I")
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0  # a worker's imports (its preloads among them) on a loaded machine
log = structlog.get_logger("actions.pool")


@dataclass
class Outcome:
    """What one action produced: a result dict, or an error string; ``seconds`` its worker round trip, ``exec_s``
    the action's own run inside the worker (0 when it did not run), ``queue_s`` its wait for cores."""

    result: dict[str, Any] | None
    error: str | None
    seconds: float
    exec_s: float = 0.0
    queue_s: float = 0.0


class ActBook:
    """Action completion times (ARL-Tangram's ACT) split into queue, execution and overhead (the round trip to the
    worker, the binding, the result's way back), per action kind and per resource; the last ``keep`` of each."""

    def __init__(self, keep: int = 2048) -> None:
        self.keep = keep
        self.by_kind: dict[str, deque[tuple[float, float, float]]] = {}
        self.by_resource: dict[str, deque[float]] = {}
        self.recent: list[dict[str, Any]] = []  # since the last drain: what the metrics subject carries

    def record(self, kind: str, resource: str, cores: int, queue_s: float, exec_s: float, total_s: float) -> None:
        overhead = max(0.0, total_s - queue_s - exec_s)
        self.by_kind.setdefault(kind, deque(maxlen=self.keep)).append((queue_s, exec_s, overhead))
        self.by_resource.setdefault(resource, deque(maxlen=self.keep)).append(total_s)
        if len(self.recent) < self.keep:
            self.recent.append({"kind": kind, "cores": cores, "queue_s": round(queue_s, 6),
                                "exec_s": round(exec_s, 6), "overhead_s": round(overhead, 6)})

    def drain(self) -> list[dict[str, Any]]:
        out, self.recent = self.recent, []
        return out

    def summary(self) -> dict[str, Any]:
        """Per kind: count, ACT mean / p50 / p99 and the mean of each part; per resource: count and mean ACT."""
        kinds = {}
        for kind, rows in sorted(self.by_kind.items()):
            acts = sorted(q + e + o for q, e, o in rows)
            n = len(acts)
            kinds[kind] = {"n": n, "mean": sum(acts) / n, "p50": percentile(acts, 0.5), "p99": percentile(acts, 0.99),
                           "queue": sum(q for q, _, _ in rows) / n, "exec": sum(e for _, e, _ in rows) / n,
                           "overhead": sum(o for _, _, o in rows) / n}
        resources = {r: {"n": len(v), "mean": sum(v) / len(v)} for r, v in sorted(self.by_resource.items()) if v}
        return {"kinds": kinds, "resources": resources}


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


class Worker:
    """One ``python -m services.actions.worker`` subprocess speaking length-prefixed msgpack."""

    def __init__(self, memory_mb: int, python: str = sys.executable, preload: Sequence[str] = ()) -> None:
        self.memory_mb = memory_mb
        self.python = python
        self.preload = tuple(preload)
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
            *(a for m in self.preload for a in ("--preload", m)),
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
            exec_s = reply.get("exec_s")
            return Outcome(result, None, seconds, float(exec_s) if isinstance(exec_s, int | float) else 0.0)
        return Outcome(None, str(reply.get("error") or "action failed without a reason"), seconds)


# Action kinds whose work spreads over the cores they get (their payload's ``parallelism``), with their elasticity
# (ARL-Tangram §4.1). Every other kind takes one core.
ELASTIC: dict[str, Elasticity] = {"cpu_tests": Elasticity("amdahl", serial=0.05)}
ELASTIC_MAX_CORES = 32


def formulate(kind: str, payload: dict[str, Any], budget: int, profile: DurationProfile) -> Action:
    """An action's resource formulation: an elastic kind may take 1..min(budget, 32, payload ``max_cores``) cores
    (Amdahl, the payload's ``serial`` or the kind's default), with the payload's ``t_ori`` or the kind's running
    average; any other kind one core, with its kind's running average as its duration (the completion heap's
    estimate of when its core frees; None before its first run)."""
    elasticity = ELASTIC.get(kind)
    if elasticity is None:
        return profile.fill(Action(kind, kind, {"cpu": Units.fixed(1)}, key="cpu", elasticity=None))
    serial = payload.get("serial")
    if isinstance(serial, int | float) and 0 <= serial <= 1:
        elasticity = Elasticity("amdahl", serial=float(serial))
    cap = payload.get("max_cores")
    hi = min(budget, ELASTIC_MAX_CORES, int(cap) if isinstance(cap, int) and cap >= 1 else ELASTIC_MAX_CORES)
    t_ori = payload.get("t_ori")
    action = Action(kind, kind, {"cpu": Units(1, hi)}, key="cpu", elasticity=elasticity,
                    t_ori=float(t_ori) if isinstance(t_ori, int | float) and t_ori > 0 else None)
    return profile.fill(action)


POLICIES = ("elastic", "chorus", "fcfs")


def malleable_spec(kind: str, payload: dict[str, Any]) -> tuple[int, float, float] | None:
    """A ``cpu_tests`` suite whose cases the pool can hand out one at a time: its cases, case_s and serial_s
    (anything else, or a payload the kind refuses, is None and runs whole: the worker then answers with the kind's
    own error)."""
    if kind != "cpu_tests":
        return None
    try:
        return tests_spec(payload)
    except ValueError:
        return None


@dataclass
class _Suite:
    """A malleable suite in flight in the pool: its bookkeeping, the cores it holds, its lanes (one per core with a
    case running), what its cases gave."""

    book: MalleableSuite
    held: list[int]
    case_s: float
    deadline: float
    lanes: set[asyncio.Task[None]] = field(default_factory=set)
    passed: int = 0
    error: str | None = None
    cases_phase: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def end(self) -> tuple[float, int]:
        """Its entry in the completion heap: when its cases left end on the cores it holds, and those cores."""
        b = self.book
        return time.monotonic() + (b.pending + b.running) * self.case_s / max(b.held, 1), b.held


class WorkerPool:
    """``size`` persistent workers over a budget of ``size`` cores; :meth:`run` waits for cores, then runs on an
    idle worker bound to exactly them.

    ``policy="elastic"``: ARL-Tangram's scheduler (:func:`services.actions.elastic.schedule`) decides in rounds —
    one per event-loop turn with a change (an arrival or a completion), over the queue gathered by then — which
    waiting actions start and with how many cores; an elastic kind gets its degree of parallelism. ``"chorus"``:
    the same with Chorus's extensions (:data:`services.actions.elastic.CHORUS`: the estimate counts the cores a
    running action frees, shortest expected action first with an ageing bound of ``age_s``). ``"fcfs"``: one core per action in
    arrival order (no backfilling), the baseline. ``malleable`` (elastic and chorus): a ``cpu_tests`` suite's cases
    are handed to its cores one at a time (:meth:`_malleable`).
    """

    def __init__(self, size: int, memory_mb: int, python: str = sys.executable, policy: str = "elastic",
                 depth: int = 2, malleable: bool = False, age_s: float = CHORUS.age_s,
                 preload: Sequence[str] = ()) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.malleable = malleable and policy != "fcfs"
        self.depth = depth
        # the settings schedule() runs with: the paper's, or Chorus's extensions with this ageing bound
        self.settings = replace(CHORUS, age_s=age_s) if policy == "chorus" else PAPER
        self.size = size
        self.scheduler = FcfsScheduler(size)
        # allocate-on-execution (ARL-Tangram §5.2): each action's process is bound to exactly the cores it holds
        self.cpu = CpuManager([local_node(size)])
        self.workers = [Worker(memory_mb, python, preload) for _ in range(size)]
        self._idle = list(self.workers)
        self.counters: Counter[str] = Counter()
        self.profile = DurationProfile()
        self.acts = ActBook()
        self._waiting: list[tuple[Action, asyncio.Future[list[int]]]] = []
        self._fcfs_waiting: Counter[str] = Counter()  # fcfs: actions waiting for a core, by kind
        self._ends: dict[int, tuple[float, int]] = {}  # running action -> its expected end (monotonic), its cores
        self._suites: dict[int, _Suite] = {}  # malleable suites running (``malleable``)
        self._round_due = False

    @property
    def queued(self) -> int:
        return self.scheduler.waiting if self.policy == "fcfs" else len(self._waiting)

    @property
    def queued_kinds(self) -> dict[str, int]:
        """Actions waiting for cores, by kind."""
        if self.policy == "fcfs":
            return {k: n for k, n in self._fcfs_waiting.items() if n > 0}
        return dict(Counter(a.kind for a, _ in self._waiting))

    @property
    def busy(self) -> int:
        return self.scheduler.busy if self.policy == "fcfs" else len(self.cpu.nodes["local"].busy)

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self.workers))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)

    def pids(self) -> list[int | None]:
        return [w.proc.pid if w.alive and w.proc is not None else None for w in self.workers]

    async def run(self, kind: str, payload: dict[str, Any], timeout_s: float) -> Outcome:
        """Run one action when the scheduler gives it cores; errors come back in the :class:`Outcome`."""
        submitted = time.monotonic()
        if self.policy == "fcfs":
            self._fcfs_waiting[kind] += 1
            try:
                await self.scheduler.acquire(1)
            finally:
                self._fcfs_waiting[kind] -= 1
            try:
                cores = self.cpu.allocate("local", 1)
                assert cores is not None  # the scheduler grants no more cores than the CPU manager holds
                queue_s = time.monotonic() - submitted
                try:
                    outcome = await self._execute(kind, payload, timeout_s, cores)
                finally:
                    self.cpu.release("local", cores)
            finally:
                self.scheduler.release(1)
            return self._account(kind, 1, outcome, queue_s, submitted)
        action = formulate(kind, payload, self.size, self.profile)
        action.arrival = submitted
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((action, fut))
        self._ask_round()
        try:
            cores = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.cpu.release("local", fut.result())
            self._waiting = [(a, f) for a, f in self._waiting if f is not fut]
            self._ask_round()
            raise
        spec = malleable_spec(kind, payload) if self.malleable else None
        if spec is not None:
            return await self._malleable(kind, spec, timeout_s, action, cores, submitted)
        key = id(fut)
        self._ends[key] = (time.monotonic() + action.get_dur(len(cores)), len(cores))
        queue_s = time.monotonic() - submitted
        try:
            elastic = kind in ELASTIC
            outcome = await self._execute(kind, {**payload, "parallelism": len(cores)} if elastic else payload,
                                          timeout_s, cores)
            if outcome.error is None:
                self.profile.observe(action, len(cores), outcome.exec_s or outcome.seconds)
        finally:
            self._ends.pop(key, None)
            self.cpu.release("local", cores)
            self._ask_round()
        return self._account(kind, len(cores), outcome, queue_s, submitted)

    async def _malleable(self, kind: str, spec: tuple[int, float, float], timeout_s: float, action: Action,
                         cores: list[int], submitted: float) -> Outcome:
        """Chorus's malleable suite (:class:`services.actions.elastic.MalleableSuite`): its serial part on one of
        the cores it was given, then each case on whichever core it holds when the case is due; at a case boundary
        a core goes back when other actions wait (the suite keeps one), and idle cores join it while nobody waits
        (:meth:`_grow`). Each case is one call of the kind with one case on one core."""
        queue_s = time.monotonic() - submitted
        t0 = time.monotonic()
        cases, case_s, serial_s = spec
        book = MalleableSuite(cases, action.cost["cpu"].hi or self.size)
        took = book.grant(len(cores))
        if took < len(cores):  # more cores than cases: the rest go back at once
            self.cpu.release("local", cores[took:])
            cores = cores[:took]
        suite = _Suite(book, list(cores), case_s, t0 + timeout_s)
        key = id(suite)
        self._suites[key] = suite
        self._ends[key] = (t0 + action.get_dur(took), took)
        try:
            serial = await self._execute(kind, {"cases": 1, "case_s": 0.0, "serial_s": serial_s, "parallelism": 1},
                                         timeout_s, cores[:1])
            if serial.error is not None:
                suite.error = serial.error
            else:
                suite.cases_phase = True
                self._lanes(suite, suite.held[:book.start_cases()])
                await suite.done.wait()
        finally:
            for task in suite.lanes:
                task.cancel()
            if suite.held:
                self.cpu.release("local", suite.held)
            suite.held = []
            self._suites.pop(key, None)
            self._ends.pop(key, None)
            self._ask_round()
        seconds = time.monotonic() - t0
        if suite.error is not None:
            outcome = Outcome(None, suite.error, seconds, seconds)
        else:
            self.profile.observe(action, book.peak, seconds)
            outcome = Outcome({"cases": cases, "passed": suite.passed, "parallelism": book.peak, "malleable": True,
                               "seconds": seconds}, None, seconds, seconds)
        return self._account(kind, book.peak, outcome, queue_s, submitted)

    def _lanes(self, suite: _Suite, cores: list[int]) -> None:
        for core in cores:
            task = asyncio.get_running_loop().create_task(self._lane(suite, core))
            suite.lanes.add(task)
            task.add_done_callback(suite.lanes.discard)

    async def _lane(self, suite: _Suite, core: int) -> None:
        """One core of a malleable suite: a case at a time until the suite gives the core back."""
        try:
            while True:
                left = suite.deadline - time.monotonic()
                if left <= 0:
                    out = Outcome(None, "timeout: the suite's time ran out between two of its cases", 0.0)
                else:
                    out = await self._execute("cpu_tests", {"cases": 1, "case_s": suite.case_s, "serial_s": 0.0,
                                                            "parallelism": 1}, left, [core])
                if out.error is not None:
                    suite.error = suite.error or out.error
                elif out.result is not None:
                    suite.passed += int(out.result.get("passed", 0))
                # a failed suite runs nothing more: every core goes back
                if suite.book.case_done(others_wait=bool(self._waiting), stop=suite.error is not None):
                    suite.held.remove(core)
                    self.cpu.release("local", [core])
                    self._ends[id(suite)] = suite.end()
                    self._ask_round()
                    return
                suite.book.start_cases()  # the next case on this core
        except Exception as exc:  # the suite ends with it (its cores go back in _malleable)
            suite.error = suite.error or f"{type(exc).__name__}: {exc}"
            suite.done.set()
        finally:
            # The last lane to end says the suite is done. Two lanes can end in one turn of the loop, before either's
            # done-callback took it out of suite.lanes: a lane whose task is done counts as gone.
            me = asyncio.current_task()
            if suite.book.running == 0 and all(t is me or t.done() for t in suite.lanes):
                suite.done.set()

    def _grow(self) -> None:
        """Idle cores and nobody waiting: they join the running malleable suites with cases left, the one with the
        least work left first."""
        free = self.cpu.nodes["local"].free_cores()
        for suite in sorted(self._suites.values(), key=lambda s: s.book.pending):
            if free <= 0:
                return
            if not suite.cases_phase or suite.error is not None or suite.book.wanted() <= 0:
                continue
            n = min(free, suite.book.wanted())
            cores = self.cpu.allocate("local", n)
            if not cores:
                return
            suite.book.grant(len(cores))
            suite.held.extend(cores)
            free -= len(cores)
            self._lanes(suite, cores[:suite.book.start_cases()])
            self._ends[id(suite)] = suite.end()

    def _account(self, kind: str, cores: int, outcome: Outcome, queue_s: float, submitted: float) -> Outcome:
        outcome.queue_s = queue_s
        self.acts.record(kind, "cpu", cores, queue_s, outcome.exec_s, time.monotonic() - submitted)
        return outcome

    def _ask_round(self) -> None:
        if not self._round_due:
            self._round_due = True
            asyncio.get_running_loop().call_soon(self._round)

    def _round(self) -> None:
        """One scheduling round: Algorithm 1 over the waiting actions and the free cores."""
        self._round_due = False
        self._waiting = [(a, f) for a, f in self._waiting if not f.done()]
        free = self.cpu.nodes["local"].free_cores()
        if self._waiting and free > 0:
            self._start_waiting(free)
        if self._suites and not self._waiting:
            self._grow()  # idle cores and nobody waiting: the malleable suites take them

    def _start_waiting(self, free: int) -> None:
        """Algorithm 1 over the waiting actions and the ``free`` cores: the chosen ones get their cores."""
        now = time.monotonic()
        decision = schedule([a for a, _ in self._waiting], {"cpu": free},
                            {"cpu": [(max(0.0, end - now), n) for end, n in self._ends.values()]}, depth=self.depth,
                            policy=self.settings, now=now)
        started = {id(a): units["cpu"] for a, units in decision.start}
        left = []
        for action, fut in self._waiting:
            n = started.get(id(action))
            if n is None:
                left.append((action, fut))
                continue
            cores = self.cpu.allocate("local", n)
            assert cores is not None  # the scheduler never allocates more than is free
            fut.set_result(cores)
        self._waiting = left

    async def _execute(self, kind: str, payload: dict[str, Any], timeout_s: float, cores: list[int]) -> Outcome:
        # At most `size` actions hold cores at once (each holds at least one), so an idle worker exists here.
        worker = self._idle.pop()
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
