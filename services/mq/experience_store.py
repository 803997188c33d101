"""The experience store of one model: per-agent sample tables, group completion, staleness, micro-batches.

Pure logic, no NATS. Each row carries an opaque ``handle`` (the service's ack handle) that is given back
exactly once: in a committed micro-batch, in a drop, or as a replaced duplicate.
The tables follow FlexMARL's experience store (Fig. 3): meta columns ``policy_version``, ``sample_id``,
``is_processing`` per agent; the sample itself is the data.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from shared.schemas import Sample

H = TypeVar("H")

# Reasons a sample leaves the store without being trained.
STALE = "stale"  # trained_version - sample.version > max_staleness
GROUP_DROPPED = "group_dropped"  # a member of its group was stale; a partial group is useless to GRPO
LATE = "late"  # its group was already dispatched in a micro-batch


class AddKind(StrEnum):
    """What :meth:`ExperienceStore.add` did with a sample."""

    NEW = "new"  # stored
    DUPLICATE = "duplicate"  # id already held: handle replaced, ``settle`` is the previous handle
    SEEN = "seen"  # id already dispatched or dropped: ``settle`` is the new handle (nothing to keep)
    DROPPED = "dropped"  # stale on arrival or its group is gone: see ``dropped``


@dataclass
class Row(Generic[H]):
    """One sample in an agent's table."""

    sample: Sample
    handle: H
    seq: int  # arrival order, for oldest-first dispatch
    is_processing: bool = False

    @property
    def sample_id(self) -> str:
        return self.sample.sample_id

    @property
    def policy_version(self) -> int:
        return self.sample.version


@dataclass
class Dropped(Generic[H]):
    """Samples removed without training, with the handles to settle (ack) and why."""

    reason: str
    samples: list[Sample] = field(default_factory=list)
    handles: list[H] = field(default_factory=list)

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]


@dataclass
class AddResult(Generic[H]):
    kind: AddKind
    settle: H | None = None  # a handle the caller no longer needs the store to hold
    dropped: list[Dropped[H]] = field(default_factory=list)


@dataclass
class Take(Generic[H]):
    """Complete groups taken for one micro-batch; rows stay held (is_processing) until commit or release."""

    groups: list[list[Sample]]
    group_keys: list[str]

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for g in self.groups for s in g]


@dataclass
class _Group:
    size: int
    first_seq: int
    members: list[str] = field(default_factory=list)  # sample ids, arrival order


