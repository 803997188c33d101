"""Rollouter service: answers GenRequests on the bus, obeys paramsync's pause/load/resume control.

A LoRA model serves all its adapters from one engine; a request names its adapter, or none for the base.
An instance is in routing (subscribed to the model's generation subjects) only while it holds the served
version: one whose load failed stays out, loads the served version by itself, and then comes back. It loads
through the transport of the sync, or from the object store, where the trainer commits every version: a
rollouter started after its trainer died still finds the served weights. Paused by a paramsync that then dies
or freezes, it resumes by itself within a few probes; paused by a sync that is over (its paramsync gave up on
this instance while the pause was on its way, and will send no resume), within two.

Joining routing (at start, after a restart or a migration, after catching up) follows one order: register (so
that every sync from now on lists it), then join only while no sync is running and with the served version
loaded. A sync writes its phase before it lists the instances, so a sync the newcomer did not see running lists
it, pauses it and loads it before it commits; one it saw running is waited for. No instance is ever in routing
below the served version of the moment a request is routed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.rollouter import native
from services.rollouter.backends import Engine, RolloutEngine, build_engine
from services.rollouter.batcher import Batcher, ContinuousBatcher
from services.rollouter.engine import SamplingParams, TorchEngine, UnknownAdapter
from shared.kernel import events
from shared.kernel.bus import kv_get_int
from shared.kernel.codec import DecodeError, decode, encode, encode_json
from shared.kernel.config import ChorusConfig
from shared.kernel.peers import Liveness, accept, probe
from shared.kernel.schemas import (
    Array,
    GenOutput,
    GenRequest,
    GenResponse,
    LoadReport,
    RolloutControl,
    RolloutControlReply,
    SyncDone,
    WeightsAnnounce,
)
from shared.kernel.service import Service
from shared.models.loading import Tokenizer, load_model, load_tokenizer
from shared.models.weights import WeightsHeader, load_into
from shared.models.weightsync import TRANSPORTS, WeightSink, make_sink, resolve_transport

VERBS = ("pause", "load", "resume", "info", "migrate")
AWAY = "--"  # an instance serving another model than the one it started with is named <home model>--<home instance>


def migrated_name(cfg: ChorusConfig, model: str, instance: str, target: str) -> str:
    """The instance name a rollouter takes when it moves from ``model`` to ``target``: its home name back home,
    else ``<home model>--<home instance>`` (unique: one process per home name)."""
    home_model, sep, home_instance = instance.partition(AWAY)
    if not sep or home_model not in cfg.models:
        home_model, home_instance = model, instance
    return home_instance if target == home_model else f"{home_model}{AWAY}{home_instance}"
STOP_TIMEOUT_S = 20.0
# How often an instance checks, by itself, that it serves the version in KV and is registered (two KV reads): each
# sync's SyncDone wakes the check at once, so this is the backstop for one that was missed (a reconnect, a partition),
# spread by a random tenth so that a thousand instances do not read at the same instant.
CATCH_UP_S = 5.0
SYNC_OVER_AFTER = 3  # probe intervals a pause lasts before the watchdog asks whether its sync is over
JOIN_POLL_S = 0.2  # how often an instance out of routing tries to join


class BadRequest(ValueError):
    """A GenRequest that decodes but cannot be served."""


def request_prompts(req: GenRequest, engine: RolloutEngine) -> list[list[int]]:
    """Validate a request's adapter and prompts (non-empty 1-d integer arrays of known token ids) into lists."""
    try:
        engine.check_adapter(req.adapter)
    except UnknownAdapter as exc:
        raise BadRequest(str(exc)) from None
    vocab_size = engine.vocab_size
    if not req.prompts:
        raise BadRequest("request has no prompts")
    out: list[list[int]] = []
    for i, arr in enumerate(req.prompts):
        if arr.dtype not in ("int32", "int64") or len(arr.shape) != 1:
            raise BadRequest(f"prompts[{i}]: expected a 1-d int32/int64 array, got {arr.dtype} {arr.shape}")
        ids = arr.tolist()
        if not ids:
            raise BadRequest(f"prompts[{i}] is empty: a prompt needs at least one token (BOS)")
        if engine.context is not None and len(ids) > engine.context:
            raise BadRequest(f"prompts[{i}] has {len(ids)} tokens, more than the model's context of {engine.context}")
        if engine.context is not None and len(ids) == engine.context:
            raise BadRequest(f"prompts[{i}] has {len(ids)} tokens, the whole of the model's context: no room to generate")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def load_weights(engine: RolloutEngine, model: str, header: WeightsHeader, body: memoryview, *, version: int | None,
                 checksum: str | None) -> str:
    """Check a fetched version bucket by bucket and load it into the engine in place (engine thread).

    Everything is checked before the first tensor is written: a partial or corrupted transfer leaves the
    served weights as they were. Returns the checksum.
    """
    if header.model != model:
        raise ValueError(f"weights are for model {header.model!r}, this rollouter serves {model!r}")
    if version is not None and header.version != version:
        raise ValueError(f"weights hold v{header.version}, control asked for v{version}")
    if checksum is not None and header.checksum != checksum:
        raise ValueError(f"weights header checksum {header.checksum} != announced {checksum}")
    named = engine.named_tensors()
    # load_into accepts a subset; an update must carry every shipped tensor, or adapters would drift apart
    missing = sorted(set(named) - {s.name for s in header.slots})
    if missing:
        raise ValueError(f"weights for {model} v{header.version} lack {len(missing)} of the {len(named)} tensors this "
                         f"rollouter serves, e.g. {missing[:3]} (do both sides build models.{model} the same way?)")
    digest = load_into(named, header, body, verify=True)
    engine.loaded(header.version)
    return digest


