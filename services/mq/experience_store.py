"""The experience store of one model: FlexMARL's per-agent tables (Fig. 3), groups, staleness, dispatch policies.

Pure logic, no NATS. One table per agent of rows with meta, data and status columns (:mod:`services.mq.table`):
simple values live in the row, complex ones in the store's ``blobs`` with only their key in the row.

A row is written all at once from a complete Sample (:meth:`ExperienceStore.add`) or column by column
(:meth:`~ExperienceStore.open`, then :meth:`~ExperienceStore.update`); it is dispatchable once every status is
true, and dispatch rebuilds the Sample from the columns. Advantage rule: any written value fills its column,
None included, because None asks the trainer for GRPO over its micro-batch; so ``add`` always fills it. A row
opened without an advantage waits for one under grouping "episode" (the coordinator's, over the whole group)
and starts filled with None under grouping "trainer".

Each row carries an opaque ``handle`` (the service's ack handle) given back exactly once: in a committed
micro-batch, in a drop, or as a replaced duplicate.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

from services.mq.table import COLUMNS, Blobs, Row, checked, checked_head, columns_of, head_of
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import Sample

H = TypeVar("H")

# Reasons a sample leaves the store without being trained.
STALE = "stale"  # trained_version - sample.version > max_staleness
GROUP_DROPPED = "group_dropped"  # (grouping episode) a member of its group was dropped; a partial group is useless
LATE = "late"  # (grouping episode) its group was already dispatched in a micro-batch
OVERFLOW = "overflow"  # shed by :meth:`ExperienceStore.shed` to keep the store within its capacity
FINISHED = "finished"  # the model reached train.max_versions (:meth:`ExperienceStore.finish`): nothing trains it

Grouping = Literal["episode", "trainer"]
Mode = Literal["sync", "microbatch", "async"]


class AddKind(StrEnum):
    """What :meth:`ExperienceStore.add` did with a sample."""

    NEW = "new"  # stored
    DUPLICATE = "duplicate"  # id already held: handle replaced, ``settle`` is the previous handle
    SEEN = "seen"  # id already dispatched or dropped: ``settle`` is the new handle (nothing to keep)
    DROPPED = "dropped"  # stale on arrival or its group is gone: see ``dropped``


@dataclass(frozen=True)
class Policy:
    """Which rows make a micro-batch (``train.grouping``) and when micro-batches leave (``train.mode``)."""

    grouping: Grouping = "episode"  # episode: whole groups only; trainer: the oldest rows, a group may split
    mode: Mode = "async"  # sync: nothing leaves until a whole global batch is dispatchable, then all of it
    micro_groups: int = 1  # whole groups per micro-batch under grouping "episode"
    micro_samples: int = 1  # samples per micro-batch under grouping "trainer"
    global_batch: int = 1  # samples per optimizer step: the sync barrier

    def __post_init__(self) -> None:
        if self.grouping not in ("episode", "trainer") or self.mode not in ("sync", "microbatch", "async"):
            raise ValueError(f"dispatch policy: grouping must be episode|trainer and mode sync|microbatch|async, "
                             f"got {self.grouping!r} and {self.mode!r}")
        if min(self.micro_groups, self.micro_samples, self.global_batch) < 1:
            raise ValueError(f"dispatch policy: batch sizes must be >= 1, got {self}")

    @classmethod
    def of(cls, cfg: ChorusConfig) -> Policy:
        """The policy of a run's ``train`` section."""
        t = cfg.train
        return cls(t.grouping, t.mode, cfg.micro_batch_groups(), t.micro_batch, t.global_batch)

    @property
    def micro_size(self) -> int:
        """Units per micro-batch: groups (episode) or samples (trainer)."""
        return self.micro_groups if self.grouping == "episode" else self.micro_samples


@dataclass
class Dropped(Generic[H]):
    """Samples removed without training, with the handles to settle (ack) and why."""

    reason: str
    sample_ids: list[str] = field(default_factory=list)
    handles: list[H] = field(default_factory=list)


@dataclass
class AddResult(Generic[H]):
    kind: AddKind
    settle: H | None = None  # a handle the caller no longer needs the store to hold
    dropped: list[Dropped[H]] = field(default_factory=list)


