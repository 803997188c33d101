"""When the coordinator may start a new task: mq backpressure per model, the run's version budget, in the
on-policy modes (sync, microbatch) one global batch of samples per version, and in async mode AReaL's
staleness capacity per model (:class:`Pacer`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field


@dataclass
class Admission:
    """Latest mq depth reports and trainer versions of the models a workflow uses (no I/O)."""

    models: list[str]
    max_versions: int
    stale_after_s: float  # a report older than this is ignored, so a dead mq does not freeze the run
    # model -> (depth, capacity, at, the trainer's version when the report was taken)
    depth: dict[str, tuple[int, int, float, int]] = field(default_factory=dict)
    trained: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # the version the model's rollouters serve

    def on_depth(self, model: str, depth: int, capacity: int, now: float, trained_version: int = 0) -> None:
        if model in self.models:
            self.depth[model] = (depth, capacity, now, trained_version)

    def on_served(self, model: str, version: int) -> None:
        """The model's rollouters serve ``version``: its trainer has stepped on the samples of every report taken
        at an older trainer version, so those reports no longer hold admission back (in the on-policy modes the
        last report before a step counts the whole batch, and the next one could be ``mq.report_interval_s``
        away: every batch would wait for it)."""
        if model in self.models:
            self.served[model] = max(version, self.served.get(model, 0))

    def on_trained(self, model: str, version: int) -> None:
        if model in self.models:
            self.trained[model] = max(version, self.trained.get(model, 0))

    def blocked_by(self, now: float) -> list[str]:
        """Models whose latest fresh report says the backlog is at or over capacity (a report is not fresh when it
        is older than ``stale_after_s``, or taken before the trainer made the version now served)."""
        return [m for m in sorted(self.depth) if self._blocked(m, now)]

    def _blocked(self, model: str, now: float) -> bool:
        report = self.depth.get(model)
        if report is None:
            return False
        depth, capacity, at, trained = report
        return depth >= capacity and now - at <= self.stale_after_s and trained >= self.served.get(model, 0)

    def saturated(self, now: float) -> bool:
        """Every model still training is at capacity: no new sample could be used, so no task starts.

        A model alone at capacity does not stop the others: in async mode its mq sheds its oldest samples
        (counted), so a slow trainer never holds back a fast one and memory stays bounded.
        """
        any_active = False
        for m in self.models:  # the first active model not blocked answers (this runs at every admission check)
            if self.trained.get(m, 0) >= self.max_versions:
                continue
            if not self._blocked(m, now):
                return False
            any_active = True
        return any_active

    def done(self) -> set[str]:
        """Models that reached ``max_versions``: they need no more samples."""
        return {m for m, v in self.trained.items() if v >= self.max_versions}

    @property
    def budget_spent(self) -> bool:
        """Every model has trained ``max_versions`` versions: no new tasks are needed."""
        return all(self.trained.get(m, 0) >= self.max_versions for m in self.models)


@dataclass
class BatchGate:
    """Admission of the on-policy modes: the tasks of one global batch per model run at one weight version.

    A batch opens at the versions the rollouters serve. Tasks start while some model still lacks
    ``global_batch`` samples in it: a finished task counts with its real samples, a running one with the most
    samples a task can still give (the most any task has given, at first the one-turn-per-agent guess), so that
    a workflow whose tasks give varying numbers (episodes that end early) does not start tasks whose samples
    overshoot the batch and arrive too stale for the next one. Then the batch is closed: the next one opens once
    its tasks are done and every model serves a newer version, so each sample is trained by the weights that
    generated it (staleness 0).
    """

    models: list[str]
    global_batch: int
    expected: dict[str, float]  # the most samples one task has given each model (first: a guess); a running task's
    base: dict[str, int] | None = None  # served versions when the open batch opened; None before the first
    reserved: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    batches: int = 0  # batches opened
    seen: dict[str, float] = field(default_factory=dict)  # the most samples one finished task gave each model

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

    def started(self) -> dict[str, float]:
        """Count a task in the open batch with its expected samples; returns them (what :meth:`finished` takes back:
        the estimate may change while the task runs, when tasks give varying numbers of samples)."""
        ticket = {m: self.expected[m] for m in self.models}
        for m in self.models:
            self.reserved[m] = self.reserved.get(m, 0.0) + ticket[m]
        self.in_flight += 1
        return ticket

    def finished(self, samples: Mapping[str, int] | None, ticket: Mapping[str, float] | None = None) -> None:
        """A task of the open batch ended with ``samples`` per model (None: abandoned, gave nothing); ``ticket``:
        what :meth:`started` reserved for it (default: the current estimate)."""
        got = samples or {}
        for m in self.models:
            held = self.expected[m] if ticket is None else ticket[m]
            self.reserved[m] = self.reserved.get(m, 0.0) - held + got.get(m, 0)
            if got.get(m, 0) > 0:  # a task that lost its groups says nothing about the next one
                self.seen[m] = max(self.seen.get(m, 0.0), float(got[m]))
                self.expected[m] = self.seen[m]
        self.in_flight -= 1

    def complete(self, done: Collection[str] = ()) -> bool:
        """Every task of the open batch has ended and it holds the samples every model needs: what MARFT's
        coordinator waits for before it normalises the batch and publishes it whole."""
        return self.base is not None and not self.in_flight and not any(self.needs(m, done) for m in self.models)


@dataclass
class _Paced:
    """What the coordinator knows of one model's consumption: its latest mq depth report, and more."""

    depth: int = 0  # samples in mq, the ready stream and the trainer's accumulation (not yet stepped on)
    trained: int | None = None  # trainer version of the same report; None before the first report
    at: float = 0.0  # when that report came (monotonic)
    moved_at: float = 0.0  # when a report last showed a newer trainer version
    step_s: float | None = None  # mean seconds between versions; None until one was seen
    reports: int = 0
    unreported: dict[int, int] = field(default_factory=dict)  # ``reports`` when tasks ended -> their samples


