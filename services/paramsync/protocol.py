"""Paramsync protocol logic without a broker: announce coalescing, instance discovery, sync outcome."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.kernel.schemas import WeightsAnnounce


class AnnounceQueue:
    """Holds at most one pending announce: the newest. Versions 3, 4, 5 queued -> only 5 is synced."""

    def __init__(self) -> None:
        self.pending: WeightsAnnounce | None = None
        self.last_synced: int = -1
        self.coalesced = 0  # announces superseded before they were synced
        self.ignored = 0  # announces older than what is already synced

    def offer(self, ann: WeightsAnnounce) -> bool:
        """Queue ``ann`` unless something newer is pending or already synced; True if it is now pending."""
        if ann.version < self.last_synced:
            self.ignored += 1
            return False
        if self.pending is not None:
            if ann.version < self.pending.version:
                self.coalesced += 1
                return False
            self.coalesced += 1  # the pending one is superseded (same version: the re-announce wins)
        self.pending = ann
        return True

    def take(self) -> WeightsAnnounce | None:
        """The announce to sync now (None when nothing is pending)."""
        ann, self.pending = self.pending, None
        return ann

    def done(self, version: int) -> None:
        self.last_synced = max(self.last_synced, version)


def instances_from_keys(keys: Iterable[str], prefix: str) -> list[str]:
    """Instance ids of the rollouter registration keys under ``prefix`` (sorted, unique)."""
    return sorted({k[len(prefix):] for k in keys if k.startswith(prefix) and len(k) > len(prefix)})


@dataclass(frozen=True)
class InstanceResult:
    """How one instance went through pause + load."""

    instance: str
    loaded: bool
    reachable: bool = True  # False: nobody answers its control subjects (a stale registration)
    error: str | None = None


@dataclass(frozen=True)
class SyncOutcome:
    loaded: list[str]
    failed: dict[str, str]
    commit: bool  # set the served version in KV


def decide(results: Iterable[InstanceResult]) -> SyncOutcome:
    """Whether the served version moves to the announced one, once every instance has been tried.

    It moves when at least one live instance loaded the weights: the ones that failed every attempt are
    kept out of routing (they are resumed with the new served version, which they do not hold) and reported,
    so no request is answered with the old weights under the new version. It also moves with no live
    instance at all (an unreachable instance's registration outlived it), so a rollouter starting later loads
    it. It stays when every live instance failed: they keep serving the old version.
    """
    loaded: list[str] = []
    failed: dict[str, str] = {}
    live_failure = False
    for r in results:
        if r.loaded:
            loaded.append(r.instance)
            continue
        failed[r.instance] = r.error or "failed"
        live_failure = live_failure or r.reachable
    return SyncOutcome(sorted(loaded), failed, commit=bool(loaded) or not live_failure)
