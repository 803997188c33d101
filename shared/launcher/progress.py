"""Live terminal views of a run: per-model progress of ``chorus up`` and the ``chorus monitor`` table."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from shared.kernel import events
from shared.launcher.views import section

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
# The coordinator's drops, before any sample is published: its counters (metrics) -> words
COORDINATOR_DROPS = {
    "samples_dropped_reward_error": "samples whose reward function failed (reward.function)",
    "groups_incomplete_dropped": "groups not every rollout reached (dropped whole)",
    "workflow_errors": "tasks whose workflow raised",
    "workflow_timeouts": "tasks whose workflow timed out (workflow.timeout_s)",
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
    coordinator: dict[str, int] = field(default_factory=dict)  # its drop counters (COORDINATOR_DROPS), latest
    coordinator_before: dict[str, int] = field(default_factory=dict)  # a resumed run's, from before the resume

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

    def seed(self, steps: list[dict[str, Any]], summary: dict[str, Any] | None) -> None:
        """A resumed run: the steps already in metrics.jsonl count as trained (each version once, as the step
        events of this run do), the drops of the previous `chorus up` (its summary.json) as dropped."""
        for rec in steps:
            p = self.models.get(rec.get("model"))  # type: ignore[arg-type]
            version, samples = rec.get("version"), rec.get("samples")
            if p is None or not isinstance(version, int) or not isinstance(samples, int) or version in p.steps_seen:
                continue
            p.steps_seen.add(version)
            p.trained += samples
            p.version = max(p.version, version)
        models = (summary or {}).get("models")
        for name, before in (models.items() if isinstance(models, dict) else ()):
            dropped = before.get("dropped") if isinstance(before, dict) else None
            if name in self.models and isinstance(dropped, dict):
                for reason, n in dropped.items():
                    if isinstance(n, int):
                        self.models[name].dropped[reason] = self.models[name].dropped.get(reason, 0) + n
        old = (summary or {}).get("coordinator_dropped")
        for key, n in (old.items() if isinstance(old, dict) else ()):
            if isinstance(n, int):
                self.coordinator_before[key] = n

    def on_metrics(self, m: Any) -> None:
        """Take the coordinator's drop counters from one metrics message; anything else is ignored."""
        if not isinstance(m, dict) or m.get("service") != "coordinator" or not isinstance(m.get("counters"), dict):
            return
        for key in COORDINATOR_DROPS:
            value = m["counters"].get(key)
            if isinstance(value, int) and value >= self.coordinator.get(key, 0):
                self.coordinator[key] = value

    def coordinator_total(self) -> dict[str, int]:
        """The coordinator's drops by counter since the run started (a resumed run's before it too)."""
        total = {k: self.coordinator.get(k, 0) + self.coordinator_before.get(k, 0) for k in COORDINATOR_DROPS}
        return {k: n for k, n in total.items() if n}

    def coordinator_line(self) -> str | None:
        """What the coordinator dropped before publishing anything, by reason; None when nothing."""
        parts = [f"{n} {COORDINATOR_DROPS[k]}" for k, n in self.coordinator_total().items()]
        return f"coordinator: dropped {'; '.join(parts)}" if parts else None

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
        line = self.coordinator_line()
        return out + ([line] if line else [])

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
        dropped = {k: n for k, n in self.tracker.coordinator.items() if n}
        if dropped:
            parts.append("coordinator dropped " + ", ".join(f"{n} {k.replace('_dropped', '').replace('samples_', '')}"
                                                          for k, n in dropped.items()))
        return "progress: " + "; ".join(parts) + (" (waiting for the first version)" if waiting else "")

    def refresh(self) -> None:
        for m, task in self.tasks.items():
            p = self.tracker.models[m]
            reward = "-" if p.reward_mean is None else f"{p.reward_mean:.3f}"
            self.progress.update(task, completed=min(p.version, self.tracker.max_versions), reward=reward)


