"""Reward curves and run summaries from a run's ``metrics.jsonl``.

The file holds one trainer step record per line (``model``, ``version``, ``reward_mean`` ...) and, when
evaluation is on, held-out evaluation records (``"kind": "eval"``, ``version``, ``pass1`` per agent,
``final`` for the workflow's final answer).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

SUMMARY_FRACTION = 0.2  # first/last 20% of a model's steps


def load_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read step records; lines that are not JSON objects with a model and a version are skipped."""
    records: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash must not hide the rest of the run
        if isinstance(rec, dict) and "model" in rec and "version" in rec and rec.get("kind", "step") == "step":
            records.append(rec)
    return records


def load_evals(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Held-out evaluation records, in version order."""
    evals: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "eval" and "version" in rec:
            evals.append(rec)
    return sorted(evals, key=lambda r: (int(r["version"]), float(r.get("time", 0.0))))


def eval_table_rows(evals: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(what, first, last) of the first and last evaluation: per-agent pass@1 and the final answer's."""
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    rows = [(f"agent {a}", float(first["pass1"][a]), float(last["pass1"][a]))
            for a in sorted(first.get("pass1") or {}) if a in (last.get("pass1") or {})]
    if "final" in first and "final" in last:
        rows.append(("final answer", float(first["final"]), float(last["final"])))
    return rows


def smoothing_window(n: int) -> int:
    """Steps averaged in the reward curves: about a twentieth of the run, odd, 1 for short runs."""
    w = max(1, n // 20)
    return w if w % 2 else w + 1 if w > 1 else 1


def rolling_mean(xs: list[float], window: int) -> list[float]:
    """Mean of each point with its neighbours (``window`` wide, centred, shorter at the ends)."""
    if window <= 1:
        return list(xs)
    half = window // 2
    return [sum(xs[max(0, i - half): i + half + 1]) / len(xs[max(0, i - half): i + half + 1]) for i in range(len(xs))]


def by_model(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Group records per model, sorted by version, one per version (a restarted trainer writes the record of its
    last committed step again: the later line wins)."""
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        out[str(rec["model"])][int(rec["version"])] = rec
    return {m: [rs[v] for v in sorted(rs)] for m, rs in sorted(out.items())}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(metrics_path: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """Per model: ``steps``, ``first``/``last`` (mean reward_mean of the first/last 20% of steps, at least one
    step each) and ``delta`` = last - first."""
    summary: dict[str, dict[str, float]] = {}
    for model, recs in by_model(load_metrics(metrics_path)).items():
        rewards = [float(r["reward_mean"]) for r in recs]
        k = max(1, int(len(rewards) * SUMMARY_FRACTION))
        first, last = _mean(rewards[:k]), _mean(rewards[-k:])
        summary[model] = {"steps": len(rewards), "first": first, "last": last, "delta": last - first}
    return summary


def plot_run(metrics_path: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None) -> Path:
    """Write a PNG: reward_mean per version (one line per model, per-agent rewards dashed) above
    staleness_mean per version. Returns the PNG path (default: next to metrics.jsonl, reward.png)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    metrics_path = Path(metrics_path)
    out = Path(out_path) if out_path is not None else metrics_path.parent / "reward.png"
    models = by_model(load_metrics(metrics_path))
    if not models:
        raise ValueError(f"{metrics_path} has no step records (lines with model, version, reward_mean)")
    evals = load_evals(metrics_path)
    if evals:
        fig, (ax_r, ax_s, ax_e) = plt.subplots(3, 1, figsize=(9, 9.5), sharex=True, height_ratios=[2, 1, 1.5])
    else:
        fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[2, 1])
    styles = ["--", ":", "-.", (0, (5, 1, 1, 1))]
    for model, recs in models.items():
        versions = [int(r["version"]) for r in recs]
        rewards = [float(r["reward_mean"]) for r in recs]
        window = smoothing_window(len(recs))
        line = ax_r.plot(versions, rewards, linewidth=0.8, alpha=0.35)[0]
        ax_r.plot(versions, rolling_mean(rewards, window), color=line.get_color(), linewidth=2.0,
                  label=model if window == 1 else f"{model} (mean of {window} steps)")
        agents = sorted({a for r in recs for a in (r.get("agent_reward") or {})})
        for i, agent in enumerate(agents):
            pts = [(int(r["version"]), float(r["agent_reward"][agent])) for r in recs
                   if agent in (r.get("agent_reward") or {})]
            ax_r.plot([p[0] for p in pts], rolling_mean([p[1] for p in pts], window), linestyle=styles[i % len(styles)],
                      linewidth=1.2, color=line.get_color(), alpha=0.8, label=f"{model}/{agent}")
        ax_s.plot(versions, [float(r.get("staleness_mean", 0.0)) for r in recs], label=model,
                  color=line.get_color())
    ax_r.set_ylabel("reward (mean per step)")
    ax_r.set_title(f"Chorus run {metrics_path.parent.name}")
    ax_r.grid(alpha=0.3)
    ax_r.legend(fontsize=8)
    ax_s.set_ylabel("staleness (mean)")
    ax_s.grid(alpha=0.3)
    bottom = ax_s
    if evals:
        versions = [int(e["version"]) for e in evals]
        if all("final" in e for e in evals):
            finals = [float(e["final"]) for e in evals]
            ax_e.plot(versions, finals, marker="s", markersize=8, linewidth=4.0, color="black", alpha=0.3,
                      label="final answer", zorder=1)
            for v, f in ((versions[0], finals[0]), (versions[-1], finals[-1])):
                ax_e.annotate(f"{f:.2f}", (v, f), textcoords="offset points", xytext=(0, -15), ha="center", fontsize=8)
        markers = ["o", "^", "v", "D", "P", "X"]
        for i, agent in enumerate(sorted({a for e in evals for a in (e.get("pass1") or {})})):
            pts = [(int(e["version"]), float(e["pass1"][agent])) for e in evals if agent in (e.get("pass1") or {})]
            ax_e.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)],
                      linestyle=styles[i % len(styles)], label=f"agent {agent}", zorder=2)
        ax_e.set_ylabel("held-out pass@1")
        ax_e.set_ylim(-0.02, 1.02)
        ax_e.grid(alpha=0.3)
        ax_e.legend(fontsize=8)
        bottom = ax_e
    bottom.set_xlabel("version (optimizer steps)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
