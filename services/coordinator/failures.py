"""Failures of the user's workflow code: counted by distinct error, each logged once, retried with backoff,
and fatal to the run past ``workflow.max_failures``.

A distinct error is an exception type raised at one place in the code (file and line of the innermost frame),
so an error whose message carries a task id or a number is still one error, however often it happens.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field

MESSAGE_CHARS = 300  # of an error's text kept in its summary


def root_cause(exc: BaseException) -> BaseException:
    """The user's own exception behind a wrapper raised ``from`` it (a WorkflowError around a KeyError)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def error_key(exc: BaseException) -> str:
    """``Type at file:line``: the same mistake, whatever its message."""
    cause = root_cause(exc)
    frames = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ is not None else []
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(cause).__name__}{where}"


@dataclass
class FailureLog:
    """Counts of workflow failures by distinct error, the first message of each, and the backoff to wait."""

    max_failures: int
    backoff_s: float
    backoff_max_s: float
    counts: Counter[str] = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)  # key -> the first message seen with it

    def note(self, exc: BaseException) -> bool:
        """Count a failure; True when it is the first of its kind (log it then, and only then)."""
        key = error_key(exc)
        self.counts[key] += 1
        if key in self.first:
            return False
        self.first[key] = f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS]
        return True

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def exhausted(self) -> bool:
        return self.total >= self.max_failures

    def backoff(self, consecutive: int) -> float:
        """Seconds to wait after ``consecutive`` failures in a row of one task loop: doubling, capped."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, consecutive - 1))

    def summary(self, limit: int = 10) -> dict[str, dict[str, object]]:
        """The most frequent errors: key -> {count, first message}."""
        return {k: {"count": n, "first": self.first[k]} for k, n in self.counts.most_common(limit)}

    def worst(self) -> str:
        """The most frequent error's first message, with its count (what a failed run reports)."""
        if not self.counts:
            return ""
        key, n = self.counts.most_common(1)[0]
        return f"{self.first[key]} ({n} of {self.total} failures, {key})"
