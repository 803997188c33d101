"""Admission of new tasks: the on-policy batch gate (sync / microbatch), async saturation and async pacing
(AReaL's staleness capacity), without a broker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.coordinator.admission import Admission, BatchGate, Pacer, expected_samples


def test_first_guess_counts_group_size_samples_per_agent_of_each_model():
    got = expected_samples({"solver": "a", "verifier": "a", "judge": "c"}, 4, ["a", "b"])
    assert got == {"a": 8.0, "b": 0.0}


def test_one_batch_per_version_and_the_next_waits_for_new_weights():
    # Two models, 4 samples of each per task, global batch 8: two tasks per batch.
    gate = BatchGate(["a", "b"], global_batch=8, expected={"a": 4.0, "b": 4.0})
    served = {"a": 0, "b": 0}
    started = 0
    while gate.may_start(served):
        gate.started()
        started += 1
    assert started == 2 and gate.batches == 1
    gate.finished({"a": 4, "b": 4})
    assert not gate.may_start(served)  # one task still running
    gate.finished({"a": 4, "b": 4})
    assert not gate.may_start(served)  # full batch: waits for the step
    served["a"] = 1
    assert not gate.may_start(served)  # model b has not served its new weights yet
    served["b"] = 1
    assert gate.may_start(served) and gate.batches == 2 and gate.base == {"a": 1, "b": 1}


def test_a_task_that_gave_fewer_samples_reopens_the_batch_for_more():
    gate = BatchGate(["a"], global_batch=8, expected={"a": 4.0})
    served = {"a": 0}
    for _ in range(2):
        assert gate.may_start(served)
        gate.started()
    assert not gate.may_start(served)
    gate.finished(None)  # abandoned: its 4 expected samples never come
    assert gate.may_start(served)  # the batch still lacks 4 samples: another task starts at version 0
    gate.started()
    gate.finished({"a": 4})
    gate.finished({"a": 4})
    assert not gate.may_start(served)
    assert gate.batches == 1


def test_real_counts_replace_the_first_guess():
    gate = BatchGate(["a"], global_batch=12, expected={"a": 2.0})
    served = {"a": 0}
    assert gate.may_start(served)
    gate.started()
    gate.finished({"a": 6})  # the workflow gives 6 per task (say 3 turns), not the guessed 2
    assert gate.expected == {"a": 6.0}
    assert gate.may_start(served)
    gate.started()
    assert not gate.may_start(served)  # 6 done + 6 expected = 12


def test_a_model_that_spent_its_budget_no_longer_holds_the_batch():
    gate = BatchGate(["a", "b"], global_batch=4, expected={"a": 4.0, "b": 4.0})
    served = {"a": 0, "b": 0}
    assert gate.may_start(served)
    gate.started()
    gate.finished({"a": 4, "b": 4})
    served["a"] = 1  # b is done (max_versions) and will never serve a newer version
    assert not gate.may_start(served)
    assert gate.may_start(served, done={"b"})
    gate.started()
    gate.finished({"a": 4, "b": 0})
    assert not gate.may_start({"a": 5, "b": 0}, done={"a", "b"})  # nothing left to train


def test_async_stops_only_when_every_training_model_is_at_capacity():
    adm = Admission(models=["fast", "slow"], max_versions=10, stale_after_s=5.0)
    adm.on_depth("slow", depth=50, capacity=16, now=0.0)
    adm.on_depth("fast", depth=3, capacity=16, now=0.0)
    assert adm.blocked_by(now=1.0) == ["slow"]
    assert not adm.saturated(now=1.0)  # the slow model alone at capacity does not hold back the fast one
    adm.on_depth("fast", depth=16, capacity=16, now=1.0)
    assert adm.saturated(now=1.5)
    adm.on_trained("fast", 10)  # fast is done: only slow still trains, and it is full
    adm.on_depth("fast", depth=0, capacity=16, now=2.0)
    assert adm.saturated(now=2.0)


def test_a_single_model_at_capacity_pauses_admission():
    adm = Admission(models=["m"], max_versions=10, stale_after_s=5.0)
    adm.on_depth("m", depth=16, capacity=16, now=0.0)
    assert adm.saturated(now=0.5)
    assert not adm.saturated(now=6.0)  # its report went stale


# --- async pacing: capacity = (s + v + 1) * B - (trained * B + pending + running) ------------------------------
def pacer(models=("m",), batch=8, staleness=1, per_task=4.0, stale_after_s=5.0) -> Pacer:
    return Pacer(list(models), global_batch=batch, max_staleness=staleness,
                 expected=dict.fromkeys(models, per_task), stale_after_s=stale_after_s)


def start_while_admitted(p: Pacer, served: dict[str, int], now: float = 0.0, most: int = 100) -> int:
    started = 0
    while started < most and p.may_start(served, now=now):
        p.started()
        started += 1
    return started


def test_capacity_shrinks_with_the_tasks_in_flight():
    p = pacer(batch=8, staleness=1, per_task=4.0)
    p.on_report("m", depth=0, trained=0, now=0.0)
    served = {"m": 0}
    assert p.capacity("m", served) == 16  # (1 + 0 + 1) * 8
    p.started()
    assert p.capacity("m", served) == 12
    assert start_while_admitted(p, served) == 3  # 4 tasks of 4 samples fill (s + 1) * B = 16
    assert p.capacity("m", served) == 0
    assert p.held_by == ["m"]


def test_an_ended_task_counts_until_a_depth_report_includes_its_samples():
    p = pacer(batch=8, staleness=1, per_task=4.0)
    p.on_report("m", depth=0, trained=0, now=0.0)
    served = {"m": 0}
    p.started()
    p.finished({"m": 4})  # published: not running any more, not yet in mq's depth either
    assert p.running("m") == 4 and p.capacity("m", served) == 12
    p.on_report("m", depth=0, trained=0, now=0.5)  # may have been made before mq took the samples in
    assert p.capacity("m", served) == 12
    p.on_report("m", depth=4, trained=0, now=1.0)  # the second report after: the samples are pending now
    assert p.running("m") == 0 and p.capacity("m", served) == 12


def test_capacity_grows_with_trained_and_served_versions():
    p = pacer(batch=8, staleness=1, per_task=4.0)
    p.on_report("m", depth=16, trained=0, now=0.0)  # two batches waiting: no room at version 0
    assert not p.may_start({"m": 0}) and p.capacity("m", {"m": 0}) == 0
    p.on_report("m", depth=8, trained=1, now=1.0)  # the trainer stepped on one batch ...
    assert p.capacity("m", {"m": 0}) == 0  # ... but a sample made by version 0 now would be trained too late
    assert p.may_start({"m": 1})  # the rollouters serve version 1: one batch of room
    assert p.capacity("m", {"m": 1}) == 8
    p.on_report("m", depth=0, trained=2, now=2.0)
    assert p.capacity("m", {"m": 2}) == 16


def test_rollouters_lagging_behind_the_trainer_shrink_capacity():
    p = pacer(batch=8, staleness=2, per_task=4.0)
    p.on_report("m", depth=0, trained=5, now=0.0)
    assert p.capacity("m", {"m": 5}) == 24
    assert p.capacity("m", {"m": 4}) == 16  # a sample made by version 4 is already one version stale


def test_dropped_samples_free_capacity_instead_of_shrinking_it_for_good():
    # AReaL's literal "accepted" total would count these drops for ever and, dropping a quarter of every
    # batch, end with no capacity at all. Pending samples only: drops leave mq's depth and free their room.
    p = pacer(batch=8, staleness=1, per_task=4.0)
    for v in range(100):
        p.on_report("m", depth=8, trained=v, now=float(v))
        assert p.capacity("m", {"m": v}) == 8
        p.on_report("m", depth=16, trained=v, now=v + 0.3)  # a batch and a half arrived...
        p.on_report("m", depth=12, trained=v, now=v + 0.6)  # ...and 4 were dropped as stale
        assert p.capacity("m", {"m": v}) == 4
    assert p.may_start({"m": 99}, now=99.6)


def test_a_task_is_always_admitted_with_nothing_running_or_pending():
    p = pacer(batch=8, staleness=0, per_task=40.0)  # one task gives more than (s + 1) * B samples
    p.on_report("m", depth=0, trained=3, now=0.0)
    assert p.capacity("m", {"m": 3}) < 40
    assert p.may_start({"m": 3})
    p.started()
    assert not p.may_start({"m": 3})  # its 40 samples are enough for the next steps
    p.finished(None)  # abandoned: gave nothing
    assert p.may_start({"m": 0})  # nothing on the way, even with the rollouters far behind


def test_a_trainer_short_of_a_batch_gets_a_task_even_past_capacity():
    # B = 12 is no multiple of a task's 8 samples: with 8 pending the trainer waits for 4 more, which only a
    # new task can give, although (0 + 1) * 12 - 8 = 4 < 8. Holding it back would stop the run.
    p = pacer(batch=12, staleness=0, per_task=8.0)
    p.on_report("m", depth=8, trained=0, now=0.0)
    assert p.capacity("m", {"m": 0}) == 4
    assert p.may_start({"m": 0})
    p.started()
    assert not p.may_start({"m": 0})


def test_every_model_a_task_feeds_needs_room_for_its_samples():
    p = pacer(models=("a", "b"), batch=8, staleness=1, per_task=4.0)
    p.on_report("a", depth=0, trained=0, now=0.0)
    p.on_report("b", depth=14, trained=0, now=0.0)
    served = {"a": 0, "b": 0}
    assert p.capacity("a", served) == 16 and p.capacity("b", served) == 2
    assert not p.may_start(served) and p.held_by == ["b"]
    p.on_report("b", depth=12, trained=0, now=0.5)
    assert p.may_start(served) and p.held_by == []
    p.started()  # counted in both models: b has no room left for another
    assert not p.may_start(served) and p.held_by == ["b"]


def test_a_model_the_tasks_do_not_feed_does_not_pace():
    p = Pacer(["a", "b"], global_batch=8, max_staleness=1, expected={"a": 4.0, "b": 0.0}, stale_after_s=5.0)
    p.on_report("b", depth=100, trained=0, now=0.0)
    assert p.may_start({"a": 0, "b": 0})


def test_a_model_that_spent_its_budget_no_longer_paces():
    p = pacer(models=("a", "b"), batch=8, staleness=1, per_task=4.0)
    p.on_report("a", depth=0, trained=3, now=0.0)
    p.on_report("b", depth=30, trained=10, now=0.0)  # b trained max_versions; mq drops what it still gets
    served = {"a": 3, "b": 10}
    assert not p.may_start(served)
    assert p.may_start(served, done={"b"})


def test_real_sample_counts_replace_the_first_guess():
    p = pacer(batch=8, staleness=1, per_task=4.0)
    p.on_report("m", depth=0, trained=0, now=0.0)
    p.started()
    p.finished({"m": 6})  # the workflow gives 6 per task, not the guessed 4
    assert p.expected == {"m": 6.0}
    p.started()
    assert p.running("m") == 12
    p.finished({"m": 0})  # lost its groups: says nothing about the next task
    assert p.expected == {"m": 6.0}


def test_before_its_first_report_a_model_counts_only_the_tasks_in_flight():
    p = pacer(batch=8, staleness=1, per_task=4.0)
    for _ in range(10):
        p.started()
        p.finished({"m": 4})
    assert p.running("m") == 0 and p.capacity("m", {"m": 2}) == 16


def stepping(p: Pacer, model: str, versions: int, depth: int, t0: float = 0.0) -> float:
    """``model``'s trainer makes a version a second with ``depth`` samples pending; returns the time after."""
    for v in range(versions):
        p.on_report(model, depth=depth, trained=v, now=t0 + v)
    return t0 + versions - 1