class _Recent:
    """A bounded set that forgets its oldest entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._d[key] = None
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._d


class ExperienceStore(Generic[H]):
    """Samples of one model, grouped by ``group_key``; dispatches whole groups, drops stale ones."""

    def __init__(self, model: str, max_staleness: int, *, remember: int = 200_000) -> None:
        self.model = model
        self.max_staleness = max_staleness
        self.trained_version = 0
        self.tables: dict[str, dict[str, Row[H]]] = defaultdict(dict)  # agent -> sample_id -> row
        self._agent_of: dict[str, str] = {}  # sample_id -> agent
        self._groups: dict[str, _Group] = {}
        self._seen = _Recent(remember)  # ids dispatched or dropped
        self._closed = _Recent(remember)  # group keys dispatched
        self._dead = _Recent(remember)  # group keys dropped
        self._seq = 0
        self.duplicates = 0

    # --- intake ---------------------------------------------------------------------------
    def add(self, sample: Sample, handle: H) -> AddResult[H]:
        """Accept a sample; duplicates replace the held handle instead of adding a second row."""
        sid = sample.sample_id
        row = self._row(sid)
        if row is not None:
            self.duplicates += 1
            old, row.handle = row.handle, handle
            return AddResult(AddKind.DUPLICATE, settle=old)
        if sid in self._seen:
            self.duplicates += 1
            return AddResult(AddKind.SEEN, settle=handle)
        key = sample.group_key
        reason = None
        if key in self._dead:
            reason = GROUP_DROPPED
        elif key in self._closed or self._taken(key):
            reason = LATE
        elif self._is_stale(sample):
            reason = STALE
        if reason is not None:
            self._seen.add(sid)
            drops = [Dropped(reason, [sample], [handle])]
            if reason == STALE:
                drops.extend(self._drop_group(key))
            return AddResult(AddKind.DROPPED, dropped=drops)
        self._seq += 1
        self.tables[sample.agent][sid] = Row(sample, handle, self._seq)
        self._agent_of[sid] = sample.agent
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(size=sample.group_size, first_seq=self._seq)
        group.members.append(sid)
        return AddResult(AddKind.NEW)

    def set_trained_version(self, version: int) -> list[Dropped[H]]:
        """Raise the trainer version and drop held samples now too stale, with the rest of their groups."""
        if version <= self.trained_version:
            return []
        self.trained_version = version
        stale_keys = [
            key for key, g in self._groups.items()
            if any(not r.is_processing and self._is_stale(r.sample) for r in map(self._row_of, g.members))
        ]
        out: list[Dropped[H]] = []
        for key in stale_keys:
            out.extend(self._drop_group(key))
        return out

    # --- dispatch -------------------------------------------------------------------------
    def complete_groups(self) -> int:
        """Groups with all members held and not already taken."""
        return sum(1 for g in self._groups.values() if self._complete(g))

    def take_micro_batch(self, n_groups: int) -> Take[H] | None:
        """The ``n_groups`` oldest complete groups, marked is_processing; None if fewer are complete."""
        ready = sorted((g.first_seq, key) for key, g in self._groups.items() if self._complete(g))
        if len(ready) < n_groups:
            return None
        keys = [key for _, key in ready[:n_groups]]
        groups: list[list[Sample]] = []
        for key in keys:
            rows = [self._row_of(sid) for sid in self._groups[key].members]
            for r in rows:
                r.is_processing = True
            groups.append([r.sample for r in rows])
        return Take(groups=groups, group_keys=keys)

    def commit(self, take: Take[H]) -> list[H]:
        """The micro-batch is safely downstream: forget its rows; returns their current handles to ack."""
        handles: list[H] = []
        for key in take.group_keys:
            group = self._groups.pop(key)
            self._closed.add(key)
            for sid in group.members:
                handles.append(self._remove(sid).handle)
        return handles

    def release(self, take: Take[H]) -> None:
        """The micro-batch was not published: its groups become available again."""
        for key in take.group_keys:
            for sid in self._groups[key].members:
                self._row_of(sid).is_processing = False

    # --- status ---------------------------------------------------------------------------
    def depth(self) -> int:
        """Samples held (waiting or being dispatched)."""
        return len(self._agent_of)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per agent: rows held and rows being dispatched."""
        return {
            agent: {"held": len(t), "processing": sum(r.is_processing for r in t.values())}
            for agent, t in self.tables.items() if t
        }

    def handles(self) -> list[H]:
        """Every held handle (for keep-alive acks)."""
        return [r.handle for t in self.tables.values() for r in t.values()]

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._agent_of

    # --- internals ------------------------------------------------------------------------
    def _is_stale(self, sample: Sample) -> bool:
        return self.trained_version - sample.version > self.max_staleness

    def _complete(self, g: _Group) -> bool:
        return len(g.members) >= g.size and not self._row_of(g.members[0]).is_processing

    def _taken(self, key: str) -> bool:
        group = self._groups.get(key)
        return group is not None and any(self._row_of(sid).is_processing for sid in group.members)

    def _row(self, sid: str) -> Row[H] | None:
        agent = self._agent_of.get(sid)
        return None if agent is None else self.tables[agent][sid]

    def _row_of(self, sid: str) -> Row[H]:
        return self.tables[self._agent_of[sid]][sid]

    def _remove(self, sid: str) -> Row[H]:
        row = self.tables[self._agent_of.pop(sid)].pop(sid)
        self._seen.add(sid)
        return row

    def _drop_group(self, key: str) -> list[Dropped[H]]:
        """Remove a group's held members (not ones being dispatched); future members are dropped on arrival."""
        if self._taken(key):
            return []
        self._dead.add(key)
        group = self._groups.pop(key, None)
        if group is None:
            return []
        stale: Dropped[H] = Dropped(STALE)
        rest: Dropped[H] = Dropped(GROUP_DROPPED)
        for sid in group.members:
            row = self._remove(sid)
            bucket = stale if self._is_stale(row.sample) else rest
            bucket.samples.append(row.sample)
            bucket.handles.append(row.handle)
        return [d for d in (stale, rest) if d.samples]
