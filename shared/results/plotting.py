"""Reward curves, the loss's statistics and run summaries from a run's ``metrics.jsonl``.

The file holds one trainer step record per line (``model``, ``version``, ``reward_mean``, ``grad_norm``,
``clip_frac``, ``approx_kl_mu``, ``entropy`` ... docs/algorithms.md) and, when evaluation is on, held-out
evaluation records (``"kind": "eval"``, ``version``, ``pass1`` per agent, ``final`` for the workflow's final
answer, ``pass_at_k``, ``maj``, ``tokens_per_question``, ``tokens_generated``) and the coordinator's generated
tokens against the trained versions (``"kind": "generated"``, services/coordinator/generated.py).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

SUMMARY_FRACTION = 0.2  # first/last 20% of a model's steps
GENERATED = "generated"  # the kind of the coordinator's generated-tokens lines


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


def _records(path: str | os.PathLike[str], kind: str, key: str) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` of ``"kind": kind`` that have ``key``, in file order; a line cut short by a crash
    is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        if f'"{kind}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind and key in rec:
            out.append(rec)
    return out


def load_critic(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """MARFT's critic step lines (``"kind": "critic_step"``: version, value_loss, explained_variance, ...)."""
    return _records(path, "critic_step", "version")


def load_evals(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Held-out evaluation records, in version order."""
    return sorted(_records(path, "eval", "version"), key=lambda r: (int(r["version"]), float(r.get("time", 0.0))))


def load_generated(metrics: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every ``generated`` line of ``metrics`` (tokens generated against the trained versions), in file order."""
    return [r for r in _records(metrics, GENERATED, "versions") if isinstance(r["versions"], dict)]


def last_generated(metrics: str | os.PathLike[str]) -> tuple[int, int]:
    """(tokens_generated, tasks) of the last ``generated`` line of ``metrics`` ((0, 0) when there is none)."""
    try:
        lines = load_generated(metrics)
    except FileNotFoundError:
        return 0, 0
    return (int(lines[-1].get("tokens_generated", 0)), int(lines[-1].get("tasks", 0))) if lines else (0, 0)


def eval_table_rows(evals: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(what, first, last) of the first and last evaluation: per-agent pass@1 and the final answer's, then (when
    the records have them) the final answer's pass@k for k > 1, its Maj@N and the tokens per question."""
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    rows = [(f"agent {a}", float(first["pass1"][a]), float(last["pass1"][a]))
            for a in sorted(first.get("pass1") or {}) if a in (last.get("pass1") or {})]
    if "final" in first and "final" in last:
        rows.append(("final answer", float(first["final"]), float(last["final"])))
    k_first = (first.get("pass_at_k") or {}).get("final") or {}
    k_last = (last.get("pass_at_k") or {}).get("final") or {}
    for k in sorted((set(k_first) & set(k_last)) - {"1"}, key=int):
        rows.append((f"final answer pass@{k}", float(k_first[k]), float(k_last[k])))
    n = last.get("samples", 1)
    maj_first, maj_last = (first.get("maj") or {}).get("final"), (last.get("maj") or {}).get("final")
    if isinstance(n, int) and n > 1 and maj_first is not None and maj_last is not None:
        rows.append((f"final answer Maj@{n}", float(maj_first), float(maj_last)))
    tok_first = (first.get("tokens_per_question") or {}).get("total")
    tok_last = (last.get("tokens_per_question") or {}).get("total")
    if tok_first is not None and tok_last is not None:
        rows.append(("tokens per question", float(tok_first), float(tok_last)))
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
    return summarize_steps(by_model(load_metrics(metrics_path)))


def summarize_steps(steps: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """:func:`summarize` of step records already grouped by model (:func:`by_model`)."""
    summary: dict[str, dict[str, float]] = {}
    for model, recs in steps.items():
        rewards = [float(r["reward_mean"]) for r in recs]
        k = max(1, int(len(rewards) * SUMMARY_FRACTION))
        first, last = _mean(rewards[:k]), _mean(rewards[-k:])
        cut = [float(r["truncated"]) for r in recs if isinstance(r.get("truncated"), int | float)]
        summary[model] = {"steps": len(rewards), "first": first, "last": last, "delta": last - first,
                          **({"truncated": _mean(cut)} if cut else {})}
    return summary


def _figure_inputs(metrics_path: str | os.PathLike[str], out_path: str | os.PathLike[str] | None,
                   default_name: str) -> tuple[Any, Path, Path, dict[str, list[dict[str, Any]]]]:
    """pyplot (on the file-only Agg backend), the metrics path, the PNG path (default: ``default_name`` next to
    metrics.jsonl) and the step records by model; a ValueError when there is no step record."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    metrics_path = Path(metrics_path)
    out = Path(out_path) if out_path is not None else metrics_path.parent / default_name
    models = by_model(load_metrics(metrics_path))
    if not models:
        raise ValueError(f"{metrics_path} has no step records (lines with model, version, reward_mean)")
    return plt, metrics_path, out, models


def plot_run(metrics_path: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None) -> Path:
    """Write a PNG: reward_mean per version (one line per model, per-agent rewards dashed) above
    staleness_mean per version. Returns the PNG path (default: next to metrics.jsonl, reward.png)."""
    plt, metrics_path, out, models = _figure_inputs(metrics_path, out_path, "reward.png")
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
        n = evals[-1].get("samples", 1)
        ks = sorted({k for e in evals for k in ((e.get("pass_at_k") or {}).get("final") or {})} - {"1"}, key=int)
        for k in ks:
            pts = [(int(e["version"]), float(e["pass_at_k"]["final"][k])) for e in evals
                   if k in ((e.get("pass_at_k") or {}).get("final") or {})]
            ax_e.plot([p[0] for p in pts], [p[1] for p in pts], color="black", linestyle=":", marker=".",
                      alpha=0.4 + 0.5 * int(k) / max(int(ks[-1]), 1), label=f"final answer pass@{k}")
        if isinstance(n, int) and n > 1:
            pts = [(int(e["version"]), float(e["maj"]["final"])) for e in evals if "final" in (e.get("maj") or {})]
            if pts:
                ax_e.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:red", linestyle="--", marker="*",
                          label=f"final answer Maj@{n}")
        markers = ["o", "^", "v", "D", "P", "X"]
        for i, agent in enumerate(sorted({a for e in evals for a in (e.get("pass1") or {})})):
            pts = [(int(e["version"]), float(e["pass1"][agent])) for e in evals if agent in (e.get("pass1") or {})]
            ax_e.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)],
                      linestyle=styles[i % len(styles)], label=f"agent {agent}", zorder=2)
        n = evals[-1].get("samples", 1)
        ax_e.set_ylabel("held-out pass@1" + (f"\n(mean of {n})" if isinstance(n, int) and n > 1 else ""))
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


# Panels of the training figure: (title, [(step record key, label)]); a panel whose keys no record holds is left out.
TRAINING_PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("gradient norm (before clipping)", [("grad_norm", "grad_norm")]),
    ("clipped tokens (fraction)", [("clip_frac", "clip_frac"), ("dual_clip_frac", "dual_clip_frac"),
                                   ("is_weight_capped_frac", "IS weight capped")]),
    ("KL estimates (token mean)", [("approx_kl_mu", "to mu (k1)"), ("approx_kl_prox", "to pi_prox (k1)"),
                                   ("kl_ref", "to the reference"), ("approx_kl", "MARFT's cut test (k3 to mu)")]),
    ("entropy (token mean)", [("entropy", "entropy")]),
    ("importance weights", [("is_weight_mean", "mean"), ("is_weight_max", "max"), ("ratio_mean", "ratio mean")]),
    ("skipped steps (non-finite gradient)", [("steps_skipped", "skipped, cumulative")]),
    ("MARFT: steps cut by the trust region", [("kl_cut", "cut (1) or taken (0)")]),
]


Series = tuple[str, str | None, list[int], list[float]]  # (label, model or None, versions, values)


def training_panels(metrics_path: str | os.PathLike[str],
                    models: dict[str, list[dict[str, Any]]] | None = None) -> list[tuple[str, list[Series]]]:
    """What :func:`plot_training` draws: per panel its title and series, from the step records (one series per
    model and key, smoothed over :func:`smoothing_window` steps) and the evaluations' tokens per question (one per
    agent, and ``total``). Panels without data are left out. ``models``: the step records by model, when the
    caller has read them already."""
    models = by_model(load_metrics(metrics_path)) if models is None else models
    out: list[tuple[str, list[Series]]] = []
    for title, keys in TRAINING_PANELS:
        series: list[Series] = []
        for model, rs in models.items():
            for key, label in keys:
                pts = [(int(r["version"]), float(r[key])) for r in rs if isinstance(r.get(key), int | float)]
                if pts:
                    series.append((label, model, [p[0] for p in pts],
                                   rolling_mean([p[1] for p in pts], smoothing_window(len(pts)))))
        if series:
            out.append((title, series))
    evals = [e for e in load_evals(metrics_path) if isinstance(e.get("tokens_per_question"), dict)]
    names = sorted({a for e in evals for a in e["tokens_per_question"]}, key=lambda a: (a == "total", a))
    tokens: list[Series] = []
    for name in names:
        pts = [(int(e["version"]), float(e["tokens_per_question"][name])) for e in evals
               if isinstance(e["tokens_per_question"].get(name), int | float)]
        tokens.append((name, None, [p[0] for p in pts], [p[1] for p in pts]))
    if tokens:
        out.append(("held-out tokens generated per question (one rollout)", tokens))
    critic = load_critic(metrics_path)
    for key, title in (("value_loss", "MARFT critic: value loss (x: critic version)"),
                       ("explained_variance", "MARFT critic: explained variance (x: critic version)")):
        pts = [(int(r["version"]), float(r[key])) for r in critic if isinstance(r.get(key), int | float)]
        if pts:
            out.append((title, [(key.replace("_", " "), None, [p[0] for p in pts],
                                 rolling_mean([p[1] for p in pts], smoothing_window(len(pts))))]))
    return out


def plot_training(metrics_path: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None) -> Path:
    """Write a PNG of the loss's statistics per version, one line per model (docs/algorithms.md#metrics-of-a-step),
    and, when evaluation is on, the held-out tokens generated per question. Default: next to metrics.jsonl,
    training.png."""
    plt, metrics_path, out, models = _figure_inputs(metrics_path, out_path, "training.png")
    panels = training_panels(metrics_path, models)
    if not panels:
        raise ValueError(f"{metrics_path}: the step records hold none of the loss's statistics")
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.8 * rows + 0.6), squeeze=False)
    flat = [ax for row in axes for ax in row]
    colors = {m: f"C{i}" for i, m in enumerate(models)}
    styles = ["-", "--", ":"]
    for ax, (title, series) in zip(flat, panels, strict=False):
        labels = sorted({lab for lab, _, _, _ in series})
        for j, (label, model, xs, ys) in enumerate(series):
            if model is None:  # tokens per question: one line per agent, the total in black
                ax.plot(xs, ys, marker="o", linewidth=2.5 if label == "total" else 1.2,
                        color="black" if label == "total" else f"C{j}", label=label)
            else:
                ax.plot(xs, ys, color=colors[model], linestyle=styles[labels.index(label) % len(styles)],
                        linewidth=1.3, label=f"{model}: {label}" if len(labels) > 1 or len(models) > 1 else label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("version", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"Chorus run {metrics_path.parent.name}: the loss's statistics (mean of "
                 f"{smoothing_window(max(len(rs) for rs in models.values()))} steps)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