def test_a_stopped_trainer_stops_pacing_while_another_model_trains():
    p = pacer(models=("fast", "stopped"), batch=8, staleness=1, per_task=4.0, stale_after_s=5.0)
    stepping(p, "fast", 10, depth=0)
    t = stepping(p, "stopped", 10, depth=16)  # a version a second, then frozen with two batches waiting
    served = {"fast": 9, "stopped": 9}
    for dt in (0.5, 3.0, 4.9):  # fresh reports, no new version yet: a slow step, not a stopped trainer
        p.on_report("fast", depth=0, trained=9, now=t + dt)
        p.on_report("stopped", depth=16, trained=9, now=t + dt)
        assert not p.may_start(served, now=t + dt) and p.held_by == ["stopped"]
    p.on_report("stopped", depth=16, trained=9, now=t + 5.5)
    assert p.stuck("stopped", now=t + 5.5)  # no version for 5.5 s > max(stale_after_s, 4 x 1 s)
    assert p.may_start(served, now=t + 5.5)  # the fast model is not held back; the stopped one's mq sheds
    assert p.snapshot(served, now=t + 5.5)["stuck"] == ["stopped"]
    p.on_report("stopped", depth=8, trained=10, now=t + 6.0)  # it trains again: it paces again
    assert not p.stuck("stopped", now=t + 6.0)


