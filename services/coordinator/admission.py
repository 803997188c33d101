"""When the coordinator may start a new task: mq backpressure per model, the run's version budget, and in
the on-policy modes (sync, microbatch) one global batch of samples per version."""

from __future__ import annotations

from collections.abc import Collection, Mapping
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

    def active(self) -> list[str]:
        """Models still training (below ``max_versions``)."""
        return [m for m in self.models if self.trained.get(m, 0) < self.max_versions]

    def saturated(self, now: float) -> bool:
        """Every model still training is at capacity: no new sample could be used, so no task starts.

        A model alone at capacity does not stop the others: in async mode its mq sheds its oldest samples
        (counted), so a slow trainer never holds back a fast one and memory stays bounded.
        """
        active = self.active()
        return bool(active) and set(active) <= set(self.blocked_by(now))

    @property
    def budget_spent(self) -> bool:
        """Every model has trained ``max_versions`` versions: no new tasks are needed."""
        return all(self.trained.get(m, 0) >= self.max_versions for m in self.models)


@dataclass
class BatchGate:
    """Admission of the on-policy modes: the tasks of one global batch per model run at one weight version.

    A batch opens at the versions the rollouters serve. Tasks start while some model still lacks
    ``global_batch`` samples in it (a running task counts with its expected samples, a finished one with
    its real ones). Then the batch is closed: the next one opens once its tasks are done and every model
    serves a newer version, so each sample is trained by the weights that generated it (staleness 0).
    """

    models: list[str]
    global_batch: int
    expected: dict[str, float]  # samples one task gives each model; replaced by what tasks really give
    base: dict[str, int] | None = None  # served versions when the open batch opened; None before the first
    reserved: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    batches: int = 0  # batches opened

    def needs(self, model: str, done: Collection[str]) -> bool:
        return model not in done and self.reserved.get(model, 0.0) < self.global_batch

    def may_start(self, served: Mapping[str, int], done: Collection[str] = ()) -> bool:
        """Whether a task may start now; ``done``: models that need no more samples (budget spent)."""
        if self.base is not None and any(self.needs(m, done) for m in self.models):
            return True
        if self.in_flight:
            return False
        if self.base is not None and any(served.get(m, 0) <= self.base[m] for m in self.models if m not in done):
            return False  # the batch is full: wait for the step and the new weights
        if all(m in done for m in self.models):
            return False
        self.base = {m: served.get(m, 0) for m in self.models}
        self.reserved = {m: 0.0 for m in self.models}
        self.batches += 1
        return True

    def started(self) -> None:
        for m in self.models:
            self.reserved[m] = self.reserved.get(m, 0.0) + self.expected[m]
        self.in_flight += 1

    def finished(self, samples: Mapping[str, int] | None) -> None:
        """A task of the open batch ended with ``samples`` per model (None: abandoned, gave nothing)."""
        got = samples or {}
        for m in self.models:
            self.reserved[m] = self.reserved.get(m, 0.0) - self.expected[m] + got.get(m, 0)
            if got.get(m, 0) > 0:  # a task that lost its groups says nothing about the next one
                self.expected[m] = float(got[m])
        self.in_flight -= 1


def expected_samples(agent_models: Mapping[str, str], group_size: int, models: list[str]) -> dict[str, float]:
    """First guess of the samples one task gives each model: one turn per agent, ``group_size`` rollouts."""
    out = dict.fromkeys(models, 0.0)
    for model in agent_models.values():
        if model in out:
            out[model] += group_size
    return out
