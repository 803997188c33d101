"""Paramsync service: announce -> pause rollouters -> load -> ack -> set served version -> resume -> done.

Crash-only: the version to sync comes from the trainer's commit point (KV ``weights.<model>``, read every
``SYNC_POLL_S``; an announce only wakes the loop up early), so an announce lost while paramsync was down delays
nothing. The phase of a sync is kept in KV ``sync.<model>``: a restarted paramsync that finds a sync half done
aborts it (resumes every instance with the served version) and syncs again. Requests to a rollouter fail as soon
as probes find it dead, not after their timeout; a paused rollouter resumes by itself once this paramsync is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyNotFoundError

from services.paramsync.protocol import AnnounceQueue, InstanceResult, decide, instances_from_keys
from shared.kernel.bus import kv_get_int, kv_keys, kv_put_int_max
from shared.kernel.codec import DecodeError, decode, encode
from shared.kernel.config import ParamSyncConfig
from shared.kernel.peers import PeerGone, request_watched
from shared.kernel.schemas import RolloutControl, RolloutControlReply, SyncDone, WeightsAnnounce
from shared.kernel.service import Service

LIST_ATTEMPTS = 3
RESUME_TIMEOUT_S = 5.0
SYNC_POLL_S = 1.0  # how often the commit point is read, besides announces
RETRY_S = (1.0, 30.0)  # first and largest wait before a version no live instance could load is tried again
# Extra time the request waits beyond the timeout the rollouter itself is given.
REPLY_MARGIN_S = 2.0
KV_MARGIN_S = 10.0  # committing the served version in KV, between the last load and the resumes


def pause_lease_s(cfg: ParamSyncConfig) -> float:
    """The lease a pause asks for: its drain, then its load follows at once."""
    return cfg.pause_timeout_s + REPLY_MARGIN_S


def load_lease_s(cfg: ParamSyncConfig) -> float:
    """The lease a load asks for: the rest of the sync at its slowest (the other instances' pauses and every load
    attempt, the commit, the resume), so a live paramsync's resume always comes first."""
    return (cfg.pause_timeout_s + cfg.load_attempts * (cfg.load_timeout_s + REPLY_MARGIN_S) + KV_MARGIN_S
            + RESUME_TIMEOUT_S + 2 * REPLY_MARGIN_S)


class ControlFailed(RuntimeError):
    def __init__(self, reason: str, *, reachable: bool = True) -> None:
        super().__init__(reason)
        self.reachable = reachable


