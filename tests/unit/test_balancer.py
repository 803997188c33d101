"""FlexMARL's rollout manager (services/coordinator/balancer.py) on hand-computed queue states: the least-loaded
choice and its ties, heartbeats, re-queues and first-answer-wins, and the inter-agent migration decision (Δ, the
count bound, the one-instance floor, ties)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.coordinator.balancer import DELTA, Migration, RolloutManager, plan_migrations


def manager(**instances: int) -> RolloutManager:
    """A manager with instances of model "a" named by the keywords, each with that many rows reported."""
    m = RolloutManager(heartbeat_s=1.0, misses=3)
    for name, rows in instances.items():
        m.report("a", name, 0.0, queued=rows, running=0)
    return m


def test_a_request_goes_to_the_least_loaded_instance():
    m = manager(r0=5, r1=2, r2=7)
    assert m.dispatch("q1", "a", 4).instance == "r1"  # loads 5, 2, 7: r1; then r1 has 4 rows in flight (> 2)
    assert m.dispatch("q2", "a", 1).instance == "r1"  # loads 5, max(4, 2) = 4, 7
    assert m.dispatch("q3", "a", 3).instance == "r0"  # loads 5, 5, 7: a tie on load, r0 never got a request
    assert {n: i.load for n, i in m.instances["a"].items()} == {"r0": 5, "r1": 5, "r2": 7}


def test_ties_go_to_fewer_tokens_then_to_the_least_recently_sent_then_to_the_name():
    m = RolloutManager()
    m.report("a", "r0", 0.0, queued=1, running=1, tokens=300)
    m.report("a", "r1", 0.0, queued=0, running=2, tokens=100)
    m.report("a", "r2", 0.0, queued=2, running=0, tokens=100)
    assert m.pick("a") == "r1"  # all load 2; r1 and r2 100 tokens; neither sent to yet; r1 by name


def test_idle_instances_take_turns():
    m = manager(r0=0, r1=0, r2=0)
    order = []
    for i in range(6):
        a = m.dispatch(f"q{i}", "a", 1)
        order.append(a.instance)
        m.finish(a)  # answered at once: every instance is idle again at each request
    assert order == ["r0", "r1", "r2", "r0", "r1", "r2"]
    m.report("a", "r3", 1.0, queued=0, running=0)  # a new instance: the next idle request is its
    assert m.dispatch("q9", "a", 1).instance == "r3"


def test_an_answer_lowers_the_load_and_stale_heap_entries_are_skipped():
    m = manager(r0=0, r1=3)
    first = m.dispatch("q1", "a", 8)
    assert first.instance == "r0"
    assert m.pick("a") == "r1"  # 3 < 8
    assert m.finish(first) is True
    assert m.pick("a") == "r0"  # back to 0 rows; its older heap entries (load 8) are stale


def test_a_draining_instance_gets_no_new_requests():
    m = manager(r0=0, r1=9)
    m.report("a", "r0", 1.0, queued=0, running=0, draining=True)
    assert m.pick("a") == "r1"
    assert m.live("a") == ["r1"]


def test_no_live_instance_is_none():
    m = manager(r0=0)
    assert m.dispatch("q", "b", 1) is None
    assert m.dispatch("q", "a", 1, exclude=["r0"]) is None


def test_missed_heartbeats_remove_an_instance_and_hand_back_its_requests():
    m = manager(r0=0, r1=0)
    a1 = m.dispatch("q1", "a", 2)  # r0
    a2 = m.dispatch("q2", "a", 2)  # r1
    m.report("a", "r1", 2.5, queued=2, running=0)
    assert m.expire(3.0) == []  # r0 last seen at 0: 3 s is not more than 3 misses of 1 s
    gone = m.expire(3.5)
    assert [(model, name) for model, name, _ in gone] == [("a", "r0")]
    assert gone[0][2] == [a1]  # q1 is to run again elsewhere
    assert m.live("a") == ["r1"] and m.counters["rerun_after_loss"] == 1
    assert m.dispatch("q1", "a", 2).instance == "r1"
    assert m.finish(a2) is True


def test_a_requeued_request_runs_on_another_instance_and_its_first_answer_wins():
    m = manager(r0=0, r1=3)
    first = m.dispatch("q", "a", 1)
    assert first.instance == "r0"
    again = m.requeue(first)  # timed out on r0: sent to r1 too, r0's attempt stays in flight
    assert again is not None and again.instance == "r1" and m.counters["requeued"] == 1
    assert m.finish(again) is True  # r1 answered first: used
    assert m.instances["a"]["r0"].rows == 0  # r0's attempt no longer counts as its load
    assert m.finish(first) is False  # r0's late answer: discarded, counted
    assert m.counters["discarded"] == 1
    assert m.attempts == {}


def test_removing_an_instance_does_not_hand_back_a_request_still_running_elsewhere():
    m = manager(r0=0, r1=1)
    first = m.dispatch("q", "a", 1)
    m.requeue(first)
    assert m.remove("a", "r0") == []  # its twin on r1 is still in flight
    assert m.remove("a", "r1")[0].request_id == "q"


def test_queue_lengths_count_requests_in_flight_per_model():
    m = manager(r0=0, r1=0)
    m.report("b", "s0", 0.0, queued=0, running=0)
    for i in range(3):
        m.dispatch(f"q{i}", "a", 4)
    assert m.queue_lengths() == {"a": 3, "b": 0}


# --- inter-agent balancing -------------------------------------------------------------------------------------------
def test_no_migration_at_or_below_delta():
    insts = {"a": ["a0", "a1"], "b": ["b0", "b1", "b2"]}
    assert plan_migrations({"a": 5, "b": 0}, insts, delta=5) == []  # disparity 5 is not more than Δ = 5
    assert plan_migrations({"a": 6, "b": 0}, insts, delta=5) == [Migration("b", "a", ("b0", "b1"))]
    assert DELTA == 5


def test_migrations_are_bounded_by_the_queue_difference():
    insts = {"a": ["a0"], "b": [f"b{i}" for i in range(10)]}
    plan = plan_migrations({"a": 9, "b": 7}, insts, delta=1)
    assert plan == [Migration("b", "a", ("b0", "b1"))]  # difference 2, although b could give 9


def test_the_donor_keeps_one_instance():
    assert plan_migrations({"a": 40, "b": 0}, {"a": ["a0"], "b": ["b0", "b1", "b2"]}) == \
        [Migration("b", "a", ("b0", "b1"))]
    assert plan_migrations({"a": 40, "b": 0}, {"a": ["a0"], "b": ["b0"]}) == []


def test_the_donor_gives_its_least_loaded_instances_and_ties_between_models_go_by_name():
    insts = {"a": ["a0"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1"]}
    loads = {"b": {"b0": 4, "b1": 0, "b2": 1}}
    # b and c both have queue 0: the donor is b (first name); a is the most loaded
    assert plan_migrations({"a": 8, "b": 0, "c": 0}, insts, delta=5, loads=loads) == \
        [Migration("b", "a", ("b1", "b2"))]
    # a and c tie for the most loaded: a (first name)
    assert plan_migrations({"a": 8, "b": 0, "c": 8}, insts, delta=5, loads=loads)[0].target == "a"


def test_one_model_never_migrates():
    assert plan_migrations({"a": 100}, {"a": ["a0", "a1"]}) == []


@settings(max_examples=300, deadline=None)
@given(queues=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 60), min_size=1, max_size=4),
       counts=st.lists(st.integers(1, 8), min_size=4, max_size=4), delta=st.integers(0, 10))
def test_migration_invariants(queues, counts, delta):
    insts = {m: [f"{m}{i}" for i in range(n)] for m, n in zip("abcd", counts, strict=True) if m in queues}
    plan = plan_migrations(queues, insts, delta=delta)
    disparity = max(queues.values()) - min(queues.values())
    if disparity <= delta:
        assert plan == []
    for mig in plan:
        assert queues[mig.target] == max(queues.values()) and queues[mig.donor] == min(queues.values())
        assert 1 <= len(mig.instances) <= queues[mig.target] - queues[mig.donor]
        assert len(insts[mig.donor]) - len(mig.instances) >= 1
        assert set(mig.instances) <= set(insts[mig.donor])


def test_heartbeats_of_an_unchanged_load_and_a_model_nothing_picks_keep_the_heap_small():
    m = RolloutManager(heartbeat_s=1.0, misses=3)
    for i in range(8):
        m.report("a", f"i{i}", 0.0, queued=0, running=0)
    for k in range(10_000):
        m.report("a", f"i{k % 8}", float(k), queued=0, running=0)  # unchanged: no new heap entry
    assert len(m._heaps["a"]) <= 8 + 8
    for k in range(10_000):
        m.report("a", f"i{k % 8}", float(k), queued=k % 3, running=0)  # changing, and never picked
    assert len(m._heaps["a"]) <= 4 * 8 + 64 + 1
    for i in range(8):  # what the compaction kept still orders the instances
        m.report("a", f"i{i}", 1e5, queued=9 - i, running=0)
    assert m.pick("a") == "i7"
    m.report("a", "i7", 1e5, queued=20, running=0)
    loads = {n: i.load for n, i in m.instances["a"].items()}
    assert loads[m.pick("a")] == min(loads.values())
