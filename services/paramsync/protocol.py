"""Paramsync protocol logic without a broker: announce coalescing, instance discovery, sync outcome."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.schemas import WeightsAnnounce


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
    """The served version moves only when every live instance loaded the announced weights.

    An unreachable instance is not live (its registration outlived it): it is reported, not waited for.
    With no live instance at all the version still moves, so a rollouter starting later loads it.
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
    return SyncOutcome(sorted(loaded), failed, commit=not live_failure)