# Counters that count a normal start-up or a wait, not a failure, whatever their names say: requests sent before any
# rollouter answered, an instance waiting for the first sync, a paramsync that listed no instance yet, the pacing of
# admissions. `chorus monitor` never lists them as problems.
ROUTINE_COUNTERS = frozenset({"gen_no_responders", "gen_unrouted", "join_waits_for_sync", "empty_listings",
                              "backpressure_waits", "tasks_paced", "coalesced", "in_progress_sent", "requeued"})
PROBLEM_WORDS = ("error", "fail", "timeout", "dead", "invalid", "reject", "lost", "nonfinite", "dlq", "crash", "oom",
                 "refused", "not_written", "skipped")
MONITOR_EVENTS = 6  # the latest events under the tables
# The fields an event line shows for the frequent kinds (others: every plain field).
EVENT_FIELDS = {events.STEP: ("version", "samples", "reward_mean", "staleness_mean", "loss"),
                events.EVAL: ("version", "final", "n", "last"),
                events.DROP: ("reason", "count")}


def problem_counters(counters: Any) -> dict[str, int]:
    """The counters of a metrics message that count something gone wrong (non-zero, not a routine one)."""
    if not isinstance(counters, dict):
        return {}
    return {k: v for k, v in counters.items() if isinstance(v, int) and v > 0 and k not in ROUTINE_COUNTERS
            and any(w in k for w in PROBLEM_WORDS)}


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, bool) or v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


@dataclass
class MonitorState:
    """Latest metrics per service instance, per model its training state, and the last few events, for
    ``chorus monitor``: fixed columns, one screen."""

    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    keep_events: int = MONITOR_EVENTS
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> version, reward, staleness
    heldout: dict[str, Any] = field(default_factory=dict)  # the latest evaluation
    agents: dict[str, str] = field(default_factory=dict)  # agent -> its model (held-out pass@1 per model)

    def on_metrics(self, subject: str, data: Any) -> None:
        if isinstance(data, dict):
            self.metrics[subject.rsplit(".", 2)[-2] + "." + subject.rsplit(".", 1)[-1]] = data
            model = data.get("model")
            if data.get("service") == "trainer" and isinstance(model, str) and isinstance(data.get("version"), int):
                m = self.models.setdefault(model, {})
                m["version"] = max(m.get("version", 0), data["version"])

    def on_event(self, subject: str, data: Any) -> None:
        if not isinstance(data, dict):
            return
        kind, model = data.get("kind"), data.get("model")
        if kind == events.STEP and isinstance(model, str):
            m = self.models.setdefault(model, {})
            if isinstance(data.get("version"), int) and data["version"] >= m.get("version", 0):
                m.update(version=data["version"], reward=data.get("reward_mean"),
                         staleness=data.get("staleness_mean"), staleness_max=data.get("staleness_max"))
        if kind == events.EVAL:
            self.heldout = data
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

    def _mq(self, model: str) -> dict[str, Any]:
        return next((m for m in self.metrics.values() if m.get("service") == "mq" and m.get("model") == model), {})

    def _heldout(self, model: str) -> str:
        """The latest evaluation's pass@1 of the agents of ``model`` ("solver 0.417")."""
        pass1 = self.heldout.get("pass1")
        if not isinstance(pass1, dict):
            return "-"
        mine = [a for a in sorted(pass1) if self.agents.get(a) == model and isinstance(pass1[a], int | float)]
        return ", ".join(f"{a} {pass1[a]:.3f}" for a in mine) or "-"

    def model_table(self) -> Table:
        t = Table(title="models", title_justify="left")
        for col in ("model", "version", "reward", "held-out pass@1", "final", "staleness", "max", "mq depth", "held"):
            t.add_column(col, justify="left" if col in ("model", "held-out pass@1") else "right", no_wrap=True)
        final = self.heldout.get("final")
        final_text = f"{final:.3f} (v{self.heldout.get('version')})" if isinstance(final, int | float) else "-"
        models = sorted(set(self.models) | {str(m.get("model")) for m in self.metrics.values()
                                            if m.get("service") in ("mq", "trainer") and m.get("model")})
        for model in models:
            m, mq = self.models.get(model, {}), self._mq(model)
            t.add_row(model, _fmt(m.get("version")), _fmt(m.get("reward")), self._heldout(model), final_text,
                      _fmt(m.get("staleness"), 2), _fmt(m.get("staleness_max")), _fmt(mq.get("depth")),
                      _fmt(mq.get("held")))
        return t

    def service_table(self) -> Table:
        t = Table(title="services", title_justify="left")
        for col in ("service.instance", "model", "up s", "age s", "state", "problems"):
            t.add_column(col, justify="right" if col in ("up s", "age s") else "left", no_wrap=col != "problems",
                         max_width=60 if col == "problems" else None)
        now = time.time()
        for key in sorted(self.metrics):
            m = self.metrics[key]
            problems = problem_counters(m.get("counters"))
            t.add_row(key, str(m.get("model") or ""), f"{m.get('uptime_s', 0):.0f}", f"{now - float(m.get('time', now)):.1f}",
                      service_state(m), ", ".join(f"{k} {v}" for k, v in sorted(problems.items())) or "-",
                      style="red" if problems else None)
        return t

    def event_lines(self) -> list[str]:
        out = []
        for service, ev in self.events[-self.keep_events:]:
            when = time.strftime("%H:%M:%S", time.localtime(float(ev.get("time") or time.time())))
            shown = EVENT_FIELDS.get(str(ev.get("kind")))
            detail = ", ".join(f"{k}={_short(v)}" for k, v in ev.items()
                               if (k in shown if shown else k not in ("kind", "sample_ids", "time", "instance", "model"))
                               and not isinstance(v, dict | list))
            out.append(f"{when} {service} {ev.get('kind')}" + (f" ({ev['model']})" if ev.get("model") else "")
                       + (f": {detail}" if detail else ""))
        return out

    def table(self) -> Group:
        lines = self.event_lines()
        return Group(self.model_table(), self.service_table(),
                     Text("latest events" + ("" if lines else ": none yet"), style="bold"),
                     *(Text(line, no_wrap=True, overflow="ellipsis") for line in lines))


