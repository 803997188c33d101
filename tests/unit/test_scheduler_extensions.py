"""Chorus's extensions of ARL-Tangram's scheduler (services/actions/elastic.py): the estimate that counts the units a
running action frees, shortest-expected-first order with an ageing bound, and malleable suites; hand-computed cases,
then hypothesis: never over-allocates, nothing younger starts ahead of an action past the ageing bound, a malleable
suite never runs more cases than the cores it holds; and the simulator that measures them
(loadtests/actions_simulator.py) on small traces."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.actions_simulator import Step, TraceConfig, make_trace, simulate, suite_seconds
from services.actions.elastic import (
    CHORUS,
    PAPER,
    Action,
    Elasticity,
    MalleableSuite,
    Policy,
    Units,
    estimate,
    estimate_units,
    order_queue,
    schedule,
    total_units,
)

ZERO = Elasticity("zero")


def tool(id_: str, t: float, arrival: float = 0.0) -> Action:
    return Action(id_, "tool", {"cpu": Units.fixed(1)}, key="cpu", elasticity=ZERO, t_ori=t, arrival=arrival)


def suite(id_: str, t: float, hi: int = 8, serial: float = 0.0, arrival: float = 0.0) -> Action:
    return Action(id_, "suite", {"cpu": Units(1, hi)}, key="cpu", elasticity=Elasticity("amdahl", serial=serial),
                  t_ori=t, arrival=arrival)


# --- the estimate ---------------------------------------------------------------------------------------------------
def test_the_units_estimate_waits_for_enough_freed_units_by_hand():
    # running: one action on 4 units ends at 2 s, one on 1 unit ends at 1 s; nothing free now.
    # The queue: a tool (1 unit, 3 s) then a second tool (1 unit, 3 s).
    # Freed units: the first tool starts at 1 (the 1-unit action frees one), ends at 4 -> ACT 4;
    # the second starts at 2 (4 units free), ends at 5 -> 5. Total 9.
    running = [(2.0, 4), (1.0, 1)]
    rest = [tool("a", 3.0), tool("b", 3.0)]
    assert estimate_units(running, 0, rest, depth=1) == pytest.approx(9.0)
    # the paper's estimate sees the same here (one completion per action): 1 + 3, 2 + 3
    assert estimate([2.0, 1.0], rest, 1, "cpu", 0) == pytest.approx(9.0)


def test_the_units_estimate_sees_that_a_wide_action_needs_more_than_one_completion():
    # Eight 1-unit actions end at 1, 2, ..., 8 s; a waiting suite needs 4 units at its minimum (lo 4) and takes 10 s.
    # Freed units: it starts when the fourth unit frees, at 4 s -> ACT 14. The paper's estimate starts it at the
    # first completion, 1 s -> 11: it counts one completion per action, whatever it holds.
    wide = Action("w", "suite", {"cpu": Units(4, 8)}, key="cpu", elasticity=ZERO, t_ori=10.0)
    running = [(float(t), 1) for t in range(1, 9)]
    assert estimate_units(running, 0, [wide], depth=1) == pytest.approx(14.0)
    assert estimate([float(t) for t in range(1, 9)], [wide], 1, "cpu", 0) == pytest.approx(11.0)


def test_the_units_estimate_counts_free_units_and_the_first_actions_depth_choices():
    # 2 units free now, nothing running. A suite of 8 s (linear, 1..8) then a 1 s tool.
    # d = 1: the suite on 1 unit from 0 to 8 (ACT 8), the tool on the other free unit from 0 to 1: 9.
    # d = 2: the suite on 2 units, 0 to 4 (4); the tool waits for one of them: 4 to 5 (5): 9.
    # The best of the depth choices (2 smallest counts) is 9 either way; with depth 1 only d = 1: 9.
    s = Action("s", "suite", {"cpu": Units(1, 8)}, key="cpu", elasticity=Elasticity("linear"), t_ori=8.0)
    assert estimate_units([], 2, [s, tool("t", 1.0)], depth=2) == pytest.approx(9.0)
    # with 3 free units d = 2 leaves one for the tool: 4 + 1 = 5, better than d = 1's 8 + 1 = 9
    assert estimate_units([], 3, [s, tool("t", 1.0)], depth=2) == pytest.approx(5.0)


def test_the_paper_policy_is_the_default_and_reads_floats_and_pairs_alike():
    queue = [suite("a", 8.0), suite("b", 8.0), tool("t", 1.0)]
    a = schedule(queue, {"cpu": 4}, {"cpu": [3.0, 5.0]}, depth=2)
    b = schedule(queue, {"cpu": 4}, {"cpu": [(3.0, 2), (5.0, 1)]}, depth=2, policy=PAPER)
    assert [(x.id, u) for x, u in a.start] == [(x.id, u) for x, u in b.start]


def test_policy_settings_are_checked():
    with pytest.raises(ValueError, match="queue order 'lifo'"):
        Policy(order="lifo")
    with pytest.raises(ValueError, match="ageing bound"):
        Policy(age_s=-1)


# --- the order ------------------------------------------------------------------------------------------------------
def test_sef_puts_short_actions_first_and_aged_ones_ahead_of_everything_in_arrival_order():
    # at now = 100 with an ageing bound of 30: s1 (arrived 60) and s2 (65) are aged; the rest are young.
    s1, s2 = suite("s1", 60.0, arrival=60.0), suite("s2", 50.0, arrival=65.0)
    t1, t2, s3 = tool("t1", 4.0, arrival=80.0), tool("t2", 2.0, arrival=90.0), suite("s3", 30.0, arrival=75.0)
    queue = [s1, s2, s3, t1, t2]
    policy = Policy(order="sef", age_s=30.0)
    assert [a.id for a in order_queue(queue, 100.0, policy)] == ["s1", "s2", "t2", "t1", "s3"]
    assert [a.id for a in order_queue(queue, 100.0, PAPER)] == ["s1", "s2", "s3", "t1", "t2"]
    # before anyone aged: shortest expected first (at minimum units), ties by arrival
    assert [a.id for a in order_queue(queue, 61.0, policy)] == ["t2", "t1", "s3", "s2", "s1"]


def test_a_tool_call_behind_a_suite_starts_first_under_sef_and_waits_under_fcfs():
    # one core free; a 60 s suite then a 1 s tool, both young
    queue = [suite("s", 60.0, arrival=0.0), tool("t", 1.0, arrival=0.5)]
    assert [a.id for a, _ in schedule(queue, {"cpu": 1}, {"cpu": [(10.0, 1)]}, policy=CHORUS, now=1.0).start] == ["t"]
    assert [a.id for a, _ in schedule(queue, {"cpu": 1}, {"cpu": [(10.0, 1)]}, policy=PAPER, now=1.0).start] == ["s"]
    # once the suite has waited past the bound it goes first again
    aged = Policy(freed_units=True, order="sef", age_s=0.5)
    assert [a.id for a, _ in schedule(queue, {"cpu": 1}, {"cpu": [(10.0, 1)]}, policy=aged, now=1.0).start] == ["s"]


# --- malleable suites -------------------------------------------------------------------------------------------------
def test_a_malleable_suite_grows_and_shrinks_at_case_boundaries_by_hand():
    m = MalleableSuite(cases=5, max_units=3)
    assert m.wanted() == 3 and m.grant(8) == 3 and m.start_cases() == 3  # three cases on three cores
    assert (m.pending, m.running, m.held) == (2, 3, 3)
    assert m.case_done(others_wait=True) is True  # others wait: the core goes back
    assert (m.held, m.running) == (2, 2)
    assert m.case_done(others_wait=False) is False and m.start_cases() == 1  # the next case on that core
    assert m.wanted() == 1  # 2 running + 1 pending: a third core would help again
    assert (m.pending, m.running, m.held) == (1, 2, 2)
    assert m.case_done(others_wait=False) is False and m.start_cases() == 1
    assert (m.pending, m.running, m.held) == (0, 2, 2)
    assert m.case_done(others_wait=False) is True and m.case_done(others_wait=False) is True  # nothing left
    assert m.finished and m.held == 0 and m.peak == 3
    with pytest.raises(ValueError, match="no case running"):
        m.case_done(others_wait=False)


def test_a_stopped_malleable_suite_gives_even_its_last_core_back():
    m = MalleableSuite(cases=4, max_units=2)
    m.grant(2)
    m.start_cases()
    assert m.case_done(others_wait=False, stop=True) is True
    assert m.case_done(others_wait=False, stop=True) is True
    assert (m.held, m.running, m.pending) == (0, 0, 2) and not m.finished


def test_a_malleable_suite_keeps_one_core_while_cases_are_left():
    m = MalleableSuite(cases=3, max_units=2)
    m.grant(1)
    m.start_cases()
    assert m.case_done(others_wait=True) is False  # its only core: it keeps it
    assert m.wanted() == 1  # two cases left: a second core would help


@settings(max_examples=300, deadline=None)
@given(cases=st.integers(1, 40), max_units=st.integers(1, 16),
       ops=st.lists(st.tuples(st.sampled_from(["grant", "done"]), st.integers(0, 20), st.booleans()), max_size=120))
def test_a_malleable_suite_never_runs_more_cases_than_the_cores_it_holds(cases, max_units, ops):
    m = MalleableSuite(cases, max_units)
    for op, n, wait in ops:
        if op == "grant":
            took = m.grant(n)
            assert 0 <= took <= n
        elif m.running:
            released = m.case_done(wait)
            if not released:
                assert m.start_cases() == 1
        m.start_cases()
        assert m.running <= m.held <= max_units
        assert m.pending + m.running + m.done == cases
        assert m.held == m.running or m.pending == 0  # no held core idles while a case waits
    # drive it to the end: it finishes and gives every core back
    if m.held == 0:
        m.grant(1)
        m.start_cases()
    while not m.finished:
        if not m.case_done(False):
            m.start_cases()
    assert m.held == 0


# --- properties of the extended scheduler ------------------------------------------------------------------------------
@st.composite
def mixed_queues(draw) -> list[Action]:
    n = draw(st.integers(1, 12))
    out = []
    for i in range(n):
        arrival = draw(st.floats(0.0, 100.0))
        if draw(st.booleans()):
            out.append(tool(f"a{i}", draw(st.floats(0.01, 20.0)), arrival))
        else:
            out.append(suite(f"a{i}", draw(st.floats(0.1, 200.0)), hi=draw(st.integers(1, 16)),
                             serial=draw(st.floats(0.0, 0.5)), arrival=arrival))
    return sorted(out, key=lambda a: a.arrival)


@settings(max_examples=300, deadline=None)
@given(queue=mixed_queues(), cores=st.integers(1, 32), depth=st.integers(1, 3), age=st.floats(0.0, 60.0),
       units=st.booleans(), running=st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 8)), max_size=5))
def test_the_extended_scheduler_never_over_allocates_and_nothing_passes_an_aged_action(
        queue, cores, depth, age, units, running):
    now = 100.0
    policy = Policy(freed_units=units, order="sef", age_s=age)
    d = schedule(queue, {"cpu": cores}, {"cpu": running}, depth=depth, policy=policy, now=now)
    assert total_units(d).get("cpu", 0) <= cores
    for a, u in d.start:
        assert u["cpu"] in a.cost["cpu"].values(cores)
    started = {a.id for a, _ in d.start}
    aged_waiting = [a for a in queue if now - a.arrival >= age and a.id not in started]
    if aged_waiting:
        first = min(a.arrival for a in aged_waiting)
        # nobody who arrived after an aged action still waiting started ahead of it
        assert all(a.arrival <= first for a, _ in d.start), (first, [(a.id, a.arrival) for a, _ in d.start])


# --- the simulator ------------------------------------------------------------------------------------------------------
def test_a_suites_seconds_are_its_serial_part_and_its_waves_of_cases():
    s = Step(0.0, "reward", t_ori=100.0, serial=0.1, cases=10)
    assert suite_seconds(s, 1) == pytest.approx(100.0)
    assert suite_seconds(s, 10) == pytest.approx(10.0 + 9.0)  # one wave: Amdahl's figure exactly
    assert suite_seconds(s, 4) == pytest.approx(10.0 + 3 * 9.0)  # three waves; Amdahl says 10 + 22.5
    assert suite_seconds(s, 4) >= 100.0 * (0.1 + 0.9 / 4)


SMALL = TraceConfig(nodes=1, cores_per_node=16, steps=1, tools_min=1, tools_max=3, gen_median_s=2.0,
                    reward_median_s=20.0, cases_min=4, cases_max=12, burst_jitter_s=0.5)


@pytest.mark.parametrize("policy", ["static-1", "static-4", "fixed-4", "fixed-16", "elastic", "elastic+units",
                                    "elastic+sef", "elastic+malleable", "chorus"])
def test_every_policy_runs_every_action_once_and_no_action_beats_its_own_work(policy):
    trace = make_trace(SMALL, 24, seed=3)
    r = simulate(SMALL, policy, trace)
    steps = [s for traj in trace[0] for s in traj]
    assert len(r.acts) == len(steps) and r.kinds.count("reward") == 24
    assert all(q >= -1e-9 for q in r.queue)
    # no action ends before the work it has on the most cores it may take (tools: one; suites: 32, cases)
    tool_floor = sum(s.t_ori for s in steps if s.kind == "tool")
    assert sum(a for a, k in zip(r.acts, r.kinds, strict=True) if k == "tool") >= tool_floor - 1e-6
    reward_floor = sum(suite_seconds(s, s.cases) for s in steps if s.kind == "reward")
    assert sum(a for a, k in zip(r.acts, r.kinds, strict=True) if k == "reward") >= reward_floor - 1e-6
    assert r.mean_act == pytest.approx(sum(r.acts) / 24)
    if policy in ("elastic+malleable", "chorus"):
        assert len(r.peak_dop) == 24 and all(1 <= p <= SMALL.max_dop for p in r.peak_dop)


def test_static_1_runs_tests_on_one_process_and_an_exec_cost_lands_on_every_action():
    trace = make_trace(SMALL, 1, seed=1)
    steps = trace[0][0]
    alone = simulate(SMALL, "static-1", trace)
    # one trajectory alone on 16 cores: every action runs at once at full speed, the suite on one process
    assert alone.acts == pytest.approx([s.t_ori for s in steps])
    costly = TraceConfig(**{**SMALL.__dict__, "exec_s": 0.5, "pod_start_s": 3.0})
    with_cost = simulate(costly, "static-1", trace)
    assert with_cost.acts[0] == pytest.approx(steps[0].t_ori + 3.5)
    assert with_cost.acts[1:] == pytest.approx([s.t_ori + 0.5 for s in steps[1:]])
    fixed = simulate(costly, "fixed-4", trace)
    assert fixed.acts[-1] == pytest.approx(0.5 + suite_seconds(steps[-1], min(4, steps[-1].cases)))


def test_a_lone_malleable_suite_takes_one_core_per_case_up_to_the_cap():
    cfg = TraceConfig(**{**SMALL.__dict__, "cores_per_node": 64})
    trace = [[[Step(1.0, "reward", t_ori=64.0, serial=0.0, cases=40)]]]
    r = simulate(cfg, "elastic+malleable", trace)
    # the scheduler gives it 32 (its cap); 40 cases on 32 cores: two waves of 1.6 s
    assert r.peak_dop == [32]
    assert r.acts[0] == pytest.approx(2 * 64.0 / 40)
    rigid = simulate(cfg, "elastic", trace)
    assert rigid.acts[0] == pytest.approx(math.ceil(40 / 32) * 64.0 / 40)
