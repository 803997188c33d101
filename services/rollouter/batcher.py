"""Dynamic batching in front of one engine: merge requests arriving within a window, one generation at a time.

Every engine call and every weight load runs on the same single worker thread, so a generation never sees
two weight versions. Requests with different sampling settings and different LoRA adapters share a batch:
both are per row in the engine. Pause stops admitting (queued requests wait), drain waits for in-flight work.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.rollouter.engine import GenResult, SamplingParams, TorchEngine

T = TypeVar("T")


class RequestExpired(TimeoutError):
    """A request waited in the queue longer than the requester's timeout."""


@dataclass
class Job:
    """One request: its rows share the sampling settings and adapter; answered as a whole with one version."""

    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future[tuple[int, list[GenResult]]]
    adapter: str | None = None
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    rows: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    max_requests_per_batch: int = 0
    max_adapters_per_batch: int = 0  # distinct adapters (the base counts as one) generated together
    expired: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0


class EngineQueue:
    """The request queue in front of one engine and its single worker thread: what both batchers share (submit,
    pause and resume, drain, flush, failing the queue, calls on the worker thread between generations)."""

    def __init__(self, engine: Any, executor: Executor, *, max_batch: int, request_timeout_s: float) -> None:
        self.engine = engine
        self.executor = executor
        self.max_batch = max_batch
        self.request_timeout_s = request_timeout_s
        self.stats = BatchStats()
        self._queue: deque[Job] = deque()
        self._work = asyncio.Event()
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._idle = asyncio.Event()  # no request in flight
        self._idle.set()
        self.in_flight = 0  # requests handed to the engine and not answered yet

    # --- state ---------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def paused(self) -> bool:
        return not self._admitting.is_set()

    def submit(self, prompts: list[list[int]], params: SamplingParams,
               adapter: str | None = None) -> asyncio.Future[tuple[int, list[GenResult]]]:
        """Queue a request; the future resolves to (version, one result per prompt): the weights' version, or the
        oldest version among the tokens of a continuous engine's answer.

        An adapter the engine lacks raises :class:`UnknownAdapter` here, so it never fails a merged batch; a request
        :meth:`_refused` fails its future at once.
        """
        self.engine.check_adapter(adapter)
        fut: asyncio.Future[tuple[int, list[GenResult]]] = asyncio.get_running_loop().create_future()
        refused = self._refused(prompts, params)
        if refused is not None:
            fut.set_exception(refused)
            return fut
        self._queue.append(Job(prompts, params, fut, adapter))
        self._work.set()
        return fut

    def _refused(self, prompts: list[list[int]], params: SamplingParams) -> Exception | None:
        """Why a request can never be served (None: it can)."""
        return None

    def pause(self) -> None:
        """Stop admitting new work; queued requests wait for :meth:`resume`."""
        self._admitting.clear()

    def resume(self) -> None:
        self._admitting.set()

    def _drained(self) -> asyncio.Event:
        """The event :meth:`drain` waits for."""
        return self._idle

    async def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._drained().wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def flush(self, timeout_s: float) -> bool:
        """Wait until the queue is empty and nothing is in flight (used on shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue or self.in_flight:
            if time.monotonic() > deadline or (self.paused and not self.in_flight):
                return False
            await asyncio.sleep(0.01)
        return True

    def fail_queued(self, exc: BaseException) -> int:
        """Fail every queued request (shutdown); returns how many."""
        n = 0
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(exc)
                n += 1
        return n

    async def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine's worker thread, between generations (e.g. a weight load)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def load(self, fn: Callable[[], T], timeout_s: float = 600.0) -> T:
        """A weight load: between two generations, so no answer mixes versions."""
        return await self.exclusive(fn)

    # --- queue ---------------------------------------------------------------------------
    def _rows_queued(self) -> int:
        return sum(len(j.prompts) for j in self._queue)

    def _head(self, now: float) -> Job | None:
        """The first queued request still wanted, or None: requests given up (cancelled) are dropped from the head,
        requests that waited longer than ``request_timeout_s`` are failed with :class:`RequestExpired`."""
        while self._queue:
            job = self._queue[0]
            if job.future.done():  # requester gave up (cancelled)
                self._queue.popleft()
                continue
            if now - job.enqueued_at > self.request_timeout_s:
                self._queue.popleft()
                self.stats.expired += 1
                job.future.set_exception(RequestExpired(
                    f"request waited {now - job.enqueued_at:.1f}s in the queue (limit {self.request_timeout_s}s)"))
                continue
            return job
        return None


class Batcher(EngineQueue):
    """Queue + window + single worker thread around a :class:`TorchEngine`."""

    def __init__(self, engine: TorchEngine, executor: Executor, *, max_batch: int, window_s: float,
                 request_timeout_s: float) -> None:
        super().__init__(engine, executor, max_batch=max_batch, request_timeout_s=request_timeout_s)
        self.window_s = window_s
        self.rows_in_flight = 0

    # --- loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: wait for work and admission, collect a window's worth, generate, answer."""
        while True:
            await self._work.wait()
            await self._admitting.wait()
            if self.window_s > 0 and self._rows_queued() < self.max_batch:
                await asyncio.sleep(self.window_s)
            if self.paused:  # paused during the window: keep everything queued
                continue
            jobs = self._take()
            if not self._queue:
                self._work.clear()
            if not jobs:
                continue
            self.in_flight += len(jobs)
            rows = sum(len(j.prompts) for j in jobs)
            self.rows_in_flight += rows
            self._idle.clear()
            try:
                await self._execute(jobs)
            finally:
                self.in_flight -= len(jobs)
                self.rows_in_flight -= rows
                if self.in_flight == 0:
                    self._idle.set()

    def occupancy(self) -> dict[str, int]:
        """What the rollout manager balances on: rows waiting in the queue, rows generating, tokens in flight."""
        return {"queued_rows": self._rows_queued(), "running_rows": self.rows_in_flight, "tokens": 0}

    def _take(self) -> list[Job]:
        """Whole requests up to ``max_batch`` rows (at least one request); expired ones are failed."""
        jobs: list[Job] = []
        rows = 0
        now = time.monotonic()
        while (job := self._head(now)) is not None:
            if jobs and rows + len(job.prompts) > self.max_batch:
                break
            jobs.append(self._queue.popleft())
            rows += len(job.prompts)
        return jobs

    async def _execute(self, jobs: Sequence[Job]) -> None:
        prompts = [p for j in jobs for p in j.prompts]
        params = [j.params for j in jobs for _ in j.prompts]
        adapters = [j.adapter for j in jobs for _ in j.prompts]
        t0 = time.perf_counter()
        try:
            version, results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._generate, prompts, params, adapters)
        except Exception as exc:  # a failed generation answers its requests with the error
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(exc)
            return
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.batches += 1
        self.stats.requests += len(jobs)
        self.stats.rows += len(prompts)
        self.stats.tokens += sum(len(r.ids) for r in results)
        self.stats.max_requests_per_batch = max(self.stats.max_requests_per_batch, len(jobs))
        self.stats.max_adapters_per_batch = max(self.stats.max_adapters_per_batch, len(set(adapters)))
        start = 0
        for j in jobs:
            part = results[start : start + len(j.prompts)]
            start += len(j.prompts)
            if not j.future.done():
                j.future.set_result((version, part))

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams],
                  adapters: list[str | None]) -> tuple[int, list[GenResult]]:
        # Runs on the worker thread: the version is read where the weights are used, so it is exact.
        version = self.engine.version
        return version, self.engine.generate(prompts, params, adapters)

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "in_flight": self.in_flight, "queued": self.queued, "paused": self.paused,
            "batches": s.batches, "requests": s.requests, "rows_generated": s.rows, "tokens": s.tokens,
            "tokens_per_s": round(s.tokens_per_s, 1), "max_requests_per_batch": s.max_requests_per_batch,
            "max_adapters_per_batch": s.max_adapters_per_batch,
            "expired": s.expired, "busy_s": round(s.busy_s, 4), "engine": "static",
        }


