"""The ``chorus`` command's tables: a run's reward summary and held-out scores (``chorus up``'s report, ``chorus
plot``), the record of ``chorus eval``, and the per-service tables of ``chorus status``. Rendering only: each takes
what the command read (metrics, records) and returns a rich ``Table`` or a line; none touches the bus."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from shared.results.plotting import eval_table_rows, load_evals, summarize


def section(m: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``m[key]`` when it is a mapping, else an empty one: a metrics message is read, never trusted."""
    v = m.get(key)
    return v if isinstance(v, Mapping) else {}


def report_tables(metrics: Path) -> list[Table]:
    """The tables that close a run and ``chorus plot``: reward per model, then the held-out scores if it has any."""
    evals = load_evals(metrics)
    return [summary_table(summarize(metrics)), *([eval_table(evals)] if evals else [])]


def versions_label(ev: Mapping[str, Any]) -> str:
    """``version 20``, or ``versions 20-25`` for a mid-run evaluation whose rollouts spanned several versions (the
    trainer went on while it ran)."""
    low, high = ev.get("version"), ev.get("version_max")
    if isinstance(high, int) and isinstance(low, int) and high > low:
        return f"versions {low}-{high}"
    return f"version {low}"


def eval_line(ev: dict[str, Any]) -> str:
    """One evaluation as a progress line: ``held-out pass@1 at version 20: final answer 0.417 (solver 0.417, ...)``,
    then Maj@N and the tokens per question when the record has them."""
    pass1 = ev.get("pass1")
    agents = ", ".join(f"{a} {v:.3f}" for a, v in pass1.items() if isinstance(v, int | float)) \
        if isinstance(pass1, dict) else ""
    final = ev.get("final")
    final_text = f"{final:.3f}" if isinstance(final, int | float) else "?"
    n = ev.get("samples", 1)
    line = f"held-out pass@1{f' (mean of {n})' if isinstance(n, int) and n > 1 else ''} at {versions_label(ev)}: " \
           f"final answer {final_text}" + (f" ({agents})" if agents else "")
    maj = ev.get("maj")
    if isinstance(n, int) and n > 1 and isinstance(maj, dict) and isinstance(maj.get("final"), int | float):
        line += f"; Maj@{n} {maj['final']:.3f}"
    tokens = ev.get("tokens_per_question")
    if isinstance(tokens, dict) and isinstance(tokens.get("total"), int | float):
        line += f"; {tokens['total']:.1f} tokens per question"
    return line


def eval_table(evals: list[dict[str, Any]]) -> Table:
    """Held-out scores of the first and the last evaluation of a run, per agent, and their difference."""
    first, last = evals[0], evals[-1]
    n = last.get("samples", 1)
    what = "held-out pass@1" + (f" (mean of {n} samples)" if isinstance(n, int) and n > 1 else "")
    t = Table(title=f"{what} ({first.get('n', '?')} tasks): version {first['version']} -> {last['version']}")
    for col in ("", "before", "after", "delta"):
        t.add_column(col, justify="left" if not col else "right")
    for row, a, b in eval_table_rows(evals):
        t.add_row(row, f"{a:.3f}", f"{b:.3f}", f"{b - a:+.3f}")
    return t


def summary_table(summary: dict[str, dict[str, float]]) -> Table:
    """Reward per model: the first and last 20% of its steps, and their difference."""
    t = Table(title="reward per model (mean reward_mean of the first / last 20% of steps)")
    cut = any("truncated" in s for s in summary.values())
    for col in ("model", "steps", "first 20%", "last 20%", "delta", *(["cut at max_new_tokens"] if cut else [])):
        t.add_column(col, justify="left" if col == "model" else "right")
    for model, s in summary.items():
        t.add_row(model, str(int(s["steps"])), f"{s['first']:.3f}", f"{s['last']:.3f}", f"{s['delta']:+.3f}",
                  *([f"{s['truncated']:.0%}" if "truncated" in s else "-"] if cut else []))
    return t


