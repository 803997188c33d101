"""The coordinator's bookkeeping of workflow failures: one entry per distinct error, a doubling backoff, a limit."""

from __future__ import annotations

from services.coordinator.failures import FailureLog, error_key
from services.coordinator.workflows import WorkflowError


def raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the exception is what is under test
        return exc
    raise AssertionError("did not raise")


def lookup(key: str) -> None:
    {}[key]


def wrapped(key: str) -> None:
    try:
        lookup(key)
    except KeyError as exc:
        raise WorkflowError(f"workflow w failed: {exc!r}") from exc


def test_one_error_with_different_messages_is_one_entry_logged_once():
    log = FailureLog(max_failures=3, backoff_s=0.5, backoff_max_s=4.0)
    firsts = [log.note(raised(wrapped, f"task-{i}")) for i in range(3)]
    assert firsts == [True, False, False]
    (key,) = log.counts
    assert key.startswith("KeyError at ") and key.endswith(f":{lookup.__code__.co_firstlineno + 1}")
    assert log.counts[key] == 3 and log.exhausted
    assert "task-0" in log.worst() and "3 of 3 failures" in log.worst()


def test_errors_raised_at_different_places_are_distinct():
    a, b = raised(lookup, "x"), raised(int, "nan?")
    assert error_key(a) != error_key(b)
    log = FailureLog(max_failures=10, backoff_s=0.5, backoff_max_s=4.0)
    assert log.note(a) and log.note(b) and not log.note(raised(lookup, "y"))
    assert log.total == 3 and not log.exhausted
    assert list(log.summary()) == [error_key(a), error_key(b)]  # most frequent first


def test_backoff_doubles_per_consecutive_failure_up_to_its_cap():
    log = FailureLog(max_failures=10, backoff_s=0.5, backoff_max_s=4.0)
    assert [log.backoff(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
