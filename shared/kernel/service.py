"""The service base: connect, micro service endpoint, periodic metrics, DLQ, graceful drain on signals.

A service subclasses :class:`Service`, implements :meth:`setup` (subscriptions and loops started with
:meth:`spawn`) and optionally :meth:`teardown` (drain in-flight work), and its ``__main__`` calls
:func:`main_for`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from nats.micro import add_service
from nats.micro.request import Request
from pydantic import BaseModel

from shared.kernel.bus import BrokerUnreachable, connect, ensure_run
from shared.kernel.codec import DecodeError, decode, encode_json
from shared.kernel.config import ChorusConfig, ConfigError, load_config
from shared.kernel.credentials import describe
from shared.kernel.logs import setup_logging
from shared.kernel.peers import PeerWatch
from shared.kernel.runstate import run_finished
from shared.kernel.subjects import Names

VERSION = "0.1.0"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
RECORD_BACKOFF_S = (0.1, 2.0)  # first and largest wait between attempts to write a record
START_WAIT_S = 60.0  # how long a starting service waits for the broker and its JetStream
EX_TEMPFAIL = 75  # the exit code of a start the broker failed (sysexits' temporary failure)
# No server of the NATS URL answered within nats.connect_timeout_s (sysexits' EX_UNAVAILABLE): not retried in
# the process, since a wrong URL stays wrong; a supervisor (chorus up, systemd, Kubernetes) restarts it.
EX_UNAVAILABLE = 69
DONE_POLL_S = 1.0  # how often a service started with --exit-when-done reads whether the run has finished
# --exit-when-done: how long a finished run's service waits for the stage before it to close (exit_blocker) before
# it exits anyway (that stage is gone for good); what it leaves unrecorded is then named in its log
EXIT_WAIT_S = 120.0
CLOSE_SHARE_S = 4.0  # of run.stop_grace_s, kept for closing (tasks, micro service, connection) after the teardown
# The run cannot go on and a restart would not help (the user's workflow keeps failing): sysexits' EX_CONFIG.
# `chorus up` stops the run on it; systemd units do not restart on it (RestartPreventExitStatus).
EX_RUN_FAILED = 78


def _file_error(exc: BaseException) -> bool:
    """Whether a start-up error is a file's (missing, a directory, not readable, or any OSError naming a file), not
    the network's: those exit EX_RUN_FAILED, the network's EX_TEMPFAIL."""
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError | PermissionError):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, ConnectionError) and exc.filename is not None


class Service:
    """One Chorus service instance. ``name`` is the service kind; ``per_model`` services need ``model``."""

    name: ClassVar[str] = "service"
    per_model: ClassVar[bool] = False
    exit_when_done = False  # set: exit 0 once the run has finished (`chorus serve --exit-when-done`)

    def __init__(self, cfg: ChorusConfig, *, nats_url: str, instance: str = "0", model: str | None = None) -> None:
        if self.per_model:
            if model is None:
                raise ConfigError(f"{self.name} runs per model: pass --model (one of {sorted(cfg.models)})")
            if model not in cfg.models:
                raise ConfigError(f"--model {model!r} is not one of the configured models {sorted(cfg.models)}")
        self.cfg = cfg
        self.nats_url = nats_url
        self.instance = instance
        self.model = model
        self.names = Names(cfg.run.id)
        self.counters: Counter[str] = Counter()
        self.started_at = time.time()
        self.log = structlog.get_logger().bind(service=self.name, instance=instance, model=model)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self.exit_code = 0
        self.start_interrupted = False  # a signal came before the start was complete
        self.ready = False  # setup() done and its subscriptions at the server
        self.exit_waiting_for: str | None = None  # --exit-when-done, the run finished: what the exit waits for
        # set by a rollouter that the rollout manager moved: after it stopped, the process serves this
        # (model, instance) instead (see serve_until_started)
        self.migrate_to: tuple[str, str] | None = None
        self.nc: NATS
        self.js: JetStreamContext
        self.kv: KeyValue
        self.obj: ObjectStore

    # --- to override ----------------------------------------------------------------------
    async def setup(self) -> None:
        """Subscribe and start loops (with :meth:`spawn`)."""

    async def teardown(self) -> None:
        """Drain in-flight work before the connection drains."""

    async def on_disconnected(self) -> None:
        """The connection to NATS dropped (it reconnects by itself, resubscribing what is subscribed then)."""

    async def _disconnected(self) -> None:
        self._last_drop = time.monotonic()
        self.counters["disconnects"] += 1
        await self.on_disconnected()

    def link_dropped_since(self, t0: float) -> bool:
        """Whether this service's own connection to NATS is down, or dropped since monotonic time ``t0``: a request
        that failed then failed on this side of the network, not on the peer's."""
        return not self.nc.is_connected or getattr(self, "_last_drop", 0.0) >= t0

    async def wait_link(self, settle_s: float) -> None:
        """Until connected again and ``settle_s`` past the last drop (peers' heartbeats have come back)."""
        while not self.stopping and (not self.nc.is_connected
                                     or time.monotonic() - getattr(self, "_last_drop", 0.0) < settle_s):
            await asyncio.sleep(0.2)

    def periodic_metrics(self) -> dict[str, Any]:
        """What only the periodic metrics message carries (records since the last one), not the status reply."""
        return {}

    def extra_metrics(self) -> dict[str, Any]:
        """Gauges added to the periodic metrics message."""
        return {}

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def client_name(self) -> str:
        suffix = f".{self.model}" if self.model else ""
        return f"{self.name}{suffix}.{self.instance}"

    @property
    def status_subject(self) -> str:
        """Where this instance answers status requests, and where peers probe whether it is alive."""
        return self.names.status(self.name, self.model, self.instance)

    async def _connect(self) -> None:
        """Connect and make sure the run's streams exist, for up to ``START_WAIT_S`` while the broker is coming
        up (a restarted server, a cluster electing its leaders)."""
        deadline = time.monotonic() + START_WAIT_S
        wait = 0.2
        while True:
            try:
                if getattr(self, "nc", None) is None or self.nc.is_closed:
                    self.nc = await connect(self.nats_url, self.client_name,
                                            timeout_s=self.cfg.nats.connect_timeout_s, nats_cfg=self.cfg.nats,
                                            kind=self.name, on_denied=self._on_denied,
                                            on_disconnected=self._disconnected)
                self.js = self.nc.jetstream(timeout=10.0)
                self.kv, self.obj = await ensure_run(self.js, self.cfg)
                return
            except BrokerUnreachable:
                raise  # the connect timeout is the whole budget for reaching a server
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                if time.monotonic() + wait > deadline:
                    raise
                self.counters["start_retries"] += 1
                self.log.warning("broker not ready; retrying", error=f"{type(exc).__name__}: {exc}", wait_s=wait)
                await asyncio.sleep(wait)
                wait = min(5.0, wait * 2)

    def _on_denied(self, operation: str, subject: str) -> None:
        """The server refused a publish or a subscription of this kind's credentials (bus.connect logged it)."""
        self.counters["permission_denied"] += 1
        self.counters[f"permission_denied_{operation}"] += 1

    async def start(self) -> None:
        await self._connect()
        self.peers = PeerWatch(self.nc, self.cfg.peers)
        self.spawn(self.peers.run(), "peers")
        self._micro = await add_service(
            self.nc,
            name=f"chorus-{self.name}",
            version=VERSION,
            description=f"Chorus {self.name} ({self.cfg.run.id})",
            metadata={"run": self.cfg.run.id, "instance": self.instance, "model": self.model or ""},
        )
        await self._micro.add_endpoint(
            name="status",
            subject=self.status_subject,
            handler=self._status_handler,
        )
        await self.setup()
        await self.nc.flush(timeout=10)  # every subscription of setup() is at the server from here on
        self.ready = True
        self.spawn(self._metrics_loop(), "metrics")
        if self.cfg.nats.jetstream_check_s > 0:
            self.spawn(self._server_watch(), "server-watch")
        if self.exit_when_done:
            self.spawn(self._done_loop(), "exit-when-done")
        self.log.info("service started", nats=self.nats_url, auth=describe(self.cfg.nats, self.name))

    def stop(self, code: int = 0) -> None:
        """Ask the service to drain and exit."""
        self.exit_code = self.exit_code or code
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait_stopped(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def serve(self) -> int:
        """Start, run until a signal or :meth:`stop`, drain, return the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (RuntimeError, ValueError):  # served from a thread that is not the main one: stop() ends it
                break
        else:
            loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
        starting = asyncio.ensure_future(self.start())
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            # a signal while connecting or loading a model ends the start at once
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        try:
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                self.start_interrupted = True
                self.log.info("stopped while starting")
                await self._close()
                return self.exit_code
            starting.result()
        except BrokerUnreachable as exc:
            self.log.error("service could not start: NATS is unreachable", nats=exc.url, error=str(exc))
            await self._close()
            return EX_UNAVAILABLE
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            # OSError is the broker's (a refused or reset connection) unless it is a file's: a configured file (a
            # model directory, a dataset) that is not there or cannot be read, which a restart finds so again
            if _file_error(exc):
                self.log.error("service cannot start: a file the config names cannot be opened; stopping the run",
                               error=f"{type(exc).__name__}: {exc}")
                await self._close()
                return EX_RUN_FAILED
            self.log.error("service could not start: the broker did not answer in time",
                           error=f"{type(exc).__name__}: {exc}")
            await self._close()
            return EX_TEMPFAIL
        except ConfigError as exc:  # a setting this machine cannot honour (device: cuda without CUDA): restarting won't help
            self.log.error("service cannot start with this config; stopping the run", error=f"ConfigError: {exc}")
            await self._close()
            return EX_RUN_FAILED
        except Exception as exc:
            self.log.error("service failed to start", error=f"{type(exc).__name__}: {exc}")
            await self._close()
            return 2
        await self._stop.wait()
        await self._drain_and_close()
        return self.exit_code

    async def _drain_and_close(self) -> None:
        """Teardown, then close, all within ``run.stop_grace_s``: a step that does not finish in its share is left
        behind (asyncio.wait, never wait_for, which would wait for a task that does not end on cancel)."""
        grace = self.cfg.run.stop_grace_s
        t0 = time.monotonic()
        self.log.info("draining", grace_s=grace)
        teardown = asyncio.ensure_future(self.teardown())
        done, _ = await asyncio.wait({teardown}, timeout=max(0.5, grace - CLOSE_SHARE_S))
        if not done:
            teardown.cancel()
            self.counters["teardowns_cut"] += 1
            self.log.warning("teardown did not finish in its share of the stop grace; left as a crash would",
                             seconds=round(time.monotonic() - t0, 2))
        elif not teardown.cancelled() and teardown.exception() is not None:
            exc = teardown.exception()
            self.log.error("teardown failed", error=f"{type(exc).__name__}: {exc}")
        await self._close(t0 + grace)
        self.log.info("stopped", exit_code=self.exit_code, seconds=round(time.monotonic() - t0, 2))

    async def _close(self, deadline: float | None = None) -> None:
        """Cancel every task (again, while one swallows its cancellation: Python 3.11's wait_for can), stop the micro
        service and drain the connection, by ``deadline`` (monotonic; default a few seconds from now)."""
        deadline = deadline if deadline is not None else time.monotonic() + CLOSE_SHARE_S

        def left(share: float = 1.0) -> float:
            return max(0.1, (deadline - time.monotonic()) * share)

        while self._tasks and time.monotonic() < deadline - 1.0:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.wait(list(self._tasks), timeout=min(0.5, left()))
        if self._tasks:
            self.log.error("tasks still running at the end of the stop; exiting without them",
                           tasks=sorted(t.get_name() for t in self._tasks))
        if getattr(self, "_micro", None) is not None:
            stopping = asyncio.ensure_future(self._micro.stop())
            done, _ = await asyncio.wait({stopping}, timeout=left(0.3))
            if not done:
                stopping.cancel()
                self.log.warning("micro stop did not finish in time")
            elif not stopping.cancelled() and stopping.exception() is not None:
                self.log.warning("micro stop failed", error=str(stopping.exception()))
        if getattr(self, "nc", None) is not None and self.nc.is_connected:
            await self._last_metrics(left(0.2))
            draining = asyncio.ensure_future(self.nc.drain())
            done, _ = await asyncio.wait({draining}, timeout=left())
            if not done:
                draining.cancel()
                self.log.warning("nats drain did not finish in time")
            elif not draining.cancelled() and draining.exception() is not None:
                self.log.warning("nats drain failed", error=str(draining.exception()))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run a background task owned by this service; a crash is logged, counted and stops the service."""
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                self.counters["task_failures"] += 1
                self.log.error("background task failed", task=name, error=f"{type(exc).__name__}: {exc}",
                               exc_info=exc)
                self.stop(1)

        task.add_done_callback(done)
        return task

    # --- helpers --------------------------------------------------------------------------
    def decode_own(self, cls: type[M], data: bytes, model: str | None = None) -> M:
        """Decode a per-model message; one addressed to another model than ``model`` (default: this service's) is
        a :class:`DecodeError` too."""
        message = decode(cls, data)
        expected = self.model if model is None else model
        got = getattr(message, "model", None)
        if got != expected:
            raise DecodeError(f"{cls.__name__} for model {got!r} on a subject of model {expected!r}")
        return message

    async def finish_task(self, task: asyncio.Task[Any] | None, timeout_s: float) -> None:
        """Give a loop that is finishing its work in hand up to ``timeout_s`` during teardown."""
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self.log.warning("loop did not finish in time", task=task.get_name(), timeout_s=timeout_s)

    async def release(self, sub: Any) -> None:
        """Unsubscribe a pull subscription at teardown, so a late reply to its last fetch cannot stall drain()."""
        if sub is None:
            return
        try:
            await sub.unsubscribe()
        except nats.errors.Error as exc:
            self.log.warning("unsubscribe failed", error=f"{type(exc).__name__}: {exc}")

    async def to_dlq(self, subject: str, data: bytes, reason: str) -> None:
        """Reject a message: publish it unchanged on ``dlq.<service>`` with the reason in headers, count it."""
        self.counters["dlq"] += 1
        self.log.warning("rejected message", subject=subject, reason=reason, bytes=len(data))
        await self.publish_quietly(self.names.dlq(self.name), data, headers={
            "Chorus-Reason": reason[:1000],
            "Chorus-Subject": subject,
            "Chorus-Service": self.name,
            "Chorus-Instance": self.instance,
        })

    async def publish_quietly(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> bool:
        """A core publish that is allowed to fail (the connection is away and its buffer full): counted, logged,
        never raised into the loop that made it."""
        try:
            await self.nc.publish(subject, data, headers=headers)
            return True
        except nats.errors.Error as exc:
            self.counters["publish_errors"] += 1
            self.log.warning("publish failed", subject=subject, error=f"{type(exc).__name__}: {exc}")
            return False

    def _event_body(self, kind: str, fields: dict[str, Any]) -> bytes:
        return encode_json({"kind": kind, "instance": self.instance, "model": self.model, "time": time.time(),
                            **fields})

    async def event(self, kind: str, **fields: Any) -> None:
        """A best-effort event (core publish; the events stream keeps it when the broker gets it)."""
        await self.publish_quietly(self.names.events(self.name), self._event_body(kind, fields))

    async def retried(self, op: Callable[[], Awaitable[T]], what: str) -> T | None:
        """An idempotent broker operation, retried with backoff while the broker is away (a restart, a failover);
        None if the service stops first."""
        wait = RECORD_BACKOFF_S[0]
        while True:
            try:
                return await op()
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters["broker_retries"] += 1
                self.log.warning(f"{what} failed; retrying", error=f"{type(exc).__name__}: {exc}")
            if self.stopping:
                return None
            await asyncio.sleep(wait)
            wait = min(RECORD_BACKOFF_S[1], wait * 2)

    async def record(self, kind: str, record_id: str, **fields: Any) -> bool:
        """An event that must not be lost, such as which samples a step trained or why samples were dropped:
        written to the events stream and acknowledged there (``record_id`` deduplicates a repeat), retried with
        backoff while the broker is away. Write it before acknowledging what it reports. False only if the
        service stopped first: then leave the messages unacknowledged, to be redelivered and recorded again."""
        data = self._event_body(kind, fields)
        wait = RECORD_BACKOFF_S[0]
        while True:
            try:
                await self.js.publish(self.names.events(self.name), data, timeout=5.0,
                                      headers={"Nats-Msg-Id": record_id})
                return True
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters["record_retries"] += 1
                self.log.warning("writing a record failed", kind=kind, error=f"{type(exc).__name__}: {exc}")
            if self.stopping:
                return False
            await asyncio.sleep(wait)
            wait = min(RECORD_BACKOFF_S[1], wait * 2)

    def metrics_snapshot(self) -> dict[str, Any]:
        return {
            "service": self.name,
            "instance": self.instance,
            "model": self.model,
            "run": self.cfg.run.id,
            "time": time.time(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "counters": dict(self.counters),
            **({"peers": dict(self.peers.counters)} if hasattr(self, "peers") else {}),
            **self.extra_metrics(),
        }

    async def _metrics_loop(self) -> None:
        while not self.stopping:
            await self.publish_quietly(self._metrics_subject(),
                                       encode_json({**self.metrics_snapshot(), **self.periodic_metrics()}))
            await asyncio.sleep(self.cfg.metrics_interval_s)

    def _metrics_subject(self) -> str:
        return self.names.metrics(self.name, f"{self.model}-{self.instance}" if self.model else self.instance)

    async def _last_metrics(self, timeout_s: float) -> None:
        """The counters as they are at the end (a stop can come between two metrics messages: what made it, say
        the last reward errors, would otherwise never be published)."""
        try:
            body = encode_json(self.metrics_snapshot())
            await asyncio.wait_for(self.publish_quietly(self._metrics_subject(), body), timeout_s)
        except Exception as exc:  # noqa: BLE001 - the last message is a courtesy, never a reason to fail the stop
            self.log.debug("last metrics not published", error=f"{type(exc).__name__}: {exc}")

    async def _server_watch(self) -> None:
        """Move to another server of the cluster when this one stops serving JetStream for three checks in a row
        while the connection itself stays up: a server in a minority partition answers pings, but no stream it
        holds a replica of may take a write there, and no core message reaches the rest of the cluster."""
        every = self.cfg.nats.jetstream_check_s
        misses = 0
        while not self.stopping:
            await asyncio.sleep(every)
            if not self.nc.is_connected:
                misses = 0
                continue
            try:
                reply = await self.nc.request("$JS.API.INFO", b"", timeout=min(every, 2.0))
                failed = b'"error"' in reply.data
            except (nats.errors.Error, TimeoutError):
                failed = True
            misses = misses + 1 if failed else 0
            others = [s for s in self.nc.servers if s.netloc != (self.nc.connected_url.netloc
                                                                  if self.nc.connected_url else None)]
            if misses >= 3 and others:
                self.counters["server_moves"] += 1
                self.log.warning("this NATS server has served no JetStream for three checks; moving to another "
                                 "server of the cluster", server=str(self.nc.connected_url.netloc
                                                                     if self.nc.connected_url else None),
                                 every_s=every)
                misses = 0
                await self.nc.force_reconnect()

    async def exit_blocker(self) -> str | None:
        """Once the run has finished: what this service still has to do before --exit-when-done may stop it (the
        samples of the stage before it still coming, or still to be recorded), None when nothing. A service that
        consumes a run's samples overrides it; the others exit at once."""
        return None

    async def _done_loop(self) -> None:
        """--exit-when-done: stop (exit 0) once the run has finished, read from the run's KV, and this service has
        nothing left to record (:meth:`exit_blocker`; at most EXIT_WAIT_S)."""
        finished_at: float | None = None
        said: str | None = None
        while not self.stopping:
            try:
                if finished_at is None and await run_finished(self.kv, self.cfg):
                    finished_at = time.monotonic()
                if finished_at is not None:
                    waiting = await self.exit_blocker()
                    if waiting is None:
                        self.log.info("the run has finished; exiting (--exit-when-done)")
                        self.stop(0)
                        return
                    if time.monotonic() - finished_at > EXIT_WAIT_S:
                        self.counters["exit_wait_expired"] += 1
                        self.log.warning("the run has finished; exiting (--exit-when-done) without waiting longer",
                                         waited_s=EXIT_WAIT_S, waiting_for=waiting)
                        self.stop(0)
                        return
                    self.exit_waiting_for = waiting
                    if waiting.split(":")[0] != said:  # once per kind of wait, not per count
                        said = waiting.split(":")[0]
                        self.log.info("the run has finished; waiting before exiting", waiting_for=waiting)
            except (nats.errors.Error, TimeoutError) as exc:
                self.log.warning("reading whether the run has finished failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(DONE_POLL_S)

    async def _status_handler(self, req: Request) -> None:
        await req.respond(encode_json(self.metrics_snapshot()))


def dump_tasks() -> None:
    """`kill -USR2 PID`: every asyncio task's stack to stderr (the service's log), where a stuck await is
    (SIGUSR1 prints the threads')."""
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio tasks", file=sys.stderr)
    for task in tasks:
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def parse_args(service: type[Service], argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"chorus serve {service.name}", description=f"Run one Chorus {service.name}.")
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--nats", default=None, help="NATS URL (overrides nats.url)")
    p.add_argument("--model", default=None, help="model this instance serves" + (" (required)" if service.per_model else ""))
    p.add_argument("--instance", default="0", help="instance id (default 0)")
    p.add_argument("--exit-when-done", action="store_true",
                   default=os.environ.get("CHORUS_EXIT_WHEN_DONE", "").lower() in ("1", "true", "yes"),
                   help="exit 0 once every model of the run reached train.max_versions (env CHORUS_EXIT_WHEN_DONE=1)")
    return p.parse_args(argv)


def main_for(service: type[Service], argv: list[str] | None = None) -> None:
    """Entry point of ``python -m services.<name>`` and ``chorus serve <name>``."""
    args = parse_args(service, argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging(run=cfg.run.id)
    # `kill -USR1 PID` prints every thread's Python stack to stderr (the service's log): where a stuck service is
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    url = args.nats or cfg.nats.url
    if not url:
        print("error: no NATS URL: pass --nats nats://HOST:PORT or set nats.url in the config", file=sys.stderr)
        sys.exit(2)
    def make(model: str | None = args.model, instance: str = args.instance) -> Service:
        svc = service(cfg, nats_url=url, instance=instance, model=model)
        svc.exit_when_done = args.exit_when_done
        return svc

    try:
        first = make()  # the arguments are checked here
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    import uvloop

    served: list[Service] = []
    code = uvloop.run(_served(serve_until_started(first, make, served)))
    busy = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if (served and served[-1].start_interrupted) or busy:
        # a thread still works (a model loading when the signal came, a step in a worker): the interpreter would
        # wait for it at exit; the service is stopped, so it goes with the process
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> None:
    """End the process with ``code`` without waiting for what still runs in it (its output flushed first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _CountingExecutor(ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``), counting the calls still running in it."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="chorus-thread")
        self._running = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def counted() -> Any:
            with self._lock:
                self._running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1

        return super().submit(counted)

    @property
    def running(self) -> int:
        with self._lock:
            return self._running


async def _served(main: Awaitable[int]) -> int:
    """``main``'s exit code; a task still running after it (one that swallowed its cancellation), or a call of
    the default executor still running (a teardown cut at the stop grace left it), ends the process here, since
    the loop's own shutdown would wait for it (for ever, or past the supervisor's grace)."""
    executor = _CountingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    code = await main
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in others:
        t.cancel()
    if others:
        _, pending = await asyncio.wait(others, timeout=1.0)
        if pending:
            structlog.get_logger().error("tasks did not end after the service stopped; exiting without them",
                                         tasks=sorted(t.get_name() for t in pending))
            _exit_now(code)
    if executor.running:
        structlog.get_logger().warning("a thread still works after the service stopped; exiting without it",
                                       threads=executor.running)
        _exit_now(code)
    return code


async def serve_until_started(svc: Service, make: Callable[..., Service], served: list[Service] | None = None) -> int:
    """Serve ``svc``, then a fresh instance from ``make`` again while starting fails on the broker (a cluster
    still electing leaders, a server restarting), for up to ``START_WAIT_S``; a service that started and
    stopped is not restarted here — unless it stopped to migrate (``migrate_to``): then the process serves the
    new model under the new instance name, ``make(model, instance)``."""
    deadline = time.monotonic() + START_WAIT_S
    while True:
        if served is not None:
            served.append(svc)
        code = await svc.serve()
        if svc.migrate_to is not None and code == 0:
            model, instance = svc.migrate_to
            svc = make(model, instance)
            deadline = time.monotonic() + START_WAIT_S
            continue
        if code != EX_TEMPFAIL or svc.stopping or time.monotonic() > deadline:
            return code
        await asyncio.sleep(1.0)
        svc = make()
