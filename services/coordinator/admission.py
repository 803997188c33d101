"""When the coordinator may start a new task: mq backpressure per model and the run's version budget."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Admission:
    """Latest mq depth reports and trainer versions of the models a workflow uses (no I/O)."""

    models: list[str]
    max_versions: int
    stale_after_s: float  # a report older than this is ignored, so a dead mq does not freeze the run
    depth: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # model -> (depth, capacity, at)
    trained: dict[str, int] = field(default_factory=dict)

    def on_depth(self, model: str, depth: int, capacity: int, now: float) -> None:
        if model in self.models:
            self.depth[model] = (depth, capacity, now)

    def on_trained(self, model: str, version: int) -> None:
        if model in self.models:
            self.trained[model] = max(version, self.trained.get(model, 0))

    def blocked_by(self, now: float) -> list[str]:
        """Models whose latest fresh report says the backlog is at or over capacity."""
        return [
            m for m, (depth, capacity, at) in sorted(self.depth.items())
            if depth >= capacity and now - at <= self.stale_after_s
        ]

    @property
    def budget_spent(self) -> bool:
        """Every model has trained ``max_versions`` versions: no new tasks are needed."""
        return all(self.trained.get(m, 0) >= self.max_versions for m in self.models)
