"""Generated tokens of a run's training tasks, against the versions trained: the budget that compares arms of an
experiment (a team against a single agent: the same tokens, not the same steps).

The coordinator adds each finished training task's response tokens (every row generated for it: every agent's
every turn of its G rollouts, tree candidates, judge calls; held-out evaluation excluded) and, whenever a model's
trained version moves, appends one line to ``metrics.jsonl``::

    {"kind": "generated", "tokens_generated": 61230, "tasks": 412, "versions": {"smol": 38}, "time": ...}

so ``tokens_generated`` is what had been generated when those versions were first seen trained. A coordinator
that restarts continues from the last such line; tokens of the tasks it was playing when it stopped are lost
with them (they were never recorded). ``shared.results.plotting`` reads the lines back.
"""

from __future__ import annotations

import time
from typing import Any

from shared.results.plotting import GENERATED as KIND


class GeneratedTokens:
    """The running count, and the line to write when the trained versions differ from the last line's."""

    def __init__(self, tokens: int = 0, tasks: int = 0) -> None:
        self.tokens = tokens
        self.tasks = tasks
        self._versions: dict[str, int] = {}

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.tasks += 1

    def on_trained(self, trained: dict[str, int]) -> dict[str, Any] | None:
        """The record to append when some model's trained version moved since the last one (None otherwise)."""
        versions = {m: int(v) for m, v in sorted(trained.items())}
        if versions == self._versions or not any(versions.values()):
            return None
        self._versions = versions
        return {"kind": KIND, "tokens_generated": self.tokens, "tasks": self.tasks, "versions": versions,
                "time": time.time()}