def service_state(m: dict[str, Any]) -> str:
    """A few words on what one instance is doing, by service kind (no raw dicts)."""
    service = m.get("service")
    c = section(m, "counters")
    if service == "trainer":
        return f"v{_fmt(m.get('version'))}, {_fmt(c.get('samples', 0))} samples, commit {_fmt(m.get('commit_s'), 2)} s"
    if service == "rollouter":
        return (f"v{_fmt(m.get('version'))}, {'routing' if m.get('routing') else 'not routing'}, "
                f"{_fmt(m.get('tokens_per_s'), 0)} tok/s, {_fmt(m.get('queued'))} queued")
    if service == "mq":
        return f"depth {_fmt(m.get('depth'))}, held {_fmt(m.get('held'))}, {_fmt(c.get('dispatched', 0))} dispatched"
    if service == "coordinator":
        return (f"{_fmt(c.get('tasks_done', 0))} tasks done, {_fmt(m.get('in_flight'))} in flight, "
                f"{'admitting' if m.get('admitting') else 'not admitting'}")
    if service == "paramsync":
        return f"synced v{_fmt(m.get('synced_version'))}, {_fmt(c.get('syncs', 0))} syncs"
    if service == "actions":
        return (f"{_fmt(m.get('busy_cores'))}/{_fmt(m.get('cores'))} cores busy, {_fmt(m.get('queue_len'))} queued, "
                f"{_fmt(c.get('actions', 0))} actions")
    if service == "critic":
        return f"v{_fmt(m.get('version'))}"
    return "-"


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."