def eval_record_table(record: Mapping[str, Any], tasks: int, split: str, label: str) -> Table:
    """A ``chorus eval`` record: pass@1 (final answer, per agent), pass@k, maj@n, failures, tokens and time."""
    table = Table(title=f"chorus eval: {tasks} {split} tasks, {label}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("pass@1 (final answer)", f"{record['final']:.4f}")
    for agent, value in sorted((record.get("pass1") or {}).items()):
        table.add_row(f"pass@1 {agent}", f"{value:.4f}")
    for k, value in sorted(((record.get("pass_at_k") or {}).get("final") or {}).items(), key=lambda kv: int(kv[0])):
        if k != "1":
            table.add_row(f"pass@{k}", f"{value:.4f}")
    maj = record.get("maj")
    if isinstance(maj, Mapping):  # the vote of the n samples of each task: the final answer's, then each agent's
        n = record.get("samples", "n")
        for who, value in sorted(maj.items(), key=lambda kv: (kv[0] != "final", kv[0])):
            table.add_row(f"maj@{n} {'(final answer)' if who == 'final' else who}", f"{float(value):.4f}")
    table.add_row("failed tasks", str(record["failed"]))
    table.add_row("tokens generated", f"{record['tokens_total']:,}")
    table.add_row("tokens/s", f"{record['tokens_per_s']:.1f}")
    table.add_row("time", f"{record['seconds']:.1f} s")
    return table


# --- chorus status: one table per service kind, from the metrics its instances answered -----------------------------
def pool_table(metrics: Mapping[str, Mapping[str, Any]]) -> Table | None:
    """The training pool (train.pool): per slot who holds it, held seconds and grants, then the swap's control and
    data seconds and the bytes in host memory; None when the run has no pool."""
    pools = {i: m["pool"] for i, m in metrics.items() if isinstance(m.get("pool"), Mapping) and "slots" in m["pool"]}
    if not pools:
        return None
    t = Table(title="training pool: slots (held seconds); swaps: ctrl = process starts and builds, data = Set/Get copies")
    for col in ("pool", "slot", "cores", "holder", "call", "held s", "grants", "starts", "waiting", "util",
                "ctrl s", "data s", "sets/gets", "host MB", "disk MB"):
        t.add_column(col, justify="left" if col in ("pool", "holder", "call", "waiting", "cores") else "right")
    for instance, p in sorted(pools.items()):
        swap = section(p, "swap")
        tail = (", ".join(p.get("waiting") or []) or "-", f"{p.get('utilisation', 0):.2f}",
                f"{swap.get('control_s', 0):.2f}", f"{swap.get('data_s', 0):.2f}",
                f"{_n(swap.get('sets'))}/{_n(swap.get('gets'))}", f"{p.get('resident_bytes', 0) / 2**20:.1f}",
                f"{p.get('spilled_bytes', 0) / 2**20:.1f}")
        for k, slot in enumerate(p.get("slots") or []):
            t.add_row(instance if k == 0 else "", _n(slot.get("slot")), ",".join(map(str, slot.get("cores") or [])),
                      str(slot.get("holder") or "-"), str(slot.get("call") or "-"), f"{slot.get('busy_s', 0):.1f}",
                      _n(slot.get("grants")), _n(slot.get("starts")), *(tail if k == 0 else ("",) * len(tail)))
    return t


def act_table(metrics: Mapping[str, Mapping[str, Any]]) -> Table | None:
    """The actions service: per instance its queue, busy cores and mean ACT per resource, then per action kind
    the ACT (mean, p50, p99) split into queue, execution and overhead; None if no actions service answered."""
    if not metrics:
        return None
    t = Table(title="actions: action completion time (ACT) = queue + execution + overhead, seconds")
    for col in ("instance", "scheduler", "queue", "busy cores", "kind / resource", "n", "mean ACT", "p50", "p99",
                "queue s", "exec s", "overhead s"):
        t.add_column(col, justify="left" if col in ("instance", "scheduler", "kind / resource") else "right")

    def f(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, int | float) and not isinstance(v, bool) else "-"

    for instance, m in sorted(metrics.items()):
        act = section(m, "act")
        head = (instance, str(m.get("scheduler", "-")), _n(m.get("queue_len")),
                f"{_n(m.get('busy_cores'))}/{_n(m.get('cores'))}")
        resources = section(act, "resources")
        for r, v in sorted(resources.items()):
            if isinstance(v, Mapping):
                t.add_row(*head, f"resource {r}", _n(v.get("n")), f(v.get("mean")), "", "", "", "", "")
                head = ("", "", "", "")
        kinds = section(act, "kinds")
        for k, v in sorted(kinds.items()):
            if isinstance(v, Mapping):
                t.add_row(*head, k, _n(v.get("n")), *(f(v.get(x)) for x in ("mean", "p50", "p99", "queue", "exec",
                                                                              "overhead")))
                head = ("", "", "", "")
        if head[0]:
            t.add_row(*head, "no action yet", "", "", "", "", "", "", "")
    return t


def balance_table(metrics: Mapping[str, Mapping[str, Any]]) -> Table | None:
    """The coordinator's rollout manager: per model its queue length (requests waiting for an answer), per
    instance its load (rows) and whether it takes requests; the caption has the counters and the last migration.
    None if no coordinator answered or it does not balance."""
    rows = []
    captions = []
    for coordinator, m in sorted(metrics.items()):
        bal = m.get("balance")
        if not isinstance(bal, Mapping):
            continue
        queues = section(bal, "queues")
        instances = section(bal, "instances")
        for model in sorted(set(queues) | set(instances)):
            insts = section(instances, model)
            head = (coordinator, model, _n(queues.get(model)))
            for name, v in sorted(insts.items()):
                if isinstance(v, Mapping):
                    rows.append((*head, name, _n(v.get("load")), _n(v.get("requests")),
                                 "draining" if v.get("draining") else "routing"))
                    head = ("", "", "")
            if head[0]:
                rows.append((*head, "none", "", "", ""))
        counters = section(bal, "counters")
        text = f"coordinator {coordinator} ({bal.get('dispatch', '?')}): " + ", ".join(
            f"{k} {v}" for k, v in sorted(counters.items()))
        migrations = bal.get("migrations")
        if isinstance(migrations, list) and migrations and isinstance(migrations[-1], Mapping):
            last = migrations[-1]
            text += f"; last migration {last.get('instance')} {last.get('from')} -> {last.get('to')}"
        captions.append(text)
    if not rows:
        return None
    t = Table(title="rollout balancing (coordinator's rollout manager)")
    for col in ("coordinator", "model", "queue", "instance", "load rows", "requests", "state"):
        t.add_column(col, justify="left" if col in ("coordinator", "model", "instance", "state") else "right")
    for r in rows:
        t.add_row(*r)
    t.caption = "; ".join(captions)
    return t


def agent_table(metrics: Mapping[str, Mapping[str, Any]]) -> Table | None:
    """One row per (model, agent table) of mq's ``agents`` metrics; None if no mq reported."""
    if not metrics:
        return None
    rows: list[tuple[str, str, Mapping[str, Any]]] = []
    for model, m in sorted(metrics.items()):
        agents = m.get("agents")
        if isinstance(agents, Mapping):
            rows.extend((model, str(a), c) for a, c in sorted(agents.items()) if isinstance(c, Mapping))
    columns: list[str] = []  # data columns in the order mq reports them
    for *_, c in rows:
        filled = c.get("filled")
        columns.extend(k for k in (filled if isinstance(filled, Mapping) else ()) if k not in columns)
    t = Table(title="experience store tables (mq)")
    for col in ("model", "agent", "held", "processing", "dispatchable", *columns):
        t.add_column(col, justify="left" if col in ("model", "agent") else "right")
    for model, agent, c in rows:
        filled = section(c, "filled")
        t.add_row(model, agent, *(_n(c.get(k)) for k in ("held", "processing", "dispatchable")),
                  *(_n(filled.get(k)) for k in columns))
    t.caption = (f"{', '.join(columns)}: rows with that column filled" if columns else "") if rows else \
        f"no rows held by the mq of {', '.join(sorted(metrics))}"
    return t


def _n(v: object) -> str:
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else "-"