class ParamSyncService(Service):
    """Keeps one model's rollouters on the trainer's newest weights, one sync at a time."""

    name = "paramsync"
    per_model = True

    async def setup(self) -> None:
        assert self.model is not None
        self.queue = AnnounceQueue()
        self._wake = asyncio.Event()
        self.syncing: int | None = None
        self._retry: tuple[int, float, float] | None = None  # (version, not before, next wait) after a failed sync
        await self._abort_half_done()
        self.queue.last_synced = await kv_get_int(self.kv, self.names.version_key(self.model), -1)
        await self.nc.subscribe(self.names.sync_announce(self.model), cb=self._on_announce)
        self.spawn(self._sync_loop(), "sync")
        self.spawn(self._poll_loop(), "poll")

    def extra_metrics(self) -> dict[str, Any]:
        if not hasattr(self, "queue"):
            return {}
        return {"synced_version": self.queue.last_synced, "syncing": self.syncing,
                "pending": self.queue.pending.version if self.queue.pending else None}

    async def _on_announce(self, msg: Msg) -> None:
        try:
            ann = self.decode_own(WeightsAnnounce, msg.data)
        except DecodeError as exc:
            await self.to_dlq(msg.subject, msg.data, exc.reason)
            return
        self.counters["announces"] += 1
        before = self.queue.coalesced
        if self.queue.offer(ann):
            self._wake.set()
        else:
            self.counters["ignored_announces"] = self.queue.ignored
        self.counters["coalesced"] += self.queue.coalesced - before

    async def _sync_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            ann = self.queue.take()
            if ann is None:
                continue
            self.syncing = ann.version
            try:
                done = await self.sync(ann)
                self._after(done)
            except Exception as exc:  # the broker hiccuped; the commit point is read again within a second
                self.counters["sync_errors"] += 1
                self.log.error("sync failed", version=ann.version, error=f"{type(exc).__name__}: {exc}")
            finally:
                self.syncing = None

    def _after(self, done: SyncDone) -> None:
        """Back off before trying again a version that no live instance loaded."""
        if done.version <= self.queue.last_synced:
            self._retry = None
            return
        wait = RETRY_S[0] if self._retry is None or self._retry[0] != done.version else self._retry[2]
        self._retry = (done.version, time.monotonic() + wait, min(RETRY_S[1], 2 * wait))

    async def _poll_loop(self) -> None:
        """Offer the trainer's newest commit every ``SYNC_POLL_S``: the announce of it may have been lost."""
        assert self.model is not None
        while True:
            await asyncio.sleep(SYNC_POLL_S)
            try:
                entry = await self.kv.get(self.names.weights_key(self.model))
                ann = decode(WeightsAnnounce, entry.value or b"")
            except KeyNotFoundError:
                continue  # no trainer has committed yet
            except DecodeError as exc:
                self.counters["bad_commit_points"] += 1
                self.log.warning("the commit point does not hold an announce", error=exc.reason)
                continue
            except (nats.errors.Error, TimeoutError) as exc:
                self.counters["kv_errors"] += 1
                self.log.warning("reading the commit point failed", error=f"{type(exc).__name__}: {exc}")
                continue
            if ann.version <= self.queue.last_synced or ann.version == self.syncing:
                continue
            if self._retry is not None and self._retry[0] == ann.version and time.monotonic() < self._retry[1]:
                continue
            if self.queue.offer(ann):
                self.counters["polled_commits"] += 1
                self._wake.set()

    # --- the state of a sync in KV --------------------------------------------------------
    async def _set_state(self, phase: str, version: int, instances: list[str] | None = None, *,
                         required: bool = False) -> None:
        assert self.model is not None
        state = {"phase": phase, "version": version, "instances": instances or [], "paramsync": self.instance,
                 "time": time.time()}
        try:
            await self.kv.put(self.names.sync_key(self.model), json.dumps(state).encode())
        except (nats.errors.Error, TimeoutError) as exc:  # only a restart mid-sync would miss it
            if required:
                raise
            self.counters["kv_errors"] += 1
            self.log.warning("could not record the sync phase", phase=phase, error=f"{type(exc).__name__}: {exc}")

    async def _abort_half_done(self) -> None:
        """A paramsync that died mid-sync left its phase at running: resume every registered instance with the
        served version (one that loaded the new weights serves them once it is synced again), then sync anew."""
        assert self.model is not None
        try:
            entry = await self.kv.get(self.names.sync_key(self.model))
            state = json.loads(entry.value or b"{}")
        except (KeyNotFoundError, ValueError):
            return
        if not isinstance(state, dict) or state.get("phase") != "running":
            return
        served = await kv_get_int(self.kv, self.names.version_key(self.model))
        listed: list[str] = []
        with contextlib.suppress(nats.errors.Error, TimeoutError):  # the instances the sync named will do
            listed = await self._live_instances()
        instances = sorted(set(listed) | set(state.get("instances") or []))
        self.counters["aborted_syncs"] += 1
        self.log.warning("aborting a sync a previous paramsync left half done", version=state.get("version"),
                         served=served, instances=instances)
        await asyncio.gather(*(self._resume(i, served) for i in instances))
        await self._set_state("aborted", int(state.get("version") or 0))

    async def sync(self, ann: WeightsAnnounce) -> SyncDone:
        """Run the whole protocol for one announce; failures are reported in SyncDone, never raised."""
        t0 = time.perf_counter()
        instances = await self.begin(ann)
        results = await self.pause_and_load_all(instances, ann)
        return await self.finish(ann, results, t0)

    async def begin(self, ann: WeightsAnnounce) -> list[str]:
        """The first step of a sync: its phase "running" in KV, then the instances it covers.

        The phase is written before the listing, and a rollouter registers before it reads the phase (it joins
        routing only while no sync runs): so an instance is either listed, paused and loaded by this sync, or
        it sees the sync running and joins after its commit, with the version it commits. A sync whose phase
        cannot be written does not start (the commit point is read again within a second)."""
        await self._set_state("running", ann.version, required=True)
        instances = await self._live_instances()
        await self._set_state("running", ann.version, instances)
        return instances

    async def pause_and_load_all(self, instances: list[str], ann: WeightsAnnounce) -> list[InstanceResult]:
        return list(await asyncio.gather(*(self._pause_and_load(i, ann) for i in instances)))

    async def finish(self, ann: WeightsAnnounce, results: list[InstanceResult], t0: float) -> SyncDone:
        """The last step: commit the served version (or not), resume the instances, phase "done", SyncDone."""
        assert self.model is not None
        outcome = decide(results)
        served = ann.version
        try:
            if outcome.commit:
                served = await kv_put_int_max(self.kv, self.names.version_key(self.model), ann.version)
                self.queue.done(ann.version)
            else:
                served = await kv_get_int(self.kv, self.names.version_key(self.model))
        finally:
            # Resume everyone reachable with the served version: an instance that loaded it (or, with no
            # commit, still holds the old one) serves; one that failed to load it stays out of routing and
            # loads it by itself.
            await asyncio.gather(*(self._resume(r.instance, served) for r in results if r.reachable))
        await self._set_state("done", ann.version)
        for r in results:
            if not r.reachable:  # its process is gone (or cut off): drop the registration it left behind
                await self._deregister(r.instance)
        done = SyncDone(model=self.model, version=ann.version, loaded=outcome.loaded, failed=outcome.failed,
                        object_name=ann.object_name,
                        seconds=round(time.perf_counter() - t0, 4))
        await self.nc.publish(self.names.sync_done(self.model), encode(done))
        self.counters["syncs"] += 1
        self.counters["failed_instances"] += len(outcome.failed)
        if not outcome.commit:
            self.counters["uncommitted_syncs"] += 1
        self.log.info("sync done", version=ann.version, loaded=outcome.loaded, failed=outcome.failed,
                      committed=outcome.commit, seconds=done.seconds)
        return done

    async def _deregister(self, instance: str) -> None:
        """A live instance that was only cut off registers itself again (its catch-up loop checks)."""
        assert self.model is not None
        try:
            await self.kv.delete(self.names.rollouter_key(self.model, instance))
        except Exception as exc:  # broker hiccup: the next sync finds it unreachable again
            self.log.warning("could not deregister an unreachable instance", instance=instance, error=str(exc))
            return
        self.counters["deregistered"] += 1
        self.log.warning("unreachable instance deregistered", instance=instance)

    async def _live_instances(self) -> list[str]:
        """Registered rollouter instances; an empty listing is read again before it is believed (a rollouter may
        be registering), since committing to nobody skips every rollouter."""
        for attempt in range(LIST_ATTEMPTS):
            found = await self._list_instances()
            if found:
                return found
            if attempt + 1 < LIST_ATTEMPTS:
                self.counters["empty_listings"] += 1
                await asyncio.sleep(0.1 * (attempt + 1))
        return []

    async def _list_instances(self) -> list[str]:
        """Registration keys, read without a KV watch (each watch would leave a consumer behind for minutes).
        A broker error is raised: a sync that cannot list its instances fails and is tried again, it does not
        commit to nobody."""
        assert self.model is not None
        prefix = self.names.rollouter_prefix(self.model)
        return instances_from_keys(await kv_keys(self.js, self.names.kv_bucket, prefix), prefix)

    async def _pause_and_load(self, instance: str, ann: WeightsAnnounce) -> InstanceResult:
        """Pause, then load with up to ``load_attempts`` tries; an unreachable instance is not retried."""
        sync_cfg = self.cfg.paramsync
        try:
            await self._control(instance, RolloutControl(verb="pause", version=ann.version,
                                                         timeout_s=sync_cfg.pause_timeout_s,
                                                         lease_s=pause_lease_s(sync_cfg)))
        except ControlFailed as exc:
            return InstanceResult(instance, loaded=False, reachable=exc.reachable, error=str(exc))
        result = InstanceResult(instance, loaded=False)
        for attempt in range(1, sync_cfg.load_attempts + 1):
            result = await self._load(instance, ann)
            if result.loaded or not result.reachable:
                return result
            self.counters["load_retries" if attempt < sync_cfg.load_attempts else "load_gave_up"] += 1
            self.log.warning("load failed", instance=instance, version=ann.version, attempt=attempt,
                             error=result.error)
        return result

    async def _load(self, instance: str, ann: WeightsAnnounce) -> InstanceResult:
        try:
            reply = await self._control(instance, RolloutControl(
                verb="load", version=ann.version, transport=ann.transport, object_name=ann.object_name,
                checksum=ann.checksum, timeout_s=self.cfg.paramsync.load_timeout_s,
                lease_s=load_lease_s(self.cfg.paramsync)))
        except ControlFailed as exc:
            return InstanceResult(instance, loaded=False, reachable=exc.reachable, error=str(exc))
        if reply.checksum != ann.checksum or reply.version != ann.version:
            return InstanceResult(instance, loaded=False, error=(
                f"acked v{reply.version} checksum {reply.checksum}, expected v{ann.version} {ann.checksum}"))
        return InstanceResult(instance, loaded=True)

    async def _resume(self, instance: str, served: int) -> None:
        try:
            await self._control(instance, RolloutControl(verb="resume", version=served, timeout_s=RESUME_TIMEOUT_S))
        except ControlFailed as exc:
            self.counters["resume_failures"] += 1
            self.log.warning("resume failed", instance=instance, error=str(exc))

    async def _control(self, instance: str, ctl: RolloutControl) -> RolloutControlReply:
        """One control request/reply; any failure becomes :class:`ControlFailed` with a reason. The instance is
        probed meanwhile: one that dies or freezes fails the request in seconds, not after its timeout."""
        assert self.model is not None
        subject = self.names.rollout_control(self.model, instance, ctl.verb)
        ctl = ctl.model_copy(update={"peer": self.status_subject})
        peer = self.names.status("rollouter", self.model, instance)
        try:
            msg = await request_watched(self.nc, subject, encode(ctl), ctl.timeout_s + REPLY_MARGIN_S, self.peers,
                                        peer)
        except NoRespondersError as exc:
            raise ControlFailed(f"{ctl.verb}: no responders (instance not running)", reachable=False) from exc
        except PeerGone as exc:
            raise ControlFailed(f"{ctl.verb}: {exc}", reachable=False) from exc
        except (NatsTimeoutError, TimeoutError) as exc:
            raise ControlFailed(f"{ctl.verb}: no reply within {ctl.timeout_s + REPLY_MARGIN_S}s") from exc
        except nats.errors.Error as exc:  # reconnecting: the next sync tries again
            raise ControlFailed(f"{ctl.verb}: {type(exc).__name__}: {exc}") from exc
        try:
            reply = decode(RolloutControlReply, msg.data)
        except DecodeError as exc:
            raise ControlFailed(f"{ctl.verb}: bad reply: {exc.reason}") from exc
        if not reply.ok:
            raise ControlFailed(f"{ctl.verb}: {reply.error or 'refused'}")
        return reply