@dataclass
class Take(Generic[H]):
    """One micro-batch, by group; its rows stay held (is_processing) until commit or release."""

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
    members: list[str] = field(default_factory=list)  # held sample ids, arrival order


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
    """Rows of one model in per-agent tables; dispatches micro-batches by its :class:`Policy`, drops stale rows."""

    def __init__(self, model: str, max_staleness: int, *, policy: Policy | None = None,
                 remember: int = 200_000) -> None:
        self.model = model
        self.max_staleness = max_staleness
        self.policy = policy or Policy()
        self.trained_version = 0
        self.tables: dict[str, dict[str, Row[H]]] = defaultdict(dict)  # agent -> sample_id -> row
        self.blobs = Blobs()  # Ref.key -> complex value
        self._agent_of: dict[str, str] = {}  # sample_id -> agent
        self._groups: dict[str, _Group] = {}
        self._seen = _Recent(remember)  # ids dispatched or dropped
        self._closed = _Recent(remember)  # group keys dispatched
        self._dead = _Recent(remember)  # group keys dropped
        self._seq = 0
        self._owed = 0  # sync mode: samples of the released global batch not yet taken
        # sync mode: samples taken since the trainer's version last moved. The trainer holds them toward its next
        # step, so the next batch is released when the store has the rest (groups of MARFT's episodes vary in
        # size: a batch may end part-way through a micro-batch, and its last group then overshoots it).
        self._sent = 0
        # sync mode, MARFT: a batch the coordinator published whole says its size (Sample.batch_samples, per
        # generating version); the barrier releases all of it, which may pass the global batch
        self._batch_size: dict[int, int] = {}
        self.duplicates = 0
        self.finished = False

    @property
    def _episode(self) -> bool:
        return self.policy.grouping == "episode"

    # --- intake ---------------------------------------------------------------------------
    def add(self, sample: Sample, handle: H) -> AddResult[H]:
        """Accept a complete sample (every column filled); a duplicate replaces the held handle."""
        res = self._admit(sample.sample_id, sample.group_key, sample.version, handle)
        if res is None:
            self._insert(head_of(sample), columns_of(sample), handle)
            res = AddResult(AddKind.NEW)
        return res

    def open(self, head: Mapping[str, Any], handle: H, **columns: Any) -> AddResult[H]:
        """Accept a partial row: the Sample's non-data fields (:func:`head_of`) and the columns known so far."""
        full = checked_head(head)
        sid = full["sample_id"]
        values = {c: checked(sid, c, v) for c, v in columns.items()}
        if not self._episode:
            values.setdefault("advantage", None)  # the trainer computes it over its micro-batch
        res = self._admit(sid, full["group_key"], full["version"], handle)
        if res is None:
            self._insert(full, values, handle)
            res = AddResult(AddKind.NEW)
        return res

    def update(self, sample_id: str, **columns: Any) -> bool:
        """Fill columns of a held row; False if the row is gone already (dispatched or dropped)."""
        row = self._row(sample_id)
        if row is None:
            if sample_id in self._seen:
                return False
            raise ValueError(f"update: no row {sample_id!r} in the experience store of {self.model}; open it first")
        if row.is_processing:
            raise ValueError(f"update: row {sample_id} is being dispatched; its columns are fixed until it is "
                             "committed or released")
        for column, value in {c: checked(sample_id, c, v) for c, v in columns.items()}.items():
            self.blobs.write(row, column, value)
        return True

    def set_trained_version(self, version: int) -> list[Dropped[H]]:
        """Raise the trainer version and drop held rows now too stale (grouping episode: with their groups)."""
        if version <= self.trained_version:
            return []
        self.trained_version = version
        self._sent = 0
        self._batch_size = {v: n for v, n in self._batch_size.items() if v >= version}
        if not self._episode:
            stale: Dropped[H] = Dropped(STALE)
            for sid in [r.sample_id for r in self._rows() if not r.is_processing and self._stale(r.policy_version)]:
                self._drop_into(stale, sid)
            return [stale] if stale.sample_ids else []
        stale_keys = [
            key for key, g in self._groups.items()
            if any(not r.is_processing and self._stale(r.policy_version) for r in map(self._row_of, g.members))
        ]
        out: list[Dropped[H]] = []
        for key in stale_keys:
            out.extend(self._drop_group(key))
        return out

    def finish(self) -> list[Dropped[H]]:
        """The model trains no more: drop every held row not being dispatched, and every later arrival (FINISHED),
        so each sample of the run ends up trained or counted dropped."""
        self.finished = True
        out: Dropped[H] = Dropped(FINISHED)
        for sid in [r.sample_id for r in self._rows() if not r.is_processing]:
            self._drop_into(out, sid)
        return [out] if out.sample_ids else []

    def shed(self, capacity: int) -> list[Dropped[H]]:
        """Drop the oldest groups not being dispatched (OVERFLOW) until at most ``capacity`` rows are held."""
        if capacity < 0:
            raise ValueError(f"shed: capacity must be >= 0, got {capacity}")
        out: Dropped[H] = Dropped(OVERFLOW)
        oldest = sorted(
            (min(r.seq for r in idle), key) for key, g in self._groups.items()
            if (idle := [r for r in map(self._row_of, g.members) if not r.is_processing])
        )
        for _, key in oldest:
            if self.depth() <= capacity:
                break
            if self._episode:
                self._dead.add(key)  # later members would only make a partial group
            for sid in list(self._groups[key].members):
                if not self._row_of(sid).is_processing:
                    self._drop_into(out, sid)
        return [out] if out.sample_ids else []

    # --- dispatch -------------------------------------------------------------------------
    def complete_groups(self) -> int:
        """Groups with all members held, filled and not already taken."""
        return sum(1 for g in self._groups.values() if self._complete(g))

    def take_micro_batch(self, n: int | None = None) -> Take[H] | None:
        """The next micro-batch by the policy, marked is_processing; None if none is due.

        ``n`` overrides the policy's micro-batch size: groups under grouping "episode", samples under "trainer".
        """
        size = self.policy.micro_size if n is None else n
        if size < 1:
            raise ValueError(f"take_micro_batch: the micro-batch size must be >= 1, got {size}")
        units = self._units()
        if self.policy.mode != "sync":
            return self._take(units[:size]) if len(units) >= size else None
        if self._owed <= 0:
            need = max(self.policy.global_batch, self._batch_size.get(self.trained_version, 0)) - self._sent
            if need <= 0 or sum(map(len, units)) < need:
                return None  # the trainer has (or the store lacks) the rest of the batch
            self._owed = need
        chosen: list[list[str]] = []
        total = 0
        for unit in units:
            if len(chosen) == size or (chosen and total + len(unit) > self._owed):
                break
            chosen.append(unit)
            total += len(unit)
        if not chosen:
            return None
        self._owed -= total
        self._sent += total
        return self._take(chosen)

    def commit(self, take: Take[H]) -> list[H]:
        """The micro-batch is safely downstream: forget its rows; returns their current handles to ack."""
        handles = [self._remove(sid).handle for sid in take.sample_ids]
        if self._episode:
            for key in take.group_keys:
                self._closed.add(key)
        return handles

    def release(self, take: Take[H]) -> None:
        """The micro-batch was not published: its rows become available again."""
        ids = take.sample_ids
        for sid in ids:
            self._row_of(sid).is_processing = False
        if self.policy.mode == "sync":
            self._owed += len(ids)
            self._sent -= len(ids)

    # --- status ---------------------------------------------------------------------------
    def depth(self) -> int:
        """Rows held (waiting, partial or being dispatched)."""
        return len(self._agent_of)

    def counts(self) -> dict[str, dict[str, Any]]:
        """Per agent table: rows held, processing, dispatchable (filled, not processing), and filled per column."""
        return {
            agent: {
                "held": len(t),
                "processing": sum(r.is_processing for r in t.values()),
                "dispatchable": sum(r.filled and not r.is_processing for r in t.values()),
                "filled": {c: sum(r.status[c] for r in t.values()) for c in COLUMNS},
            }
            for agent, t in self.tables.items() if t
        }

    def handles(self) -> list[H]:
        """Every held handle (for keep-alive acks)."""
        return [r.handle for r in self._rows()]

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._agent_of

    # --- internals: rows ------------------------------------------------------------------
    def _admit(self, sid: str, key: str, version: int, handle: H) -> AddResult[H] | None:
        """Settle a sample that will not get a new row (duplicate, seen, dropped); None if it gets one."""
        row = self._row(sid)
        if row is not None:
            self.duplicates += 1
            old, row.handle = row.handle, handle
            return AddResult(AddKind.DUPLICATE, settle=old)
        if sid in self._seen:
            self.duplicates += 1
            return AddResult(AddKind.SEEN, settle=handle)
        # A stale sample is STALE whatever became of its group: the same samples get the same reason whether they
        # arrive in one fetch or in several.
        reason = None
        if self.finished:
            reason = FINISHED
        elif self._stale(version):
            reason = STALE
        elif key in self._dead:
            reason = GROUP_DROPPED
        elif self._episode and (key in self._closed or self._taken(key)):
            reason = LATE
        if reason is None:
            return None
        self._seen.add(sid)
        drops = [Dropped(reason, [sid], [handle])]
        if reason == STALE and self._episode:
            drops.extend(self._drop_group(key))
        return AddResult(AddKind.DROPPED, dropped=drops)

    def _insert(self, head: Mapping[str, Any], columns: Mapping[str, Any], handle: H) -> None:
        if head.get("batch_samples"):
            v = int(head["version"])
            self._batch_size[v] = max(self._batch_size.get(v, 0), int(head["batch_samples"]))
        self._seq += 1
        row: Row[H] = self.blobs.new_row(head, handle, self._seq)
        for column, value in columns.items():
            self.blobs.write(row, column, value)
        self.tables[head["agent"]][row.sample_id] = row
        self._agent_of[row.sample_id] = head["agent"]
        group = self._groups.get(row.group_key)
        if group is None:
            group = self._groups[row.group_key] = _Group(size=head["group_size"], first_seq=self._seq)
        group.members.append(row.sample_id)

    def _rows(self) -> list[Row[H]]:
        return [r for t in self.tables.values() for r in t.values()]

    def _row(self, sid: str) -> Row[H] | None:
        agent = self._agent_of.get(sid)
        return None if agent is None else self.tables[agent][sid]

    def _row_of(self, sid: str) -> Row[H]:
        return self.tables[self._agent_of[sid]][sid]

    def _remove(self, sid: str) -> Row[H]:
        """Forget a row, its blobs and its group membership."""
        row = self.tables[self._agent_of.pop(sid)].pop(sid)
        self.blobs.free(row)
        group = self._groups.get(row.group_key)
        if group is not None:
            group.members.remove(sid)
            if not group.members:
                del self._groups[row.group_key]
        self._seen.add(sid)
        return row

    def _drop_into(self, out: Dropped[H], sid: str) -> None:
        out.handles.append(self._remove(sid).handle)
        out.sample_ids.append(sid)

    # --- internals: dispatch and staleness ------------------------------------------------
    def _stale(self, version: int) -> bool:
        return self.trained_version - version > self.max_staleness

    def _dispatchable(self, row: Row[H]) -> bool:
        return row.filled and not row.is_processing

    def _complete(self, g: _Group) -> bool:
        return len(g.members) >= g.size and all(self._dispatchable(self._row_of(s)) for s in g.members)

    def _taken(self, key: str) -> bool:
        group = self._groups.get(key)
        return group is not None and any(self._row_of(sid).is_processing for sid in group.members)

    def _units(self) -> list[list[str]]:
        """What micro-batches are made of, oldest first: whole groups (episode) or single rows (trainer)."""
        if self._episode:
            ready = sorted((g.first_seq, key) for key, g in self._groups.items() if self._complete(g))
            return [list(self._groups[key].members) for _, key in ready]
        return [[r.sample_id] for r in sorted((r for r in self._rows() if self._dispatchable(r)), key=lambda r: r.seq)]

    def _take(self, units: list[list[str]]) -> Take[H]:
        by_key: dict[str, list[Sample]] = {}
        for sid in (s for unit in units for s in unit):
            row = self._row_of(sid)
            row.is_processing = True
            by_key.setdefault(row.group_key, []).append(self.blobs.sample(row))
        return Take(groups=list(by_key.values()), group_keys=list(by_key))

    def _drop_group(self, key: str) -> list[Dropped[H]]:
        """(grouping episode) Remove a group's held members unless it is being dispatched; later members are dropped
        on arrival. Members are STALE or GROUP_DROPPED."""
        if self._taken(key):
            return []
        self._dead.add(key)
        group = self._groups.get(key)
        if group is None:
            return []
        stale: Dropped[H] = Dropped(STALE)
        rest: Dropped[H] = Dropped(GROUP_DROPPED)
        for sid in list(group.members):
            self._drop_into(stale if self._stale(self._row_of(sid).policy_version) else rest, sid)
        return [d for d in (stale, rest) if d.sample_ids]
