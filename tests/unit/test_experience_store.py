"""The mq experience store: grouping, duplicates, staleness, micro-batch take/commit/release."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import count

from hypothesis import given, settings
from hypothesis import strategies as st

from services.mq.experience_store import (
    GROUP_DROPPED,
    LATE,
    STALE,
    AddKind,
    Dropped,
    ExperienceStore,
)
from shared.schemas import Array, Sample


def sample(key: str, i: int, *, version: int = 0, size: int = 2, agent: str = "solver") -> Sample:
    return Sample(
        run="r", episode=key, sample_id=f"{key}_0_{i}", env_idx=0, rollout_idx=i, agent=agent, model="m", turn=0,
        prompt_ids=Array.of([1, 2]), response_ids=Array.of([3]), behavior_logprobs=Array.of([-0.5], "float32"),
        reward=float(i), group_key=key, group_size=size, version=version,
    )


def ids(drops: list[Dropped[int]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for d in drops:
        out[d.reason].extend(d.sample_ids)
    return dict(out)


def test_group_is_taken_only_when_complete_and_oldest_first() -> None:
    st_: ExperienceStore[int] = ExperienceStore("m", max_staleness=1)
    st_.add(sample("b", 0), 1)
    st_.add(sample("a", 0), 2)
    assert st_.take_micro_batch(1) is None
    st_.add(sample("a", 1), 3)
    st_.add(sample("b", 1), 4)
    take = st_.take_micro_batch(1)
    assert take is not None and take.group_keys == ["b"]  # b arrived first
    assert st_.counts() == {"solver": {"held": 4, "processing": 2}}
    assert sorted(st_.commit(take)) == [1, 4]
    assert st_.depth() == 2


def test_take_needs_n_complete_groups() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    for i in range(2):
        store.add(sample("a", i), i)
    assert store.take_micro_batch(2) is None
    assert store.complete_groups() == 1


def test_duplicate_replaces_handle_and_is_not_added_twice() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    assert store.add(sample("a", 0), 10).kind is AddKind.NEW
    res = store.add(sample("a", 0), 11)
    assert res.kind is AddKind.DUPLICATE and res.settle == 10
    assert store.depth() == 1 and store.duplicates == 1
    store.add(sample("a", 1), 12)
    take = store.take_micro_batch(1)
    assert take is not None and sorted(take.sample_ids) == ["a_0_0", "a_0_1"]
    assert sorted(store.commit(take)) == [11, 12]


def test_duplicate_of_dispatched_sample_is_settled_not_stored() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.add(sample("a", 0, size=1), 1)
    take = store.take_micro_batch(1)
    assert take is not None
    store.commit(take)
    res = store.add(sample("a", 0, size=1), 2)
    assert res.kind is AddKind.SEEN and res.settle == 2 and store.depth() == 0


def test_late_member_of_dispatched_group_is_dropped_not_regrouped() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.add(sample("a", 0, size=1), 1)
    take = store.take_micro_batch(1)
    assert take is not None
    store.commit(take)
    res = store.add(sample("a", 1, size=1), 2)
    assert res.kind is AddKind.DROPPED and ids(res.dropped) == {LATE: ["a_0_1"]}
    assert store.take_micro_batch(1) is None


def test_stale_samples_are_dropped_with_their_group() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=1)
    store.add(sample("a", 0, version=0, size=3), 1)
    store.add(sample("a", 1, version=1, size=3), 2)
    store.add(sample("b", 0, version=1, size=3), 3)
    drops = store.set_trained_version(2)
    assert ids(drops) == {STALE: ["a_0_0"], GROUP_DROPPED: ["a_0_1"]}
    assert sorted(h for d in drops for h in d.handles) == [1, 2]
    assert store.depth() == 1
    # the rest of a dropped group is dropped on arrival, so no partial group lingers
    res = store.add(sample("a", 2, version=2, size=3), 4)
    assert res.kind is AddKind.DROPPED and ids(res.dropped) == {GROUP_DROPPED: ["a_0_2"]}


def test_sample_stale_on_arrival_is_dropped() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.set_trained_version(3)
    res = store.add(sample("a", 0, version=2), 7)
    assert res.kind is AddKind.DROPPED and res.dropped[0].reason == STALE and res.dropped[0].handles == [7]
    assert store.add(sample("b", 0, version=3), 8).kind is AddKind.NEW


def test_released_take_is_available_again_and_not_dropped_while_processing() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.add(sample("a", 0), 1)
    store.add(sample("a", 1), 2)
    take = store.take_micro_batch(1)
    assert take is not None and store.take_micro_batch(1) is None
    assert store.set_trained_version(5) == []  # in flight: the trainer filters it
    assert store.add(sample("a", 2), 3).dropped[0].reason == LATE
    store.release(take)
    assert ids(store.set_trained_version(6)) == {STALE: ["a_0_0", "a_0_1"]}


def test_counts_are_per_agent() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.add(sample("a", 0, agent="solver"), 1)
    store.add(sample("b", 0, agent="verifier"), 2)
    store.add(sample("b", 1, agent="verifier"), 3)
    assert store.counts() == {"solver": {"held": 1, "processing": 0}, "verifier": {"held": 2, "processing": 0}}
    assert "b_0_1" in store and sorted(store.handles()) == [1, 2, 3]


# --- properties ---------------------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.integers(0, 3), st.integers(0, 4)),  # key, index, version
    st.tuples(st.just("version"), st.integers(0, 2)),  # raise the trained version by this
    st.tuples(st.just("take"), st.integers(1, 3), st.booleans()),  # n groups, commit or release
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=80), max_staleness=st.integers(0, 2), size=st.integers(1, 3))
def test_every_sample_ends_once_and_groups_are_never_split(
    ops: list[tuple], max_staleness: int, size: int
) -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=max_staleness)
    handles = count()
    given_handles: list[int] = []
    returned: Counter[int] = Counter()
    accepted: set[str] = set()
    taken: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    group_takes: Counter[str] = Counter()
    version = 0

    def settle(drops: list[Dropped[int]]) -> None:
        for d in drops:
            dropped.update(d.sample_ids)
            returned.update(d.handles)

    for o in ops:
        if o[0] == "add":
            _, key, idx, v = o
            h = next(handles)
            given_handles.append(h)
            res = store.add(sample(f"g{key}", idx, version=v, size=size), h)
            if res.kind in (AddKind.NEW, AddKind.DROPPED) and f"g{key}_0_{idx}" not in accepted:
                accepted.add(f"g{key}_0_{idx}")
            if res.settle is not None:
                returned[res.settle] += 1
            settle(res.dropped)
        elif o[0] == "version":
            version += o[1]
            settle(store.set_trained_version(version))
        else:
            _, n, commit = o
            take = store.take_micro_batch(n)
            if take is None:
                assert store.complete_groups() < n
                continue
            assert len(take.groups) == n
            for key, group in zip(take.group_keys, take.groups, strict=True):
                assert {s.group_key for s in group} == {key} and len(group) >= size
            if commit:
                returned.update(store.commit(take))
                taken.update(take.sample_ids)
                group_takes.update(take.group_keys)
            else:
                store.release(take)
    settle(store.set_trained_version(version + max_staleness + 10))  # drain whatever is left
    assert store.depth() == 0
    ended = taken + dropped
    assert set(ended) == accepted
    assert all(c == 1 for c in ended.values())  # exactly once, duplicates never twice
    assert all(c == 1 for c in group_takes.values())  # a group is dispatched in one piece
    assert sorted(returned.elements()) == given_handles  # every handle settled exactly once