@dataclass
class RowJob:
    """A request in the continuous engine: answered once every row is done."""

    job: Job
    results: list[GenResult | None]
    remaining: int


class ContinuousBatcher(EngineQueue):
    """Requests in, rows of a :class:`~services.rollouter.continuous.ContinuousEngine` out, one step at a time.

    Every engine step and every weight load runs on the one worker thread, so a step never sees two weight
    versions. Requests join the running batch as soon as rows are free (``max_batch`` rows in flight); one
    request's rows may start over several steps (FIFO, nothing overtakes the head of the queue).

    A sync (``pause`` → ``drain`` → load → ``resume``) behaves as ``on_sync`` says. ``drain``: no new request
    starts, the running rows finish on the weights they started with, then the load (no answer mixes
    versions). ``interrupt``: steps stop at the next step boundary, the load happens with rows mid-flight,
    and on resume each row recomputes its KV under the new weights and goes on (partial rollout: an answer's
    tokens may carry several versions, each recorded).
    """

    def __init__(self, engine: Any, executor: Executor, *, max_batch: int, request_timeout_s: float,
                 on_sync: str = "drain") -> None:
        super().__init__(engine, executor, max_batch=max_batch, request_timeout_s=request_timeout_s)
        self.on_sync = on_sync
        self._between = asyncio.Event()  # no step running
        self._between.set()
        self._jobs: dict[int, RowJob] = {}
        self.interrupted = 0  # syncs that found rows mid-generation (interrupt mode)
        self.mixed_answers = 0  # answers whose tokens carry more than one version

    # --- state ---------------------------------------------------------------------------
    def _refused(self, prompts: list[list[int]], params: SamplingParams) -> Exception | None:
        """A row over the KV budget: it could never start."""
        try:
            for p in prompts:
                self.engine.check_fits(len(p), params)
        except ValueError as exc:
            return exc
        return None

    def pause(self) -> None:
        """Stop starting requests (and, in interrupt mode, stop stepping at the next boundary)."""
        self._admitting.clear()
        if self.on_sync == "interrupt" and self.engine.busy:
            self.interrupted += 1

    def resume(self) -> None:
        self._admitting.set()
        self._work.set()

    def _drained(self) -> asyncio.Event:
        """drain mode: no request is in the engine; interrupt mode: no step runs."""
        return self._between if self.on_sync == "interrupt" else self._idle

    async def load(self, fn: Callable[[], T], timeout_s: float = 600.0) -> T:
        """Run a weight load: in drain mode once the running rows are done (no answer mixes versions), in
        interrupt mode at the next step boundary."""
        if self.on_sync == "interrupt":
            return await self.exclusive(fn)
        was_paused = self.paused
        self._admitting.clear()
        try:
            if not await self.drain(timeout_s):
                raise TimeoutError(f"{self.in_flight} requests still generating after {timeout_s}s")
            return await self.exclusive(fn)
        finally:
            if not was_paused:
                self.resume()

    # --- loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            stepping = self.engine.busy and (not self.paused or self.on_sync == "drain")
            new_rows = [] if self.paused else self._take()
            if not new_rows and not stepping:
                self._work.clear()
                if self.paused and self._queue:
                    await self._admitting.wait()
                continue
            self._between.clear()
            t0 = time.perf_counter()
            try:
                finished = await loop.run_in_executor(self.executor, self.engine.step, new_rows)
            except Exception as exc:  # a failed step answers every request in the engine with the error
                self._fail_engine(exc)
                continue
            finally:
                self._between.set()
            self.stats.busy_s += time.perf_counter() - t0
            self.stats.batches += 1
            running = self.engine.running
            self.stats.max_requests_per_batch = max(self.stats.max_requests_per_batch, self.in_flight)
            self.stats.max_adapters_per_batch = max(self.stats.max_adapters_per_batch,
                                                    len({r.adapter for r in running}))
            for row in finished:
                self._finished(row)
            if self.engine.busy or self._queue:
                self._work.set()

    def _take(self) -> list[Any]:
        """Rows of whole requests while the engine has free rows; expired requests are failed."""
        rows: list[Any] = []
        now = time.monotonic()
        room = self.max_batch - self.engine.rows_in_flight
        while room > 0 and (job := self._head(now)) is not None:
            self._queue.popleft()
            key = id(job)
            self._jobs[key] = RowJob(job, [None] * len(job.prompts), len(job.prompts))
            try:
                rows += [self.engine.row(p, job.params, job.adapter, handle=(key, i)) for i, p in enumerate(job.prompts)]
            except ValueError as exc:
                del self._jobs[key]
                job.future.set_exception(exc)
                continue
            self.in_flight += 1
            self._idle.clear()
            room -= len(job.prompts)
        return rows

    def _finished(self, row: Any) -> None:
        key, i = row.handle
        rj = self._jobs.get(key)
        if rj is None:
            return
        rj.results[i] = row.result()
        rj.remaining -= 1
        if rj.remaining:
            return
        del self._jobs[key]
        results = [r for r in rj.results if r is not None]
        versions = {v for r in results for v in r.versions}
        version = min(versions) if versions else self.engine.version
        if len(versions) > 1:
            self.mixed_answers += 1
        self.stats.requests += 1
        self.stats.rows += len(results)
        self.stats.tokens += sum(len(r.ids) for r in results)
        self._answered()
        if not rj.job.future.done():
            rj.job.future.set_result((version, results))

    def _answered(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def _fail_engine(self, exc: BaseException) -> None:
        self.engine.reset()
        for rj in self._jobs.values():
            self._answered()
            if not rj.job.future.done():
                rj.job.future.set_exception(exc)
        self._jobs.clear()

    def occupancy(self) -> dict[str, int]:
        """What the rollout manager balances on: rows waiting in the queue, rows in the engine (running or admitted
        and waiting for a slot), the KV tokens they reserve."""
        e = self.engine
        return {"queued_rows": self._rows_queued(), "running_rows": len(e.running) + len(e.waiting),
                "tokens": int(e.reserved)}

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        e = self.engine
        return {
            "in_flight": self.in_flight, "queued": self.queued, "paused": self.paused, "engine": e.name,
            "on_sync": self.on_sync, "rows_running": len(e.running), "rows_waiting": len(e.waiting),
            "steps": s.batches, "requests": s.requests, "rows_generated": s.rows, "tokens": s.tokens,
            "tokens_per_s": round(s.tokens_per_s, 1), "max_requests_in_flight": s.max_requests_per_batch,
            "max_adapters_per_batch": s.max_adapters_per_batch, "expired": s.expired, "busy_s": round(s.busy_s, 4),
            "interrupted_syncs": self.interrupted, "mixed_version_answers": self.mixed_answers,
            **{f"engine_{k}": v for k, v in e.stats.items()},
        }
