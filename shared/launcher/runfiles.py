"""What a run directory tells without the bus: ``chorus status`` of a run whose NATS server is gone (the embedded
server stops with ``chorus up``), from ``runs/<id>/``.

``chorus up`` writes ``summary.json`` when it ends (how it ended, versions, samples trained and dropped by reason);
the trainers' ``metrics.jsonl`` holds every step and every held-out evaluation; ``checkpoints/`` the kept weights
(``best.json``: the best held-out version). A run started service by service has no summary: its versions and
evaluations still come from ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from shared.kernel.config import ChorusConfig
from shared.kernel.files import write_atomic
from shared.models import best
from shared.results.plotting import by_model, last_generated, load_evals, load_metrics, summarize_steps

SUMMARY = "summary.json"


def iso_utc(t: float) -> str:
    """Epoch seconds as ISO 8601 UTC, to the second: ``2026-12-02T10:07:06Z``."""
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def eval_scores(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The final and the best held-out evaluation of a run (pass@1 of the final answer, and the versions it was
    at); empty when the run evaluated nothing. A failed evaluation (every task failed) is never the best."""
    if not evals:
        return {}

    def score(rec: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"final": rec.get("final"), "version": rec.get("version"),
                               "versions": rec.get("versions"), "pass1": rec.get("pass1")}
        if rec.get("pass_at_k"):
            out["pass_at_k"] = rec["pass_at_k"].get("final")
        return out

    scored = [e for e in evals if isinstance(e.get("final"), int | float) and e.get("failed", 0) < e.get("n", 1)]
    best = max(scored, key=lambda e: float(e["final"]), default=None)
    return {"eval_final": score(evals[-1]), "eval_best": score(best) if best is not None else None,
            "evals": len(evals)}


def write_summary(run_dir: Path, *, code: int, models: dict[str, dict[str, Any]], started: float | None = None,
                  coordinator_dropped: dict[str, int] | None = None) -> None:
    """How ``chorus up`` ended (``code``: 0 finished, 1 failed, 130 interrupted), when and after how long, what each
    model did, what the coordinator dropped before publishing (by counter), the final and best held-out scores and
    the training tokens generated (from metrics.jsonl)."""
    ended = time.time()
    rec: dict[str, Any] = {"finished": code == 0, "exit_code": code, "ended": ended, "ended_utc": iso_utc(ended)}
    if started is not None:
        rec |= {"started": started, "started_utc": iso_utc(started), "duration_s": round(ended - started, 1)}
    rec["models"] = models
    if coordinator_dropped:
        rec["coordinator_dropped"] = coordinator_dropped
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rec |= eval_scores(load_evals(metrics))
        rec["tokens_generated"] = last_generated(metrics)[0]  # at the last trained version the coordinator saw
    write_atomic(run_dir / SUMMARY, json.dumps(rec, indent=2) + "\n")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _finished(cfg: ChorusConfig, summary: dict[str, Any] | None, steps: dict[str, list[dict[str, Any]]] | None,
              evals: list[dict[str, Any]]) -> bool | None:
    """Whether the run finished, as its files tell: the summary's word, else every model's last step at
    ``train.max_versions`` (and the final evaluation written, when there is one); None: no file says anything
    (``steps`` None: no metrics.jsonl)."""
    if summary is not None:
        return bool(summary.get("finished"))
    if steps is None:
        return None
    done = bool(steps) and all(max((int(r["version"]) for r in steps.get(m, [])), default=0)
                               >= cfg.train.max_versions for m in cfg.models)
    if done and cfg.eval.every:
        done = any(e.get("last") for e in evals)
    return done


def offline_view(cfg: ChorusConfig, run_dir: Path) -> tuple[bool | None, RenderableType]:
    """(finished, what to print) from the run directory alone; finished is None when no file says anything."""
    read = read_summary(run_dir)
    metrics = run_dir / "metrics.jsonl"
    steps = by_model(load_metrics(metrics)) if metrics.is_file() else None
    evals = load_evals(metrics) if metrics.is_file() else []
    done = _finished(cfg, read, steps, evals)
    summary = read or {}
    ended = summary.get("ended")
    when = f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ended))}" if isinstance(ended, int | float) else ""
    if done:
        head = f"run {cfg.run.id} finished{when}: every model reached train.max_versions ({cfg.train.max_versions})"
    elif summary:
        head = f"run {cfg.run.id} ended{when} without finishing (chorus up exit code {summary.get('exit_code')})"
    else:
        head = f"run {cfg.run.id}: not finished, and nothing serves it now"
    parts: list[RenderableType] = [head]

    steps = steps or {}
    rewards = summarize_steps(steps)
    per_model: dict[str, Any] = summary.get("models") or {}
    t = Table(title=f"models (from {run_dir})")
    for col in ("model", "version", "steps", "reward first 20%", "reward last 20%", "samples trained", "dropped"):
        t.add_column(col, justify="left" if col in ("model", "dropped") else "right", overflow="fold")
    for m in cfg.models:
        recs = steps.get(m, [])
        version = max((int(r["version"]) for r in recs), default=int((per_model.get(m) or {}).get("version", 0)))
        r = rewards.get(m)
        info = per_model.get(m) or {}
        dropped = info.get("dropped") or {}
        t.add_row(m, f"{version}/{cfg.train.max_versions}", str(len(recs)),
                  f"{r['first']:.3f}" if r else "-", f"{r['last']:.3f}" if r else "-",
                  str(info["trained"]) if "trained" in info else "-",
                  ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items())) if dropped else
                  ("none" if info else "-"))
    parts.append(t)
    for m in cfg.models:
        killed = int((per_model.get(m) or {}).get("out_of_memory") or 0)
        if killed:
            parts.append(f"[red]out of memory:[/] the kernel's OOM killer ended {killed} process(es) of {m}'s trainer "
                         f"(chorus up's output and {run_dir / 'logs'} say which and what to change)")

    if evals:
        e = Table(title="held-out evaluations (final answer pass@1)")
        for col in ("version", "final", *sorted(evals[-1].get("pass1") or {}), "failed"):
            e.add_column(col, justify="right")
        for rec in evals:
            e.add_row(str(rec["version"]) + (" (last)" if rec.get("last") else ""), f"{float(rec['final']):.3f}",
                      *(f"{float((rec.get('pass1') or {}).get(a, 0.0)):.3f}" for a in sorted(evals[-1].get("pass1") or {})),
                      str(rec.get("failed", 0)))
        parts.append(e)
    kept = best.read_record(run_dir)
    if kept is not None:
        versions = ", ".join(f"{m} v{v}" for m, v in sorted(kept["versions"].items()))
        model = " --model M" if len(cfg.models) > 1 else ""  # with one model, export needs no --model
        parts.append(f"best held-out version: {versions} (final answer {float(kept['final']):.3f}); "
                     f"chorus export {run_dir}{model} --version best --out DIR")
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        files = sorted(p.relative_to(run_dir).as_posix() for p in ckpts.rglob("*") if p.is_file()
                       and not p.name.startswith("."))
        parts.append(f"checkpoints: {', '.join(files) if files else 'none'}")
    plots = [p for p in (run_dir / "reward.png", run_dir / "training.png") if p.is_file()]  # only those written
    shown = ", ".join(map(str, plots)) if plots else f"none (`chorus plot {run_dir}` writes them)"
    parts.append(f"logs: {run_dir / 'logs'}; plots: {shown}")
    return done, Group(*parts)
