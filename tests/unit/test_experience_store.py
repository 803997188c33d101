"""The mq experience store: tables and hybrid storage, grouping, duplicates, staleness, dispatch policies, shedding."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.mq.experience_store import (
    FINISHED,
    GROUP_DROPPED,
    LATE,
    OVERFLOW,
    STALE,
    AddKind,
    Dropped,
    ExperienceStore,
    Policy,
)
from services.mq.table import COLUMNS, Ref, head_of
from shared.kernel.codec import encode
from shared.kernel.config import load_config
from shared.kernel.schemas import Array, Sample


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
    counts = st_.counts()["solver"]
    assert (counts["held"], counts["processing"], counts["dispatchable"]) == (4, 2, 2)
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


def test_a_finished_model_drops_what_it_holds_and_everything_after_but_not_what_is_in_flight() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=1)
    for k in ("a", "b"):
        store.add(sample(k, 0), 1)
        store.add(sample(k, 1), 2)
    store.add(sample("c", 0), 3)  # half a group
    take = store.take_micro_batch(1)
    assert take is not None and take.group_keys == ["a"]
    dropped = store.finish()
    assert ids(dropped) == {FINISHED: ["b_0_0", "b_0_1", "c_0_0"]} and sorted(dropped[0].handles) == [1, 2, 3]
    assert store.commit(take) == [1, 2]  # the micro-batch in flight goes on: the trainer drops it as finished
    late = store.add(sample("c", 1), 9)
    assert late.kind is AddKind.DROPPED and ids(late.dropped) == {FINISHED: ["c_0_1"]}
    assert store.depth() == 0 and store.take_micro_batch(1) is None


def test_released_take_is_available_again_and_not_dropped_while_processing() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.add(sample("a", 0), 1)
    store.add(sample("a", 1), 2)
    take = store.take_micro_batch(1)
    assert take is not None and store.take_micro_batch(1) is None
    assert store.set_trained_version(5) == []  # in flight: the trainer filters it
    assert store.add(sample("a", 2, version=5), 3).dropped[0].reason == LATE  # its group is being dispatched
    assert store.add(sample("a", 3), 4).dropped[0].reason == STALE  # stale is stale, whatever its group's state
    store.release(take)
    assert ids(store.set_trained_version(6)) == {STALE: ["a_0_0", "a_0_1"]}


def test_counts_are_per_agent() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    store.add(sample("a", 0, agent="solver"), 1)
    store.add(sample("b", 0, agent="verifier"), 2)
    store.add(sample("b", 1, agent="verifier"), 3)
    filled = dict.fromkeys(COLUMNS, 1)
    assert store.counts() == {
        "solver": {"held": 1, "processing": 0, "dispatchable": 1, "filled": filled},
        "verifier": {"held": 2, "processing": 0, "dispatchable": 2, "filled": dict.fromkeys(COLUMNS, 2)},
    }
    assert "b_0_1" in store and sorted(store.handles()) == [1, 2, 3]


# --- tables: columns, status, hybrid storage ----------------------------------------------


def rich_sample() -> Sample:
    """A sample with every optional field set, so the round trip has something to lose."""
    return Sample(
        run="r", episode="ep", sample_id="t7_2_1", env_idx=3, rollout_idx=1, agent="verifier", model="m",
        adapter="ver", turn=2, prompt_ids=Array.of([[5, 6, 7]], "int64"), response_ids=Array.of([8, 9]),
        behavior_logprobs=Array.of([-0.25, -1.5], "float32"), reward=0.75, group_key="t7:verifier:2", group_size=2,
        advantage=-0.5, version=4, versions={"m": 4, "other": 1}, timings={"gen_s": 0.5}, created_at=123.25,
    )


def test_row_keeps_simple_values_and_only_keys_of_complex_ones() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    s = rich_sample()
    store.set_trained_version(4)
    store.add(s, 1)
    row = store.tables["verifier"]["t7_2_1"]
    assert (row.policy_version, row.sample_id, row.is_processing) == (4, "t7_2_1", False)
    assert row.status == dict.fromkeys(COLUMNS, True)
    assert row.values["reward"] == 0.75 and row.values["advantage"] == -0.5  # by value
    prompt, response = row.values["prompt"], row.values["response"]
    assert isinstance(prompt, Ref) and isinstance(response, Ref)  # by reference: the row holds a key
    assert store.blobs[prompt.key] == s.prompt_ids
    assert store.blobs[response.key] == (s.response_ids, s.behavior_logprobs)
    assert all(v is None or isinstance(v, bool | int | float | Ref) for v in row.values.values())
    assert store.blobs[row.head.key]["versions"] == {"m": 4, "other": 1}  # the rest of the sample, by reference
    take = store.take_micro_batch(1)
    assert take is None  # half a group
    store.add(sample("t7:verifier:2", 0, version=4, agent="verifier"), 2)
    take = store.take_micro_batch(1)
    assert take is not None
    store.commit(take)
    assert store.blobs == {}  # a committed row leaves nothing behind


def test_dispatch_rebuilds_the_sample_byte_for_byte() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=Policy(grouping="trainer"))
    s = rich_sample()
    store.add(s, 1)
    take = store.take_micro_batch(1)
    assert take is not None and take.samples == [s]
    assert encode(take.samples[0]) == encode(s)
    assert take.samples[0] is not s


def test_partial_row_is_dispatched_only_when_every_column_is_filled() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    a0, a1 = sample("a", 0, size=2), sample("a", 1, size=2)
    a0.advantage, a1.advantage = 1.0, -1.0
    assert store.open(head_of(a0), 10, prompt=a0.prompt_ids).kind is AddKind.NEW
    store.add(a1, 11)
    row = store.tables["solver"]["a_0_0"]
    assert row.status == {"prompt": True, "response": False, "reward": False, "advantage": False}
    assert store.counts()["solver"]["filled"] == {"prompt": 2, "response": 1, "reward": 1, "advantage": 1}
    assert store.take_micro_batch(1) is None
    store.update("a_0_0", response=(a0.response_ids, a0.behavior_logprobs), reward=a0.reward)
    assert store.take_micro_batch(1) is None  # grouping episode: the advantage is still owed
    assert store.complete_groups() == 0 and store.counts()["solver"]["dispatchable"] == 1
    store.update("a_0_0", advantage=1.0)
    take = store.take_micro_batch(1)
    assert take is not None and encode(take.samples[0]) == encode(a0)
    with pytest.raises(ValueError, match="being dispatched"):
        store.update("a_0_0", reward=0.0)
    assert sorted(store.commit(take)) == [10, 11]
    assert store.update("a_0_0", reward=1.0) is False  # gone: nothing to fill


def test_trainer_grouping_fills_a_missing_advantage_with_none() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=Policy(grouping="trainer"))
    s = sample("a", 0)
    store.open(head_of(s), 1, prompt=s.prompt_ids, reward=2)
    assert store.take_micro_batch(1) is None
    store.update("a_0_0", response=[s.response_ids, s.behavior_logprobs])
    take = store.take_micro_batch(1)
    assert take is not None and take.samples[0].advantage is None and take.samples[0].reward == 2.0


def test_bad_columns_and_heads_are_rejected_with_the_reason() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    s = sample("a", 0)
    with pytest.raises(ValueError, match="column 'reward' of sample a_0_0: expected a number, got str"):
        store.open(head_of(s), 1, reward="high")
    with pytest.raises(ValueError, match="2 ids but 1 log-probs"):
        store.open(head_of(s), 1, response=(Array.of([1, 2]), Array.of([0.0], "float32")))
    with pytest.raises(ValueError, match="unknown column 'score'"):
        store.open(head_of(s), 1, score=1.0)
    with pytest.raises(ValueError, match="group_size"):
        store.open({**head_of(s), "group_size": 0}, 1)
    with pytest.raises(ValueError, match="data fields"):
        store.open({**head_of(s), "reward": 1.0}, 1)
    with pytest.raises(ValueError, match="open it first"):
        store.update("nope_0_0", reward=1.0)
    assert store.depth() == 0 and store.blobs == {}  # nothing half-written
    store.open(head_of(s), 1)
    with pytest.raises(ValueError, match="expected an Array"):
        store.update("a_0_0", prompt=[1, 2])
    assert store.tables["solver"]["a_0_0"].status["prompt"] is False


def test_overwriting_a_column_frees_the_old_blob() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0)
    s = sample("a", 0)
    store.open(head_of(s), 1, prompt=s.prompt_ids)
    store.update("a_0_0", prompt=Array.of([9, 9, 9]))
    assert store.blobs["a_0_0/prompt"] == Array.of([9, 9, 9]) and len(store.blobs) == 2  # head and prompt


# --- dispatch policies ----------------------------------------------------------------------


def test_policy_follows_the_train_section(tmp_path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("models: {m: {}}\nagents: {solver: {model: m}, verifier: {model: m}}\nworkflow: {group_size: 4}\n"
                 "train: {global_batch: 16, micro_batch: 8, mode: sync, max_staleness: 0, grouping: trainer}\n")
    assert Policy.of(load_config(p)) == Policy("trainer", "sync", micro_groups=2, micro_samples=8, global_batch=16)
    with pytest.raises(ValueError, match="grouping"):
        Policy(grouping="agent")  # type: ignore[arg-type]


def test_trainer_grouping_splits_groups_oldest_rows_first() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0,
                                                  policy=Policy(grouping="trainer", micro_samples=3))
    for h, (key, i) in enumerate([("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 0)]):
        store.add(sample(key, i, size=2), h)
    take = store.take_micro_batch()
    assert take is not None and take.sample_ids == ["a_0_0", "a_0_1", "b_0_0"]  # a whole, b split
    assert take.group_keys == ["a", "b"]
    assert store.take_micro_batch() is None  # two rows left
    assert sorted(store.commit(take)) == [0, 1, 2]
    # b's other half is no LATE member: it goes out with the next micro-batch
    assert store.add(sample("c", 1, size=2), 5).kind is AddKind.NEW
    take = store.take_micro_batch()
    assert take is not None and take.sample_ids == ["b_0_1", "c_0_0", "c_0_1"]


def test_trainer_grouping_drops_a_stale_row_alone() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=Policy(grouping="trainer"))
    store.add(sample("a", 0, version=0), 1)
    store.add(sample("a", 1, version=1), 2)
    assert ids(store.set_trained_version(1)) == {STALE: ["a_0_0"]}
    res = store.add(sample("a", 2, version=1), 3)  # its group lives on
    assert res.kind is AddKind.NEW and store.depth() == 2
    res = store.add(sample("a", 3, version=0), 4)
    assert ids(res.dropped) == {STALE: ["a_0_3"]} and store.depth() == 2


def test_sync_mode_waits_for_a_whole_global_batch_then_sends_all_of_it() -> None:
    policy = Policy(grouping="episode", mode="sync", micro_groups=1, global_batch=6)
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=policy)
    for h, key in enumerate("ab"):
        store.add(sample(key, 0), 2 * h)
        store.add(sample(key, 1), 2 * h + 1)
    store.add(sample("c", 0), 4)
    assert store.take_micro_batch() is None  # 4 samples in complete groups, 6 needed
    store.add(sample("c", 1), 5)
    store.add(sample("d", 0), 6)
    store.add(sample("d", 1), 7)
    takes = []
    while (take := store.take_micro_batch()) is not None:
        takes.append(take.group_keys)
        store.commit(take)
    assert takes == [["a"], ["b"], ["c"]]  # the global batch, in micro-batches, and no more
    assert store.depth() == 2 and store.complete_groups() == 1


def test_sync_mode_counts_what_the_trainer_holds_toward_the_next_batch() -> None:
    # Groups of varying size (MARFT keeps the turns only some rollouts reached): a global batch of 6 ends inside
    # the last group taken, and nothing more leaves until the trainer's version moves; then the next batch needs
    # a whole 6 again, not 6 on top of what the store already sent.
    policy = Policy(grouping="episode", mode="sync", micro_groups=1, global_batch=6)
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=policy)
    h = count()
    for key, size in (("a", 2), ("b", 3), ("c", 2), ("d", 3)):
        for i in range(size):
            store.add(sample(key, i, size=size), next(h))
    takes = []
    while (take := store.take_micro_batch()) is not None:
        takes.append(take.group_keys)
        store.commit(take)
    assert takes == [["a"], ["b"], ["c"]]  # 2 + 3 + 2 = 7: the last group overshoots the batch of 6
    assert store.take_micro_batch() is None  # d (3) waits: the trainer steps on the 7 first
    dropped = store.set_trained_version(1)  # the step: d was generated by the old weights
    assert ids(dropped) == {"stale": ["d_0_0", "d_0_1", "d_0_2"]}
    for key in ("e", "f"):
        for i in range(3):
            store.add(sample(key, i, size=3, version=1), next(h))
        if key == "e":
            assert store.take_micro_batch() is None  # 3 of the next batch's 6
    takes = []
    while (take := store.take_micro_batch()) is not None:
        takes.append(take.group_keys)
        store.commit(take)
    assert takes == [["e"], ["f"]]


def test_sync_mode_with_trainer_grouping_counts_samples_and_gives_back_released_ones() -> None:
    policy = Policy(grouping="trainer", mode="sync", micro_samples=2, global_batch=5)
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=policy)
    for i in range(4):
        store.add(sample(f"g{i}", 0, size=4), i)
    assert store.take_micro_batch() is None
    store.add(sample("g0", 1, size=4), 4)
    first = store.take_micro_batch()
    assert first is not None and first.sample_ids == ["g0_0_0", "g1_0_0"]
    store.release(first)  # not published: the same rows and the same share of the batch again
    sizes = []
    while (take := store.take_micro_batch()) is not None:
        sizes.append(len(take.sample_ids))
        store.commit(take)
    assert sizes == [2, 2, 1] and store.depth() == 0


def test_sync_mode_releases_a_whole_marft_batch_that_passes_the_global_batch() -> None:
    # the coordinator published a MARFT batch of 10 samples (global batch 6) whole: each says batch_samples 10
    policy = Policy(grouping="episode", mode="sync", micro_groups=1, global_batch=6)
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=policy)
    h = count()
    for key, size in (("a", 2), ("b", 3), ("c", 2), ("d", 3)):
        for i in range(size):
            store.add(sample(key, i, size=size).model_copy(update={"batch_samples": 10}), next(h))
    takes = []
    while (take := store.take_micro_batch()) is not None:
        takes.append(take.group_keys)
        store.commit(take)
    assert takes == [["a"], ["b"], ["c"], ["d"]]  # all 10, not 7: the trainer steps on the whole batch
    assert store.set_trained_version(1) == [] and store.depth() == 0
    for i in range(2):  # the next batch is a plain one again: the global batch
        store.add(sample("e", i, version=1), next(h))
    assert store.take_micro_batch() is None


def test_microbatch_and_async_modes_dispatch_each_micro_batch_at_once() -> None:
    for mode in ("microbatch", "async"):
        policy = Policy(grouping="episode", mode=mode, micro_groups=1, global_batch=64)  # type: ignore[arg-type]
        store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=policy)
        store.add(sample("a", 0), 1)
        store.add(sample("a", 1), 2)
        take = store.take_micro_batch()
        assert take is not None and take.group_keys == ["a"], mode


# --- shedding -------------------------------------------------------------------------------


def test_shed_drops_the_oldest_idle_groups_until_within_capacity() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0, policy=Policy(micro_groups=1))
    for h, (key, i) in enumerate([("a", 0), ("a", 1), ("b", 0), ("c", 0), ("b", 1), ("d", 0)]):
        store.add(sample(key, i, size=2), h)
    take = store.take_micro_batch()  # a is being dispatched: never shed
    assert take is not None and take.group_keys == ["a"]
    assert store.shed(6) == []
    drops = store.shed(3)
    assert ids(drops) == {OVERFLOW: ["b_0_0", "b_0_1", "c_0_0"]}  # oldest first, whole groups
    assert sorted(drops[0].handles) == [2, 3, 4] and store.depth() == 3
    assert store.counts()["solver"]["held"] == 3
    # grouping episode: a shed group's later members would make a partial group
    assert ids(store.add(sample("c", 1, size=2), 9).dropped) == {GROUP_DROPPED: ["c_0_1"]}
    assert store.shed(0) == [Dropped(OVERFLOW, ["d_0_0"], [5])]
    assert store.depth() == 2 and sorted(store.commit(take)) == [0, 1]
    with pytest.raises(ValueError, match="capacity"):
        store.shed(-1)


def test_shed_under_trainer_grouping_keeps_rows_being_dispatched() -> None:
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=0,
                                                  policy=Policy(grouping="trainer", micro_samples=1))
    for h, (key, i) in enumerate([("a", 0), ("a", 1), ("b", 0)]):
        store.add(sample(key, i, size=2), h)
    take = store.take_micro_batch()
    assert take is not None and take.sample_ids == ["a_0_0"]
    assert ids(store.shed(1)) == {OVERFLOW: ["a_0_1", "b_0_0"]}
    assert store.depth() == 1 and store.add(sample("a", 2, size=2), 7).kind is AddKind.NEW


# --- properties ---------------------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.integers(0, 3), st.integers(0, 4)),  # key, index, version
    st.tuples(st.just("version"), st.integers(0, 2)),  # raise the trained version by this
    st.tuples(st.just("take"), st.integers(1, 3), st.booleans()),  # micro-batch size, commit or release
    st.tuples(st.just("shed"), st.integers(0, 6)),  # capacity
)


@pytest.mark.parametrize("grouping", ["episode", "trainer"])
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=80), max_staleness=st.integers(0, 2), size=st.integers(1, 3))
def test_every_sample_ends_once_and_episode_groups_are_never_split(
    grouping: str, ops: list[tuple], max_staleness: int, size: int
) -> None:
    policy = Policy(grouping=grouping)  # type: ignore[arg-type]
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=max_staleness, policy=policy)
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
        elif o[0] == "shed":
            held = store.depth()
            settle(drops := store.shed(o[1]))
            shed = sum(len(d.sample_ids) for d in drops)
            processing = sum(c["processing"] for c in store.counts().values())
            assert store.depth() == held - shed and (store.depth() <= o[1] or store.depth() - processing <= 0)
        else:
            _, n, commit = o
            take = store.take_micro_batch(n)
            if take is None:
                ready = store.complete_groups() if grouping == "episode" else \
                    sum(c["dispatchable"] for c in store.counts().values())
                assert ready < n
                continue
            if grouping == "episode":
                assert len(take.groups) == n
                for key, group in zip(take.group_keys, take.groups, strict=True):
                    assert {s.group_key for s in group} == {key} and len(group) >= size
            else:
                assert len(take.sample_ids) == n
            if commit:
                returned.update(store.commit(take))
                taken.update(take.sample_ids)
                group_takes.update(take.group_keys)
            else:
                store.release(take)
    settle(store.set_trained_version(version + max_staleness + 10))  # drain whatever is left
    assert store.depth() == 0 and store.blobs == {}
    ended = taken + dropped
    assert set(ended) == accepted
    assert all(c == 1 for c in ended.values())  # exactly once, duplicates never twice
    if grouping == "episode":
        assert all(c == 1 for c in group_takes.values())  # a group is dispatched in one piece
    assert sorted(returned.elements()) == given_handles  # every handle settled exactly once


def test_the_members_of_a_stale_group_are_stale_whether_they_arrive_together_or_apart() -> None:
    # apart: each member is stale on arrival, also after the first one took its group down
    store: ExperienceStore[int] = ExperienceStore("m", max_staleness=1)
    store.set_trained_version(3)
    reasons = [d.reason for i in range(2) for d in store.add(sample("old", i, version=1), i).dropped]
    assert reasons == [STALE, STALE]
    # together: held before the trainer moved on, then dropped with the group
    store = ExperienceStore("m", max_staleness=1)
    for i in range(2):
        assert not store.add(sample("old", i, version=1), i).dropped
    assert ids(store.set_trained_version(3)) == {STALE: ["old_0_0", "old_0_1"]}