def test_a_slow_trainer_is_not_taken_for_a_stopped_one():
    p = pacer(models=("fast", "slow"), batch=8, staleness=1, per_task=4.0, stale_after_s=5.0)
    stepping(p, "fast", 10, depth=0)
    for v in range(10):  # a version every 10 s
        p.on_report("slow", depth=16, trained=v, now=10.0 * v)
    t = 90.0
    p.on_report("fast", depth=0, trained=9, now=t + 30.0)
    p.on_report("slow", depth=16, trained=9, now=t + 30.0)
    assert not p.stuck("slow", now=t + 30.0)  # 30 s < 4 x 10 s
    assert not p.may_start({"fast": 9, "slow": 9}, now=t + 30.0)


def test_a_model_whose_mq_stopped_reporting_stops_pacing_but_every_model_stuck_still_paces():
    p = pacer(models=("a", "b"), batch=8, staleness=1, per_task=4.0, stale_after_s=5.0)
    p.on_report("a", depth=0, trained=0, now=0.0)
    p.on_report("b", depth=16, trained=0, now=0.0)
    served = {"a": 0, "b": 0}
    p.on_report("a", depth=0, trained=0, now=6.0)
    assert p.may_start(served, now=6.0)  # b's mq has not reported for 6 s
    p.started()
    single = pacer(models=("m",), batch=8, staleness=1, per_task=4.0, stale_after_s=5.0)
    single.on_report("m", depth=16, trained=0, now=0.0)
    assert single.stuck("m", now=6.0)
    assert not single.may_start({"m": 0}, now=6.0)  # nobody else to feed: generating now would only be dropped


