"""Admission of new tasks: the on-policy batch gate (sync / microbatch) and async saturation, without a broker."""

from __future__ import annotations

from services.coordinator.admission import Admission, BatchGate, expected_samples


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
