"""ARL-Tangram's elastic scheduler (services/actions/elastic.py) on hand-computed examples, and its invariants under
hypothesis: it never allocates more than is free, never outside an action's feasible units, starts actions of one key
resource only as a prefix of the queue (FCFS: nobody passes the head), starts the head whenever its minimum fits and
nothing runs to wake it later, and drains every queue (nobody starves)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.actions.elastic import (
    Action,
    DPArrange,
    DurationProfile,
    Elasticity,
    Units,
    estimate,
    schedule,
    total_units,
)

LINEAR = Elasticity("linear")


def cpu(id_: str, t: float | None, lo: int = 1, hi: int | None = 4, elasticity: Elasticity | None = LINEAR,
        choices: tuple[int, ...] | None = None, **other: Units) -> Action:
    units = Units(choices=choices) if choices else Units(lo, hi)
    return Action(id_, "test", {"cpu": units, **other}, key="cpu", elasticity=elasticity, t_ori=t)


def started(decision) -> dict[str, int]:
    return {a.id: units["cpu"] for a, units in decision.start}


def test_get_dur_is_eq_1_with_amdahls_elasticity():
    a = cpu("a", 10.0, elasticity=Elasticity("amdahl", serial=0.1), hi=8)
    # speed-up on 4 cores 1 / (0.1 + 0.9 / 4) = 3.0769..., so 10 / 3.0769 = 3.25
    assert a.get_dur(4) == pytest.approx(3.25)
    assert a.get_dur(1) == pytest.approx(10.0) and a.get_dur() == pytest.approx(10.0)  # at its minimum
    assert cpu("z", 10.0, elasticity=Elasticity("zero")).get_dur(4) == pytest.approx(10.0)
    table = cpu("t", 12.0, elasticity=Elasticity("table", table=((1, 1.0), (2, 0.75), (4, 0.5))))
    assert [table.get_dur(m) for m in (1, 2, 3, 4)] == pytest.approx([12.0, 8.0, 5.333333, 6.0])


def test_dp_arrange_two_elastic_actions_by_hand():
    # T = 8 and 2 on 4 cores, each 1..4: (3, 1) costs 8/3 + 2 = 4.667, (2, 2) 5, (1, 3) 8.667
    dp = DPArrange([cpu("a", 8.0), cpu("b", 2.0)], "cpu", 4)
    arr = dp.arrange(2)
    assert arr.units == [3, 1] and arr.total == pytest.approx(8 / 3 + 2)
    assert dp.arrange(1).units == [4] and dp.arrange(1).total == pytest.approx(2.0)  # the prefix of one: all 4


def test_dp_arrange_three_actions_on_a_discrete_unit_set_by_hand():
    # units {1, 2, 4}, 6 cores, T = 8, 8, 2: (2, 2, 2) costs 4 + 4 + 1 = 9; (4, 1, 1) 12; (2, 2, 1) 10
    acts = [cpu(n, t, choices=(1, 2, 4)) for n, t in (("a", 8.0), ("b", 8.0), ("c", 2.0))]
    arr = DPArrange(acts, "cpu", 6).arrange(3)
    assert arr.units == [2, 2, 2] and arr.total == pytest.approx(9.0)
    # 7 cores cannot all be used by sets {1, 2, 4} x 2 ... the best state within 7 is taken
    two = DPArrange(acts[:2], "cpu", 7).arrange(2)
    assert two.units == [4, 2] or two.units == [2, 4]
    assert two.total == pytest.approx(2 + 4)


def test_dp_arrange_refuses_candidates_whose_minimums_do_not_fit():
    with pytest.raises(ValueError, match="at least 4 units"):
        DPArrange([cpu("a", 1.0, lo=2), cpu("b", 1.0, lo=2)], "cpu", 3)


def test_the_estimate_runs_the_rest_of_the_queue_through_the_completion_heap_by_hand():
    # heap [1, 3]; rest: x (T 4, tries 1 or 2 units), y (T 2 at its minimum 1)
    rest = [cpu("x", 4.0), cpu("y", 2.0)]
    # d = 1: x at ts 1 ends 5 (ACT 5), y at ts 3 ends 5 (5): 10; d = 2: x ends 1 + 2 = 3, y at ts 3 ends 5: 8
    assert estimate([1.0, 3.0], rest, 2, "cpu", 4) == pytest.approx(8.0)
    assert estimate([1.0, 3.0], rest, 1, "cpu", 4) == pytest.approx(10.0)
    assert estimate([], rest, 1, "cpu", 4) == pytest.approx(4.0 + 6.0)  # an empty heap: one slot, free at 0


def test_eviction_stops_at_the_first_candidate_set_that_does_not_lower_the_objective():
    # Three actions of T = 4 (linear, 1..4) on 4 free cores, depth 4:
    #   all three: DP (2, 1, 1) = 2 + 4 + 4 = 10
    #   evict c:   DP (2, 2) = 4; c waits for the heap [2, 2], best of d in 1..4 is 2 + 1 = 3: 7 < 10, go on
    #   evict b,c: DP (4) = 1; b at ts 1 with 4 cores ends 2 (ACT 2), c at its minimum from ts 2 ends 6: 9 >= 7, stop
    acts = [cpu(n, 4.0) for n in "abc"]
    d = schedule(acts, {"cpu": 4}, depth=4)
    assert started(d) == {"a": 2, "b": 2} and d.evicted == 1


def test_depth_lets_the_estimate_see_that_running_one_at_a_time_is_better():
    # Two actions of T = 4, linear, on 4 cores. Sharing: both end at 2, sum 4. depth 4: a alone on 4 cores ends at
    # 1, then b on 4 ends at 2: sum 3, so b is evicted. depth 2: b could only take 1 or 2 cores later: 1 + 3 = 4,
    # not lower: both share.
    acts = [cpu("a", 4.0), cpu("b", 4.0)]
    assert started(schedule(acts, {"cpu": 4}, depth=4)) == {"a": 4}
    assert started(schedule(acts, {"cpu": 4}, depth=2)) == {"a": 2, "b": 2}


def test_the_head_waits_for_a_near_completion_rather_than_run_on_one_core():
    # h: T = 8, linear, 1..4; one core free; something ends in 0.5 s. Start now on 1 core: ACT 8. Evict the whole
    # group (t = |C|): h waits 0.5 s, and the estimate's best of d in {1, 2} is 0.5 + 8/2 = 4.5 < 8: it waits.
    h = cpu("h", 8.0)
    d = schedule([h], {"cpu": 1}, {"cpu": [0.5]}, depth=2)
    assert started(d) == {} and d.evicted == 1
    # depth 1: waiting only lets it start on one core later, 0.5 + 8 >= 8: it starts now
    assert started(schedule([h], {"cpu": 1}, {"cpu": [0.5]}, depth=1)) == {"h": 1}
    # nothing running: no completion would wake it, so the head starts whatever the estimate says
    assert started(schedule([h], {"cpu": 1}, {}, depth=2)) == {"h": 1}


def test_a_non_scalable_action_behind_a_scalable_one_is_evicted_with_the_suffix():
    # s: T = 8, linear, 1..4; x: a tool call, zero elasticity, T = 1, one core; 2 cores free, one ending at 0.5.
    #   both:     s on 1, x on 1: 8 + 1 = 9
    #   evict x:  s on 2: 4; x from the heap [0.5, 4] at 0.5 ends 1.5: 5.5 < 9, go on
    #   evict s:  heap [0.5]; best d = 2: s 0.5 + 4 = 4.5, x from 4.5 ends 5.5: 10 >= 5.5, stop
    # x waits behind s (FCFS), it does not take the core s scales onto.
    s_ = cpu("s", 8.0)
    x = cpu("x", 1.0, hi=1, elasticity=Elasticity("zero"))
    d = schedule([s_, x], {"cpu": 2}, {"cpu": [0.5]}, depth=2)
    assert started(d) == {"s": 2} and d.evicted == 1


def test_unknown_and_zero_elasticity_start_at_their_minimum():
    acts = [cpu("u", 8.0, elasticity=None), cpu("z", 8.0, elasticity=Elasticity("zero")), cpu("p", None)]
    d = schedule(acts, {"cpu": 16})
    assert started(d) == {"u": 1, "z": 1, "p": 1}  # p: elastic but never profiled


def test_a_discrete_unit_set_is_respected():
    d = schedule([cpu("a", 8.0, choices=(1, 2, 4, 8))], {"cpu": 6})
    assert started(d) == {"a": 4}  # 6 is not in the set; 8 does not fit


def test_candidates_are_the_fcfs_prefix_that_fits_every_resource_at_its_minimum():
    mem = {"mem": Units.fixed(6)}
    a = cpu("a", 4.0, **mem)
    b = cpu("b", 4.0, **{"mem": Units.fixed(4)})
    c = cpu("c", 4.0, **{"mem": Units.fixed(1)})
    d = schedule([a, b, c], {"cpu": 8, "mem": 8})
    # b does not fit the memory left; c would, but FCFS never lets it pass b
    assert [x.id for x, _ in d.start] == ["a"]
    assert d.start[0][1] == {"cpu": 4, "mem": 6}  # a scales to its maximum; memory stays at its need


def test_other_keys_minimums_are_kept_out_of_a_groups_dp():
    gpu_action = Action("g", "judge", {"gpu": Units(1, 2), "cpu": Units.fixed(2)}, key="gpu", elasticity=LINEAR,
                        t_ori=4.0)
    d = schedule([gpu_action, cpu("c", 8.0, hi=None)], {"cpu": 6, "gpu": 2})
    assert total_units(d)["cpu"] <= 6
    assert dict((a.id, u) for a, u in d.start)["c"]["cpu"] == 4  # 6 cores less the judge's 2


def test_a_kind_without_a_profile_learns_t_ori_from_its_runs():
    profile = DurationProfile()
    a = Action("x", "tests", {"cpu": Units(1, 4)}, key="cpu", elasticity=LINEAR)
    assert profile.fill(a).t_ori is None
    profile.observe(a, 2, 3.0)  # 3 s on 2 linear cores: 6 s on one
    profile.observe(a, 1, 4.0)
    b = profile.fill(Action("y", "tests", {"cpu": Units(1, 4)}, key="cpu", elasticity=LINEAR))
    assert b.t_ori == pytest.approx(5.0)


# --- properties ------------------------------------------------------------------------------------------------------
ELASTICITIES = st.sampled_from([None, LINEAR, Elasticity("amdahl", serial=0.2), Elasticity("zero"),
                                Elasticity("table", table=((1, 1.0), (2, 0.9), (4, 0.6)))])


@st.composite
def actions(draw, i: int) -> Action:
    discrete = draw(st.booleans())
    if discrete:
        units = Units(choices=tuple(draw(st.sets(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=4))))
    else:
        lo = draw(st.integers(1, 4))
        units = Units(lo, lo + draw(st.integers(0, 12)))
    cost = {"cpu": units}
    if draw(st.booleans()):
        cost["mem"] = Units.fixed(draw(st.integers(0, 8)))
    return Action(f"a{i}", "k", cost, key="cpu", elasticity=draw(ELASTICITIES),
                  t_ori=draw(st.one_of(st.none(), st.floats(0.01, 100.0))))


@st.composite
def queues(draw) -> list[Action]:
    n = draw(st.integers(1, 12))
    return [draw(actions(i)) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(queue=queues(), cores=st.integers(1, 32), mem=st.integers(0, 32), depth=st.integers(1, 3),
       running=st.lists(st.floats(0.0, 50.0), max_size=5))
def test_never_over_allocates_starts_a_prefix_and_never_strands_the_head(queue, cores, mem, depth, running):
    free = {"cpu": cores, "mem": mem}
    d = schedule(queue, free, {"cpu": running}, depth=depth)
    used = total_units(d)
    assert all(used.get(r, 0) <= free[r] for r in free), (used, free)
    for a, units in d.start:
        for r, u in units.items():
            assert u in a.cost[r].values(10**6), (a, units)
    ids = [a.id for a, _ in d.start]
    assert ids == [a.id for a in queue[:len(ids)]]  # one key resource: a prefix of the queue, nobody passes
    head_fits = all(u <= free.get(r, 0) for r, u in queue[0].min_units().items())
    if not running:  # nothing would wake a waiting head
        assert (ids[:1] == [queue[0].id]) == head_fits
    elif not head_fits:
        assert ids == []


@settings(max_examples=150, deadline=None)
@given(queue=queues(), cores=st.integers(1, 16), mem=st.integers(0, 16), depth=st.integers(1, 3))
def test_repeated_rounds_drain_every_queue_in_fcfs_order(queue, cores, mem, depth):
    """A scheduling round at every completion, as the service runs them: every action starts (nobody starves),
    in queue order, and no round leaves the queue waiting with nothing running to wake it."""
    capacity = {"cpu": cores, "mem": mem}
    assume(all(all(u <= capacity[r] for r, u in a.min_units().items()) for a in queue))
    waiting = list(queue)
    free = dict(capacity)
    now = 0.0
    running: list[tuple[float, Action, dict[str, int]]] = []
    order: list[str] = []
    for _ in range(4 * len(queue) + 4):
        if not waiting:
            break
        d = schedule(waiting, free, {"cpu": [end - now for end, _, _ in running]}, depth=depth)
        for a, units in d.start:
            waiting.remove(a)
            order.append(a.id)
            for r, u in units.items():
                free[r] -= u
            running.append((now + max(a.get_dur(units["cpu"]), 1e-3), a, units))
        assert running, "the queue waits with nothing running to wake it"
        running.sort(key=lambda x: x[0])
        end, _, units = running.pop(0)  # the next completion
        now = end
        for r, u in units.items():
            free[r] += u
    assert not waiting, f"{len(waiting)} actions never started"
    assert order == [a.id for a in queue]
