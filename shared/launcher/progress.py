"""Live terminal views of a run: per-model progress of ``chorus up`` and the ``chorus monitor`` table."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.kernel import events

# Drop reasons (DropEvent.reason) as a user reads them, after the number of samples.
DROP_WORDS = {
    "stale": "too stale to train (train.max_staleness)",
    "finished": "arrived after the last version (train.max_versions)",
    "overflow": "shed to keep the experience store within mq.capacity",
    "group_dropped": "lost with their group (a member was dropped)",
    "late": "arrived after their group was trained",
    "invalid": "invalid (see the DLQ)",
    "learner_error": "failed in the learner",
    "nonfinite_grad": "gave a non-finite gradient",
}
WIDE = 160  # columns of the output when it is not a terminal (a pipe, a log file, a container's stdout)


def make_console(*, stderr: bool = False) -> Console:
    """The console of the ``chorus`` command. On a terminal: its width. Elsewhere lines are never wrapped (a log
    holds whole lines, a grep finds whole values) and tables get ``WIDE`` columns, or ``COLUMNS`` when set."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, soft_wrap=True, width=None if os.environ.get("COLUMNS") else WIDE)


@dataclass
class ModelProgress:
    version: int = 0
    reward_mean: float | None = None
    done: bool = False
    trained: int = 0  # samples in the step records seen
    dropped: dict[str, int] = field(default_factory=dict)  # samples in the drop records seen, by reason
    steps_seen: set[int] = field(default_factory=set)
    drops_seen: set[str] = field(default_factory=set)


@dataclass
class RunTracker:
    """Versions and latest rewards per model, fed by trainer events and KV reads."""

    max_versions: int
    models: dict[str, ModelProgress] = field(default_factory=dict)

    @classmethod
    def for_models(cls, models: list[str], max_versions: int) -> RunTracker:
        return cls(max_versions=max_versions, models={m: ModelProgress() for m in models})

    def on_event(self, ev: Any) -> None:
        """Apply one ``events.trainer`` JSON object; anything unrecognised is ignored."""
        if not isinstance(ev, dict):
            return
        model = ev.get("model")
        if model not in self.models:
            return
        p = self.models[model]
        kind = ev.get("kind")
        if kind == events.STEP:
            if isinstance(ev.get("version"), int):
                p.version = max(p.version, ev["version"])
                if isinstance(ev.get("samples"), int) and ev["version"] not in p.steps_seen:
                    p.steps_seen.add(ev["version"])
                    p.trained += ev["samples"]
            if isinstance(ev.get("reward_mean"), int | float):
                p.reward_mean = float(ev["reward_mean"])
        elif kind == events.DROP and isinstance(ev.get("count"), int) and isinstance(ev.get("reason"), str):
            key = f"{ev['reason']}:{','.join(sorted(map(str, ev.get('sample_ids') or [])))}"
            if key not in p.drops_seen:  # a record delivered twice counts once
                p.drops_seen.add(key)
                p.dropped[ev["reason"]] = p.dropped.get(ev["reason"], 0) + ev["count"]
        elif kind == events.DONE:
            p.done = True
        if p.version >= self.max_versions:
            p.done = True

    def sample_lines(self) -> list[str]:
        """Per model: samples trained and dropped, each reason once and in words; stale drops as a share of trained
        + stale (what the staleness bound cost)."""
        out = []
        for name, p in sorted(self.models.items()):
            if not p.dropped:
                out.append(f"{name}: {p.trained} samples trained, none dropped")
                continue
            parts = []
            for reason, n in sorted(p.dropped.items(), key=lambda kv: (-kv[1], kv[0])):
                words = DROP_WORDS.get(reason, reason)
                if reason == "stale":
                    words += f", {n / (n + p.trained):.1%} of trained + stale"
                parts.append(f"{n} {words}")
            out.append(f"{name}: {p.trained} samples trained; {sum(p.dropped.values())} dropped: {'; '.join(parts)}")
        return out

    def on_trained_version(self, model: str, version: int) -> None:
        """The trainer's KV version (covers events missed before the subscription started)."""
        if model in self.models:
            p = self.models[model]
            p.version = max(p.version, version)
            p.done = p.done or p.version >= self.max_versions

    @property
    def finished(self) -> bool:
        return bool(self.models) and all(p.version >= self.max_versions for p in self.models.values())