def test_tasks_of_varying_size_give_back_what_they_reserved_when_the_estimate_moved():
    # MARFT's episodes end early: tasks give 11 to 20 samples. Two tasks start on the estimate 16; the first ends
    # with 20 (the estimate becomes 20), the second with 11: the batch holds 31 of 32, so one more task starts.
    gate = BatchGate(["a"], global_batch=32, expected={"a": 16.0})
    served = {"a": 0}
    tickets = []
    while gate.may_start(served):
        tickets.append(gate.started())
    assert len(tickets) == 2
    gate.finished({"a": 20}, tickets[0])
    gate.finished({"a": 11}, tickets[1])
    assert gate.reserved["a"] == 31
    assert gate.may_start(served)


def test_a_running_task_counts_with_the_most_a_task_has_given_so_the_batch_is_not_overshot():
    # MARFT-like episodes that end early: a task gives 8 or 16 samples; the batch wants 16
    gate = BatchGate(["a"], global_batch=16, expected={"a": 8.0})
    served = {"a": 0}
    assert gate.may_start(served)
    gate.started()
    gate.finished({"a": 16})  # a full-length episode: 16 samples
    assert gate.expected == {"a": 16.0} and not gate.may_start(served)  # 16 done: the batch is full
    assert gate.complete()
    served["a"] = 1
    assert gate.may_start(served) and gate.batches == 2
    first = gate.started()
    assert first == {"a": 16.0} and not gate.may_start(served)  # one running task may give all 16: no second
    gate.finished({"a": 8}, first)  # it ended early
    assert gate.expected == {"a": 16.0}  # a short episode does not lower what a task can give
    assert not gate.complete() and gate.may_start(served)  # 8 short: one more task
    second = gate.started()
    assert not gate.may_start(served)
    gate.finished({"a": 8}, second)
    assert gate.reserved == {"a": 16.0} and gate.complete()