@dataclass
class Pacer:
    """Admission of ``train.mode: async``: AReaL's staleness capacity per model, so that generation is paced
    rather than generated and dropped as stale.

    With ``B = global_batch``, ``s = max_staleness`` and ``v`` the version the model's rollouters serve::

        capacity = (s + v + 1) * B - (trained * B + pending + running)

    ``trained`` (the trainer's version) and ``pending`` (samples in mq, the ready stream and the trainer's
    accumulation) come from one mq depth report, so ``trained * B + pending`` are the samples alive when it
    was made; ``running`` are the expected samples of the tasks in flight plus the real samples of ended
    tasks that no depth report counts yet. Unlike AReaL's ``accepted`` total, dropped samples (stale,
    invalid, shed, filtered groups) leave ``pending`` and free their room, so drops never shrink capacity.

    A task starts when every model it feeds has ``capacity >= expected`` samples, or could not step without
    it (``pending + running < B``: no deadlock). Models that pace nothing: done ones (``done``), and, while
    another model the task feeds still consumes, a stuck one (:meth:`stuck`).
    """

    models: list[str]
    global_batch: int
    max_staleness: int
    expected: dict[str, float]  # samples one task gives each model; replaced by what tasks really give
    stale_after_s: float  # a depth report older than this: the mq is gone
    in_flight: int = 0
    book: dict[str, _Paced] = field(default_factory=dict)
    held_by: list[str] = field(default_factory=list)  # models that held back the last check

    def __post_init__(self) -> None:
        self.book = {m: _Paced() for m in self.models}

    def on_report(self, model: str, depth: int, trained: int, now: float) -> None:
        """An mq depth report: samples of ended tasks stop counting as running at the second report after."""
        b = self.book.get(model)
        if b is None:
            return
        if b.trained is None:
            b.moved_at = now
        elif trained > b.trained:
            dt = now - b.moved_at
            b.step_s = dt if b.step_s is None else 0.8 * b.step_s + 0.2 * dt
            b.moved_at = now
        b.depth, b.trained, b.at = depth, trained, now
        b.reports += 1
        b.unreported = {k: n for k, n in b.unreported.items() if b.reports < k + 2}

    def started(self) -> None:
        self.in_flight += 1

    def finished(self, samples: Mapping[str, int] | None) -> None:
        """A task ended with ``samples`` per model, about to be published (None: abandoned, gave nothing)."""
        self.in_flight -= 1
        for m, n in (samples or {}).items():
            b = self.book.get(m)
            if b is None or n <= 0:  # a task that lost its groups says nothing about the next one
                continue
            self.expected[m] = float(n)
            if b.trained is not None:  # before its mq's first report, only the tasks in flight are counted
                b.unreported[b.reports] = b.unreported.get(b.reports, 0) + n

    def running(self, model: str) -> float:
        """Samples of ``model`` generated or being generated that no depth report counts yet."""
        return self.in_flight * self.expected[model] + sum(self.book[model].unreported.values())

    def capacity(self, model: str, served: Mapping[str, int], running: float | None = None) -> float:
        """``(s + v + 1) * B - (trained * B + pending + running)`` for ``model`` (see the class); ``running``:
        :meth:`running`, where the caller has it already."""
        b, v = self.book[model], served.get(model, 0)
        trained = v if b.trained is None else b.trained  # before any report: nothing pending, weights current
        s, batch = self.max_staleness, self.global_batch
        running = self.running(model) if running is None else running
        return (s + v + 1) * batch - (trained * batch + b.depth + running)

    def stuck(self, model: str, now: float) -> bool:
        """The model stopped consuming: its mq's report is stale, or its trainer has a batch waiting and has made
        no new version for longer than ``stale_after_s`` and four of its usual steps (a stopped trainer)."""
        b = self.book[model]
        if b.trained is None:
            return False
        if now - b.at > self.stale_after_s:
            return True
        return (b.step_s is not None and b.depth >= self.global_batch
                and now - b.moved_at > max(self.stale_after_s, 4 * b.step_s))

    def may_start(self, served: Mapping[str, int], done: Collection[str] = (), now: float = 0.0) -> bool:
        """Whether a task may start now; ``done``: models that need no more samples (budget spent).

        The models held back are those that do not fit among the live ones (not :meth:`stuck`), or among all
        when every one is stuck: a stuck model would hold back the others for good, and if every model is stuck,
        generating is useless. Whether a model is stuck is only asked of the ones that do not fit, and of the
        others only when all of those are stuck (this runs at every admission check, for every model)."""
        pacing = [m for m in self.models if m not in done and self.expected[m] > 0]
        tight = [m for m in pacing if not self.fits(m, served)]
        if not tight:
            self.held_by = []
            return True
        held = [m for m in tight if not self.stuck(m, now)]
        if not held and not any(not self.stuck(m, now) for m in pacing if m not in tight):
            held = tight  # every model is stuck
        self.held_by = held
        return not held

    def fits(self, model: str, served: Mapping[str, int]) -> bool:
        """Room for one more task's samples (``capacity >= expected``), or too few samples on the way for the
        trainer to step without it (``pending + running < B``)."""
        running = self.running(model)
        return (self.capacity(model, served, running) >= self.expected[model]
                or self.book[model].depth + running < self.global_batch)

    def snapshot(self, served: Mapping[str, int], now: float) -> dict[str, object]:
        """Gauges for the coordinator's metrics."""
        return {
            "capacity": {m: round(self.capacity(m, served), 1) for m in self.models},
            "pending": {m: self.book[m].depth for m in self.models},
            "running": {m: round(self.running(m), 1) for m in self.models},
            "held_by": list(self.held_by),
            "stuck": [m for m in self.models if self.stuck(m, now)],
        }


def expected_samples(agent_models: Mapping[str, str], group_size: int, models: list[str]) -> dict[str, float]:
    """First guess of the samples one task gives each model: one turn per agent, ``group_size`` rollouts."""
    out = dict.fromkeys(models, 0.0)
    for model in agent_models.values():
        if model in out:
            out[model] += group_size
    return out