class RollouterService(Service):
    """One rollouter instance of one model: a persistent engine behind a dynamic batcher."""

    name = "rollouter"
    per_model = True

    async def setup(self) -> None:
        import torch

        assert self.model is not None
        rc = self.cfg.models[self.model].rollouter
        self._keepalive_s = self.cfg.keepalive_s  # the fleet's, from the config: read at every look at the load
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{self.model}")
        loop = asyncio.get_running_loop()
        torch.set_num_threads(rc.threads)
        # Loading a real model takes seconds: on the engine's thread, never on the event loop.
        net, tok = await loop.run_in_executor(self._executor, _load, self.cfg, self.model)
        seed = int.from_bytes(hashlib.sha256(f"{self.cfg.run.seed}:{self.model}:{self.instance}".encode())
                              .digest()[:4], "little")
        fallbacks: list[str] = []
        # vLLM starts its engine (seconds, a warm-up generation): on the engine's thread as well
        model = self.model
        assert model is not None  # a rollouter serves one model
        self.engine: Engine = await loop.run_in_executor(
            self._executor, lambda: build_engine(self.cfg, model, net, tok, seed=seed, fallbacks=fallbacks))
        for why in fallbacks:
            self.counters["static_fallback"] += 1
            self.log.warning(why)
        self.batcher: Batcher | ContinuousBatcher
        if isinstance(self.engine, TorchEngine):
            if rc.on_sync == "interrupt":
                self.log.warning("on_sync interrupt needs a stepwise engine; syncs drain")
            self.batcher = Batcher(self.engine, self._executor, max_batch=rc.max_batch,
                                   window_s=rc.batch_window_ms / 1000.0, request_timeout_s=rc.request_timeout_s)
        else:
            self.batcher = ContinuousBatcher(self.engine, self._executor, max_batch=rc.max_batch,
                                             request_timeout_s=rc.request_timeout_s, on_sync=rc.on_sync)
        self.log.info("model loaded", adapters=list(self.engine.adapters), vocab_size=self.engine.vocab_size,
                      engine=type(self.engine).__name__, backend=rc.backend, on_sync=getattr(self.batcher, "on_sync", "drain"))
        plan = getattr(self.engine, "kernel_choices", None)
        if callable(plan) and (choices := plan()):  # Chorus's engine on a CPU: how it multiplies t rows, per shape
            self.log.info("kernel plan measured", choices=choices, own_kernel=native.why_unavailable() or "built")
        self.checksum: str | None = None
        self._replies: set[asyncio.Task[None]] = set()
        self._sinks: dict[str, WeightSink] = {}
        self._catch_up_failed = -1
        self._gen_subs: list[Subscription] = []
        self._transport = resolve_transport(self.cfg)  # until paramsync names the trainer's
        self._controller: str | None = None  # status subject of the paramsync that paused this instance
        self._served_seen = 0  # the highest served version a resume named: joining below it is refused
        self._routing_lock = asyncio.Lock()  # joins and resumes decide one at a time
        if self._transport == "ucx":
            self._sink("ucx")  # start UCX now (it loads libraries and a progress thread), not in the first sync
        await self._catch_up()
        self.spawn(self.batcher.run(), "batcher")
        self._pause_until = 0.0  # monotonic time the current pause's lease runs out (pause and load renew it)
        self._pause_lease = 0.0
        self._probed = 0.0  # when the paused instance last probed its controller
        self._paused_at = 0.0  # when the current pause began
        self._paused_by: int | None = None  # the version of the sync whose pause holds this instance
        self.spawn(self._pause_watchdog(), "pause-watchdog")
        self.spawn(self._load_loop(), "load-reports")

        for verb in VERBS:
            await self.nc.subscribe(self.names.rollout_control(self.model, self.instance, verb),
                                    cb=self._control_handler(verb))
        self._check_now = asyncio.Event()  # a sync of this model ended: is this instance behind?
        await self.nc.subscribe(self.names.sync_done(self.model), cb=self._on_sync_done)
        # Register once the control subjects answer (paramsync lists it from now on), then join routing.
        await self._register()
        if not await self._try_join():
            self.log.info("starting out of routing until it holds the served version and no sync is running",
                          have=self.engine.version)
        self.spawn(self._catch_up_loop(), "catch-up")

    async def teardown(self) -> None:
        assert self.model is not None
        await self._report_load(routing=False)  # the rollout manager stops sending before the subscriptions go
        try:
            await self.kv.delete(self.names.rollouter_key(self.model, self.instance))
        except Exception as exc:  # the bucket may be gone with the server; stopping anyway
            self.log.warning("could not deregister", error=str(exc))
        for sub in self._gen_subs:
            await sub.unsubscribe()
        self._gen_subs = []
        if not await self.batcher.flush(STOP_TIMEOUT_S):
            failed = self.batcher.fail_queued(RuntimeError("rollouter is stopping"))
            self.counters["failed_on_stop"] += failed
        if self._replies:
            await asyncio.wait(self._replies, timeout=5)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close), 10)
        except Exception as exc:  # stopping anyway
            self.log.warning("engine close failed", error=f"{type(exc).__name__}: {exc}")
        self._executor.shutdown(wait=False, cancel_futures=True)
        for sink in self._sinks.values():
            await sink.close()

    def extra_metrics(self) -> dict[str, Any]:
        if not hasattr(self, "batcher"):
            return {}
        return {"version": self.engine.version, "adapters": list(self.engine.adapters), "routing": self.routing,
                "load": self.batcher.occupancy(), "sync_s": getattr(self, "last_sync_s", None),
                **self.batcher.snapshot()}

    # --- load reports (the rollout manager's heartbeats) ------------------------------------
    async def _report_load(self, routing: bool | None = None, *, unless_unchanged: bool = False) -> None:
        """Publish the load report; ``unless_unchanged``: only if it differs from the last one or that one is
        the keepalive old (``balance.keepalive_s``, longer for a large fleet: the heartbeat of an instance whose load
        did not change)."""
        assert self.model is not None
        occ = self.batcher.occupancy()
        report = LoadReport(model=self.model, instance=self.instance, queued_rows=occ["queued_rows"],
                            running_rows=occ["running_rows"], tokens=occ["tokens"],
                            routing=self.routing if routing is None else routing, version=self.engine.version)
        now = time.monotonic()
        last, at = getattr(self, "_last_report", (None, 0.0))
        if unless_unchanged and report == last and now - at < self._keepalive_s:
            self.counters["load_reports_skipped"] += 1
            return
        self._last_report = (report, now)
        await self.publish_quietly(self.names.rollout_load(self.model), encode_json(report))

    async def _load_loop(self) -> None:
        while not self.stopping:
            await self._report_load(unless_unchanged=True)
            await asyncio.sleep(self.cfg.balance.report_interval_s)

    # --- routing -------------------------------------------------------------------------
    @property
    def routing(self) -> bool:
        return bool(getattr(self, "_gen_subs", None))

    async def _try_join(self) -> bool:
        """Join routing if this instance holds the served version and no sync is between listing the instances
        and committing (see the module docstring); True if it is in routing."""
        async with self._routing_lock:
            if self.routing or self.stopping or self.batcher.paused:  # paused: the sync's resume decides
                return self.routing
            if await self._sync_running():
                self.counters["join_waits_for_sync"] += 1
                return False
            served = max(await self._served(), self._served_seen)
            if self.engine.version < served:
                return False
            await self._join_routing()
            return True

    async def _sync_running(self) -> bool:
        """Whether a sync of this model is under way (phase "running" in KV, its paramsync answering probes). A
        paramsync that died mid-sync does not hold joins up: the next one aborts its sync. Unknown (the broker
        is away): running."""
        assert self.model is not None
        try:
            entry = await self.kv.get(self.names.sync_key(self.model))
            state = json.loads(entry.value or b"{}")
        except nats.js.errors.KeyNotFoundError:
            return False  # no sync ever ran
        except (nats.errors.Error, TimeoutError, ValueError):
            return True
        if not isinstance(state, dict) or state.get("phase") != "running":
            return False
        owner = self.names.status("paramsync", self.model, str(state.get("paramsync", "0")))
        return await probe(self.nc, owner, self.cfg.peers.probe_timeout_s) is not Liveness.DEAD

    async def on_disconnected(self) -> None:
        """Out of routing while cut off: nats-py would resubscribe the generation subjects on reconnecting, and the
        instance answer with the weights it held before, however far paramsync moved the model meanwhile. It joins
        again from its catch-up loop, once it holds the served version."""
        if self.routing and not self.stopping:
            self.counters["left_routing_disconnected"] += 1
            await self._leave_routing("its connection to NATS dropped")

    async def _join_routing(self) -> None:
        if self.routing or self.stopping:
            return
        assert self.model is not None
        self._gen_subs = [
            await self.nc.subscribe(self.names.gen(self.model), queue="rollouter", cb=self._on_gen),
            await self.nc.subscribe(self.names.gen_direct(self.model, self.instance), cb=self._on_gen),
        ]
        self.log.info("in routing", version=self.engine.version)
        await self._report_load()
        await self.event(events.ROUTING, instance=self.instance, model=self.model, routing=True,
                         version=self.engine.version)

    async def _leave_routing(self, reason: str) -> None:
        """Stop taking requests (NATS routes them to the other instances); queued ones fail, to be retried."""
        if not self.routing:
            return
        subs, self._gen_subs = self._gen_subs, []
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        failed = self.batcher.fail_queued(RuntimeError(f"instance {self.instance} left routing: {reason}"))
        self.counters["left_routing"] += 1
        await self._report_load()
        self.log.warning("out of routing", reason=reason, version=self.engine.version, failed_queued=failed)
        await self.event(events.ROUTING, instance=self.instance, model=self.model, routing=False,
                         version=self.engine.version, reason=reason)

    async def _register(self) -> None:
        assert self.model is not None
        await self.kv.put(self.names.rollouter_key(self.model, self.instance),
                          json.dumps({"instance": self.instance, "started_at": self.started_at}).encode())

    async def _check_registered(self) -> None:
        """Paramsync drops the registration of an instance it cannot reach; one that is alive puts it back."""
        assert self.model is not None
        try:
            await self.kv.get(self.names.rollouter_key(self.model, self.instance))
        except nats.js.errors.KeyNotFoundError:
            if not self.stopping:
                self.counters["re_registered"] += 1
                self.log.warning("registration was dropped (unreachable during a sync); registering again")
                # Unlisted, syncs pass it by: out of routing until registered and caught up (_try_join).
                await self._leave_routing("its registration was dropped")
                with contextlib.suppress(nats.errors.Error, TimeoutError):  # checked again within a second
                    await self._register()
        except (nats.errors.Error, TimeoutError):
            pass

    async def _served(self) -> int:
        assert self.model is not None
        try:
            return await kv_get_int(self.kv, self.names.version_key(self.model))
        except (nats.errors.Error, TimeoutError, ValueError):
            return self.engine.version  # cannot tell: trust what is loaded

    # --- generation ----------------------------------------------------------------------
    async def _on_gen(self, msg: Msg) -> None:
        # Never await generation here: callbacks of one subscription run one after another.
        await accept(self.nc, msg, self.status_subject)
        try:
            req = decode(GenRequest, msg.data)
            prompts = request_prompts(req, self.engine)
        except (DecodeError, BadRequest) as exc:
            reason = exc.reason if isinstance(exc, DecodeError) else str(exc)
            await self._reject(msg, reason, request_id=_request_id(msg.data))
            return
        self.counters["requests"] += 1
        if req.deadline is not None and time.time() > req.deadline:
            self.counters["expired_on_arrival"] += 1  # the requester gave up on it (this instance was frozen?)
            if msg.reply:
                await msg.respond(encode(GenResponse(request_id=req.request_id, instance=self.instance,
                                                     version=self.engine.version,
                                                     error="expired: arrived after its deadline")))
            return
        params = SamplingParams(max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                                top_p=req.top_p, stop_ids=tuple(req.stop_ids), stop=tuple(req.stop))
        fut = self.batcher.submit(prompts, params, req.adapter)
        task = asyncio.create_task(self._answer(msg, req.request_id, fut))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _answer(self, msg: Msg, request_id: str, fut: asyncio.Future[Any]) -> None:
        try:
            version, results = await fut
        except Exception as exc:  # expired in the queue, failed generation, stopping
            self.counters["gen_errors"] += 1
            self.log.warning("generation failed", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
            resp = GenResponse(request_id=request_id, instance=self.instance, version=self.engine.version,
                               error=f"{type(exc).__name__}: {exc}")
        else:
            outputs = [GenOutput(ids=Array.of(r.ids, "int32"), logprobs=Array.of(r.logprobs, "float32"),
                                 finish=r.finish,
                                 versions=(Array.of(r.versions, "int32") if len(set(r.versions)) > 1 else None))
                       for r in results]
            resp = GenResponse(request_id=request_id, outputs=outputs, version=version, instance=self.instance)
        if msg.reply:
            await msg.respond(encode(resp))

    async def _reject(self, msg: Msg, reason: str, *, request_id: str = "") -> None:
        await self.to_dlq(msg.subject, msg.data, reason)
        if msg.reply:
            resp = GenResponse(request_id=request_id, instance=self.instance, version=self.engine.version,
                               error=f"rejected: {reason}")
            await msg.respond(encode(resp))

    # --- control -------------------------------------------------------------------------
    def _control_handler(self, verb: str) -> Callable[[Msg], Awaitable[None]]:
        async def handler(msg: Msg) -> None:
            await self._on_control(msg, verb)

        return handler

    async def _on_control(self, msg: Msg, verb: str) -> None:
        try:
            ctl = decode(RolloutControl, msg.data)
            if ctl.verb != verb:
                raise DecodeError(f"control body says {ctl.verb!r} but was sent to the {verb!r} subject")
        except DecodeError as exc:
            await self.to_dlq(msg.subject, msg.data, exc.reason)
            await self._control_reply(msg, ok=False, error=f"rejected: {exc.reason}")
            return
        self.counters[f"control_{verb}"] += 1
        if verb in ("pause", "load"):
            self._pause_lease = min(ctl.lease_s or ctl.timeout_s, self.cfg.paramsync.max_pause_s)
            self._pause_until = time.monotonic() + self._pause_lease
        if ctl.peer:
            self._controller = ctl.peer
        if verb == "pause":
            self._paused_by = ctl.version if ctl.peer else None
            if not self.batcher.paused:  # the watchdog's first probe one interval on: a short pause costs none
                self._probed = self._paused_at = time.monotonic()
            self.batcher.pause()
            drained = await self.batcher.drain(ctl.timeout_s)
            await self._control_reply(msg, ok=drained, error=None if drained else
                                      f"{self.batcher.in_flight} requests still in flight after {ctl.timeout_s}s")
        elif verb == "resume":
            # ctl.version is the served version: an instance that could not load it stays out of routing
            async with self._routing_lock:
                self._served_seen = max(self._served_seen, ctl.version)
                if self.engine.version >= ctl.version:
                    await self._join_routing()
                else:
                    await self._leave_routing(f"holds v{self.engine.version}, v{ctl.version} is served")
                self.batcher.resume()
            await self._control_reply(msg, ok=True)
        elif verb == "load":
            await self._on_load(msg, ctl)
        elif verb == "migrate":
            await self._on_migrate(msg, ctl)
        else:
            await self._control_reply(msg, ok=True)

    async def _on_migrate(self, msg: Msg, ctl: RolloutControl) -> None:
        """FlexMARL's inter-agent balancing, on the instance's side: leave this model (drain what is queued and
        running, deregister), then the process serves ``ctl.target`` at its served version (serve_until_started
        builds the new instance, whose start loads those weights through the transport and registers)."""
        assert self.model is not None
        target = ctl.target
        if target is None or target not in self.cfg.models or target == self.model:
            self.counters["migrate_refused"] += 1
            await self._control_reply(msg, ok=False, error=f"cannot migrate to {target!r}: expected one of the other "
                                      f"configured models {sorted(set(self.cfg.models) - {self.model})}")
            return
        if self.stopping:
            await self._control_reply(msg, ok=False, error="stopping")
            return
        self.migrate_to = (target, migrated_name(self.cfg, self.model, self.instance, target))
        self.log.info("migrating to another model", target=target, instance=self.migrate_to[1])
        await self._control_reply(msg, ok=True)
        self.stop()

    async def _pause_watchdog(self) -> None:
        """Resume by itself when paused by a paramsync that is gone (its status subject has no responders, or
        ``peers.misses`` probes in a row went unanswered), or once the lease the last pause or load named ran out
        (at most ``paramsync.max_pause_s``). A paramsync that dies between pause and resume, or a pause sent by
        anyone else, must not leave this instance paused for longer than it said."""
        peers = self.cfg.peers
        misses = over = 0
        while True:
            # a short lease is honoured to within a fifth of a second, a controller probed every probe interval
            await asyncio.sleep(min(peers.probe_interval_s, 0.2))
            if not self.batcher.paused:
                misses = over = 0
                continue
            why = None
            if time.monotonic() > self._pause_until:
                why = f"its pause's lease of {self._pause_lease:g}s ran out with no resume"
            elif self._controller and time.monotonic() - self._probed >= peers.probe_interval_s:
                self._probed = time.monotonic()
                state = await probe(self.nc, self._controller, peers.probe_timeout_s)
                misses = 0 if state is Liveness.ALIVE else misses + 1
                if state is Liveness.DEAD or misses >= peers.misses:
                    why = f"the paramsync that paused it is {state.value}"
                elif (state is Liveness.ALIVE and self._paused_by is not None
                      and time.monotonic() - self._paused_at >= SYNC_OVER_AFTER * peers.probe_interval_s):
                    # Two readings in a row, a probe interval apart: a KV read may lag the sync by a moment. Not in
                    # a pause's first intervals: every paused instance reading the sync's listing (which names every
                    # instance) each second is work that grows with the square of the instances.
                    over = over + 1 if await self._pausing_sync_over(self._paused_by) else 0
                    if over >= 2:
                        why = f"the sync of v{self._paused_by} that paused it is over and sent it no resume"
            if why is not None and self.batcher.paused:
                self.batcher.resume()
                misses = over = 0
                self._paused_by = None
                self.counters["auto_resumes"] += 1
                self.log.warning("paused without a controller; resumed by itself", reason=why)

    async def _pausing_sync_over(self, version: int) -> bool:
        """Whether the sync of ``version`` no longer holds this instance: the phase in KV is not that sync running,
        or that sync's listing does not name this instance (its paramsync found it unreachable and dropped it). A
        paramsync resumes every instance it still counts before it writes "done", so a paused instance that reads
        "done" was given up on. Unknown (the broker is away): not over, the lease still bounds the pause."""
        assert self.model is not None
        try:
            entry = await self.kv.get(self.names.sync_key(self.model))
            state = json.loads(entry.value or b"{}")
        except nats.js.errors.KeyNotFoundError:
            return True
        except (nats.errors.Error, TimeoutError, ValueError):
            return False
        if not isinstance(state, dict):
            return True
        listed = state.get("instances") or []
        return (state.get("phase") != "running" or state.get("version") != version
                or (bool(listed) and self.instance not in listed))

    async def _on_load(self, msg: Msg, ctl: RolloutControl) -> None:
        t0 = time.perf_counter()
        self._transport = ctl.transport
        try:
            try:
                digest = await self._load_version(ctl.version, transport=ctl.transport, object_name=ctl.object_name,
                                                  checksum=ctl.checksum, timeout_s=ctl.timeout_s)
            except Exception as exc:
                if ctl.transport == "nats" or not ctl.object_name:
                    raise
                # The trainer died or no longer holds it: every committed version is in the object store too.
                self.counters["load_fallbacks"] += 1
                self.log.warning("load over ucx failed; loading from the object store", version=ctl.version,
                                 error=f"{type(exc).__name__}: {exc}")
                left = max(1.0, ctl.timeout_s - (time.perf_counter() - t0))
                digest = await self._load_version(ctl.version, transport="nats", object_name=ctl.object_name,
                                                  checksum=ctl.checksum, timeout_s=left)
        except Exception as exc:  # missing object, trainer gone, timeout, checksum or shape mismatch
            self.counters["load_failures"] += 1
            self.log.warning("load failed", version=ctl.version, transport=ctl.transport,
                             error=f"{type(exc).__name__}: {exc}")
            await self._control_reply(msg, ok=False, error=f"{type(exc).__name__}: {exc}")
            return
        self.last_sync_s = round(time.perf_counter() - t0, 3)
        self.log.info("weights loaded", version=self.engine.version, transport=ctl.transport,
                      seconds=self.last_sync_s)
        await self._control_reply(msg, ok=True, checksum=digest)

    def _sink(self, transport: str) -> WeightSink:
        assert self.model is not None
        sink = self._sinks.get(transport)
        if sink is None:
            sink = self._sinks[transport] = make_sink(transport, self.names, self.model, self.instance,
                                                      self.nc, self.js, self.peers)
        return sink

    async def _load_version(self, version: int, *, transport: str, object_name: str | None, checksum: str | None,
                            timeout_s: float, forward_only: bool = False) -> str:
        """Fetch ``version`` into the staging buffer, then check and load it between two batches. With
        ``forward_only`` (a catch-up) a version at or below the loaded one is left alone: a sync may have loaded
        a newer one meanwhile."""
        assert self.model is not None
        sink = self._sink(transport)
        header, body = await sink.fetch(version, object_name=object_name, timeout_s=timeout_s)
        model = self.model

        def load() -> str:
            if forward_only and self.engine.version >= header.version and self.checksum is not None:
                return self.checksum
            return load_weights(self.engine, model, header, body, version=version, checksum=checksum)

        try:
            digest = await self.batcher.load(load)
        except Exception:
            sink.discard_staging()
            raise
        self.checksum = digest
        self.counters["loads"] += 1
        self.counters[f"loads_{transport}"] += 1
        return digest

    async def _control_reply(self, msg: Msg, *, ok: bool, checksum: str | None = None,
                             error: str | None = None) -> None:
        if msg.reply:
            reply = RolloutControlReply(ok=ok, instance=self.instance, version=self.engine.version,
                                        checksum=checksum if checksum is not None else self.checksum,
                                        in_flight=self.batcher.in_flight, routing=self.routing,
                                        paused=self.batcher.paused, error=error)
            await msg.respond(encode(reply))

    async def _on_sync_done(self, msg: Msg) -> None:
        """A sync of this model ended: the catch-up check runs now, not at its next period (a sync that failed on
        this instance, or did not list it, leaves it behind). One that holds that version already reads nothing."""
        try:
            done = self.decode_own(SyncDone, msg.data)
        except DecodeError as exc:
            await self.to_dlq(msg.subject, msg.data, exc.reason)
            return
        if done.version > self.engine.version:
            self._check_now.set()

    async def _catch_up_loop(self) -> None:
        """Load the served version if it is ahead of ours: a sync that failed on this instance (or missed it: its
        registration was dropped) would otherwise leave it behind. It leaves routing first, so no request meets
        the old weights, and joins again once loaded."""
        while not self.stopping:
            period = CATCH_UP_S * random.uniform(0.9, 1.1) if self.routing else JOIN_POLL_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_now.wait(), period)
            self._check_now.clear()
            if self.batcher.paused:
                continue  # paramsync is at work
            await self._check_registered()
            served = await self._served()
            if served > self.engine.version and not self.batcher.paused:
                await self._leave_routing(f"holds v{self.engine.version}, v{served} is served")
                self.counters["catch_ups"] += 1
                self.log.warning("served version is ahead of this instance; loading it", served=served,
                                 have=self.engine.version)
                await self._catch_up()
            if not self.batcher.paused:
                await self._try_join()

    async def _committed(self) -> WeightsAnnounce | None:
        """The trainer's newest commit (KV ``weights.<model>``), or None."""
        assert self.model is not None
        try:
            entry = await self.kv.get(self.names.weights_key(self.model))
            return decode(WeightsAnnounce, entry.value or b"")
        except (nats.errors.Error, TimeoutError, DecodeError):  # none yet, or the broker is away
            return None

    async def _catch_up(self) -> None:
        """Load the served version if paramsync already moved the model past ours (best effort): the trainer's
        newest commit (the served version or a later one, named in KV), through the transport of the last sync,
        then the other one; without a commit in KV, the served version by its plain name."""
        version = await self._served()
        if version <= self.engine.version:
            return
        ann = await self._committed()
        object_name, checksum = None, None
        if ann is not None and ann.version >= version:
            version, object_name, checksum = ann.version, ann.object_name, ann.checksum
        order = [self._transport] + [t for t in TRANSPORTS if t != self._transport]
        errors = []
        for transport in order:
            try:
                await self._load_version(version, transport=transport, object_name=object_name, checksum=checksum,
                                         timeout_s=self.cfg.paramsync.load_timeout_s, forward_only=True)
                self.log.info("caught up with served weights", version=self.engine.version, transport=transport)
                return
            except Exception as exc:  # trainer gone, object missing, ucxx absent: try the other transport
                errors.append(f"{transport}: {type(exc).__name__}: {exc}")
        self.counters["catch_up_failures"] += 1
        if self._catch_up_failed != version:  # once per version: the loop tries again every second
            self._catch_up_failed = version
            self.log.warning("could not load the served weights; trying again", version=version,
                             have=self.engine.version, errors=errors)


def _load(cfg: ChorusConfig, model: str) -> tuple[Any, Tokenizer]:
    """The network and tokenizer of ``model`` (worker thread)."""
    return load_model(cfg, model), load_tokenizer(cfg, model)


def _request_id(data: bytes) -> str:
    """Best-effort request id of a message that failed validation, for the error reply."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # not msgpack at all
        return ""
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else ""