def test_the_batch_is_not_complete_while_a_task_runs_or_a_model_lacks_samples():
    gate = BatchGate(["a", "b"], global_batch=4, expected={"a": 4.0, "b": 4.0})
    assert not gate.complete()  # no batch yet
    assert gate.may_start({"a": 0, "b": 0})
    ticket = gate.started()
    assert not gate.complete()
    gate.finished({"a": 4, "b": 2}, ticket)
    assert not gate.complete() and gate.complete(done={"b"})


def _held_by_as_defined(p: Pacer, served: dict, done: set, now: float) -> list[str]:
    """The class docstring's rule, computed the long way: every model's capacity and whether it is stuck."""
    pacing = [m for m in p.models if m not in done and p.expected[m] > 0]
    live = [m for m in pacing if not p.stuck(m, now)]
    return [m for m in (live or pacing)
            if not (p.capacity(m, served) >= p.expected[m]
                    or p.book[m].depth + p.running(m) < p.global_batch)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6), st.floats(0, 30), st.integers(0, 9),
                          st.integers(0, 6), st.booleans()), min_size=1, max_size=6),
       st.integers(0, 5), st.integers(0, 3), st.floats(0, 40))
def test_may_start_holds_back_exactly_the_models_the_rule_names(books, in_flight, staleness, now):
    models = [f"m{i}" for i in range(len(books))]
    p = Pacer(models, global_batch=8, max_staleness=staleness,
              expected={m: float(b[4]) for m, b in zip(models, books, strict=True)}, stale_after_s=10.0)
    p.in_flight = in_flight
    served, done = {}, set()
    for m, (depth, trained, at, ahead, _, spent) in zip(models, books, strict=True):
        p.on_report(m, depth, trained, at)
        served[m] = trained + ahead % 3
        if ahead == 9:
            p.finished({m: 5})
            p.in_flight += 1
        if spent and ahead > 6:
            done.add(m)
    want = _held_by_as_defined(p, served, done, now)
    assert p.may_start(served, done, now) == (not want)
    assert p.held_by == want


def test_saturated_and_done_read_the_reports_as_blocked_by_does():
    a = Admission(["a", "b", "c"], max_versions=5, stale_after_s=5.0)
    assert not a.saturated(0.0) and a.done() == set()
    a.on_depth("a", 10, 10, 0.0)
    a.on_depth("b", 10, 10, 0.0)
    assert not a.saturated(1.0)  # c has no report: not blocked
    a.on_depth("c", 3, 10, 0.0)
    a.on_trained("c", 5)
    assert a.done() == {"c"} and a.saturated(1.0) and a.blocked_by(1.0) == ["a", "b"]
    assert not a.saturated(6.0)  # the reports went stale
