"""Paramsync's protocol decisions, without a broker."""

from __future__ import annotations

from services.paramsync.protocol import AnnounceQueue, InstanceResult, decide, instances_from_keys
from shared.schemas import WeightsAnnounce


def ann(v: int) -> WeightsAnnounce:
    return WeightsAnnounce(model="m", version=v, object_name=f"weights/m/v{v}", checksum=f"c{v}", nbytes=1)


def test_queued_announces_coalesce_to_the_newest() -> None:
    q = AnnounceQueue()
    for v in (3, 4, 5):
        q.offer(ann(v))
    taken = q.take()
    assert taken is not None and taken.version == 5
    assert q.coalesced == 2 and q.take() is None


def test_an_older_announce_never_replaces_a_newer_pending_one() -> None:
    q = AnnounceQueue()
    q.offer(ann(5))
    assert not q.offer(ann(4))
    taken = q.take()
    assert taken is not None and taken.version == 5


def test_announces_older_than_the_synced_version_are_ignored() -> None:
    q = AnnounceQueue()
    q.done(6)
    assert not q.offer(ann(5)) and q.ignored == 1
    assert q.offer(ann(6))  # a re-announce of the served version is synced again (new instances)


def test_instances_are_parsed_from_registration_keys() -> None:
    keys = ["rollouter.m.0", "rollouter.m.1", "rollouter.mm.9", "version.m", "rollouter.m."]
    assert instances_from_keys(keys, "rollouter.m.") == ["0", "1"]


def test_version_commits_only_when_every_live_instance_loaded() -> None:
    ok = decide([InstanceResult("0", loaded=True), InstanceResult("1", loaded=True)])
    assert ok.commit and ok.loaded == ["0", "1"] and not ok.failed
    bad = decide([InstanceResult("0", loaded=True), InstanceResult("1", loaded=False, error="checksum")])
    assert not bad.commit and bad.failed == {"1": "checksum"}


def test_unreachable_instances_are_reported_but_do_not_block_the_version() -> None:
    out = decide([InstanceResult("0", loaded=True),
                  InstanceResult("1", loaded=False, reachable=False, error="no responders")])
    assert out.commit and out.loaded == ["0"] and out.failed == {"1": "no responders"}
    assert decide([]).commit