class ProgressView:
    """One rich progress bar per model: version / max_versions and the latest reward mean."""

    def __init__(self, tracker: RunTracker, progress: Progress | None = None) -> None:
        self.tracker = tracker
        self.progress = progress or Progress(
            TextColumn("[bold]{task.description:<14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TimeElapsedColumn(),
        )
        self.tasks: dict[str, TaskID] = {
            m: self.progress.add_task(m, total=tracker.max_versions, reward="-") for m in tracker.models
        }

    def log_line(self) -> str:
        """The bars as one line, for a stdout that is not a terminal (a log file, a container)."""
        parts = []
        for m, p in sorted(self.tracker.models.items()):
            reward = "-" if p.reward_mean is None else f"{p.reward_mean:.3f}"
            parts.append(f"{m} {min(p.version, self.tracker.max_versions)}/{self.tracker.max_versions} "
                         f"reward {reward}" + (" done" if p.done else ""))
        waiting = not any(p.version for p in self.tracker.models.values())
        return "progress: " + "; ".join(parts) + (" (waiting for the first version)" if waiting else "")

    def refresh(self) -> None:
        for m, task in self.tasks.items():
            p = self.tracker.models[m]
            reward = "-" if p.reward_mean is None else f"{p.reward_mean:.3f}"
            self.progress.update(task, completed=min(p.version, self.tracker.max_versions), reward=reward)


@dataclass
class MonitorState:
    """Latest metrics per service instance and the last few events, for ``chorus monitor``."""

    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    keep_events: int = 8

    def on_metrics(self, subject: str, data: Any) -> None:
        if isinstance(data, dict):
            self.metrics[subject.rsplit(".", 2)[-2] + "." + subject.rsplit(".", 1)[-1]] = data

    def on_event(self, subject: str, data: Any) -> None:
        if isinstance(data, dict):
            self.events.append((subject.rsplit(".", 1)[-1], data))
            del self.events[: -self.keep_events]

    def line(self) -> str:
        """A summary for a stdout that is not a terminal: instances reporting and the latest event."""
        now = time.time()
        fresh = sorted(k for k, m in self.metrics.items() if now - float(m.get("time", now)) < 30)
        last = ""
        if self.events:
            service, ev = self.events[-1]
            last = f"; last event {service} {ev.get('kind')}" + (f" ({ev['model']})" if ev.get("model") else "")
        return f"monitor: {len(fresh)} service instance(s) reporting: {', '.join(fresh) or 'none'}{last}"

    def table(self) -> Table:
        t = Table(title="Chorus services", expand=True)
        for col in ("service.instance", "model", "uptime s", "age s", "counters / gauges"):
            t.add_column(col)
        now = time.time()
        for key in sorted(self.metrics):
            m = self.metrics[key]
            extra = {k: v for k, v in m.items()
                     if k not in ("service", "instance", "model", "run", "time", "uptime_s", "counters")}
            fields = {**(m.get("counters") or {}), **extra}
            shown = ", ".join(f"{k}={_short(v)}" for k, v in sorted(fields.items()))
            age = now - float(m.get("time", now))
            t.add_row(key, str(m.get("model") or ""), f"{m.get('uptime_s', 0):.0f}", f"{age:.1f}", shown)
        for service, ev in self.events:
            detail = ", ".join(f"{k}={_short(v)}" for k, v in ev.items()
                               if k not in ("kind", "sample_ids", "time", "instance"))
            t.add_row(f"[dim]event {service}", str(ev.get("model") or ""), "", "", f"[dim]{ev.get('kind')}: {detail}")
        return t


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."
