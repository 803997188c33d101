"""The papers' claims on a public task, measured at this machine's scale: MARTI's trained debate against the single
agent at the same inference budget (Table 2), AT-GRPO's per-(agent, turn) groups against plain GRPO's per-task
group (PettingLLMs), and MARTI's reward shaping against none (Table 4).

    python loadtests/claims.py probe                      # base held-out pass@1 of the candidate tasks
    python loadtests/claims.py run --arm single --seed 0  # one arm and seed: train to the budget, score, append
    python loadtests/claims.py run --all                  # every arm and seed not yet in --out, in turn
    python loadtests/claims.py summary                    # every part: the table, the plots, the claims line

The task is reasoning-gym's ``chain_sum`` with two one-digit terms ("State the final answer to the following
arithmetic problem: 8 - 2 ="; `probe` shows why this one). Every arm is the embedded SmolLM2-135M-Instruct with one
LoRA adapter per agent, the same task stream and held-out set of its seed, the same optimizer, constant learning
rate, global batch and micro-batch (16 samples), group size, sampling temperature and length limit; they differ only
in what the claim is about:

- ``single``: one agent (workflow ``chain`` of one), trained alone;
- ``mad``: MARTI's MAD 2x2, a debate of two agents over two rounds (the final answer is the last round's majority,
  a tie going to the first agent), with MARTI's quality reward shaping and AT-GRPO's groups;
- ``mad_grpo``: ``mad`` with plain GRPO's group, every agent and turn of a task together (claim b);
- ``mad_noshape``: ``mad`` without reward shaping (claim c).

The budget is generated tokens, counted by Chorus itself: the coordinator's ``generated`` lines in the run's
metrics.jsonl (every response token of every training rollout, against the versions trained). One invocation runs
one arm and seed with ``chorus up``, a checkpoint at every version, and stops the run (SIGINT, a graceful stop) once
a version was trained on ``--budget`` tokens. It then scores with ``chorus eval`` the checkpoints where the run
first reached 0, 1/3, 2/3 and all of the budget, on the seed's ``HELDOUT`` held-out tasks: greedy pass@1 of the
final answer (the team's vote, the single agent's answer; version 0 is scored once per workflow and seed); for the
single agent at the budget also 4 samples at the training temperature, which give its Majority@4 (MARTI's equal
inference budget: MAD 2x2 generates 4 answers per question) and its sampled pass@1. One JSON line per part goes to ``--out``; ``summary`` reads
every line, prints each arm's mean and min-max over seeds at the budget, draws one plot per claim, and ends with
``claims team_vs_single=<x> team_vs_majority=<y> atgrpo_vs_grpo=<z> shaping_vs_none=<w>``: each the difference of
the medians over seeds at the budget (first arm minus second, in held-out accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from shared.results.plotting import load_generated, load_metrics  # noqa: E402

CHORUS = str(Path(sys.executable).parent / "chorus")
ARMS = ("single", "mad", "mad_grpo", "mad_noshape")
SEEDS = (0, 1, 2)
BUDGET = 12_000  # generated response tokens at which every arm is scored
FRACTIONS = (0.0, 1 / 3, 2 / 3, 1.0)  # of the budget: the points of the held-out curve
HELDOUT = 200
PROMPT = "Reply with only the answer between <answer> and </answer>."
TEMPERATURE = 0.7
TASK: dict[str, Any] = {"name": "reasoning_gym", "dataset": "chain_sum",
                        "dataset_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                        "instruction": "", "answer": "flexible"}
# probe: candidate tasks (reasoning-gym dataset, its config); the one chosen is TASK
CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = {
    "chain_sum 2x1": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "chain_sum 3x1": ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    "chain_sum 2x2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
    "basic_arithmetic 2x1": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "letter_counting": ("letter_counting", {}),
    "leg_counting": ("leg_counting", {}),
}
# claim -> (first arm, its score, second arm, its score): the claim is that the first beats the second
CLAIMS = {
    "team_vs_single": ("mad", "final", "single", "final"),
    "team_vs_majority": ("mad", "final", "single", "maj4"),
    "atgrpo_vs_grpo": ("mad", "final", "mad_grpo", "final"),
    "shaping_vs_none": ("mad", "final", "mad_noshape", "final"),
}
PAPERS = {  # the papers' own figures for each claim (first arm, second arm), quoted in docs/results.md
    "team_vs_single": "MARTI Table 2, Llama-3.2-3B avg: MAD 2x2 + RL 32.1 vs single + RL 28.7",
    "team_vs_majority": "MARTI Table 2: MAD 2x2 + RL 32.1 vs single Maj@4 + RL 30.0",
    "atgrpo_vs_grpo": "PettingLLMs: no MAS + plain-GRPO row (Tables 1-2 compare MAS + AT-GRPO with single + GRPO)",
    "shaping_vs_none": "MARTI Table 4, Qwen2.5-3B avg: MAD 45.6 with shaping vs 36.6 without",
}


def arm_config(arm: str, seed: int, run_dir: Path, task: dict[str, Any] | None = None,
               max_versions: int = 1000) -> dict[str, Any]:
    """The run config of one arm and seed (``task``: another task for ``probe``)."""
    if arm not in ARMS:
        raise SystemExit(f"--arm {arm!r}: expected one of {', '.join(ARMS)}")
    team = arm != "single"
    agents = ["alice", "bob"] if team else ["solver"]
    workflow: dict[str, Any] = {"name": "debate", "agents": agents, "rounds": 2} if team else \
        {"name": "chain", "agents": agents, "rounds": 1}
    return {
        "run": {"id": f"claims-{arm}-s{seed}", "dir": str(run_dir), "seed": seed},
        "models": {"smol": {
            "source": "smollm2",
            "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
            "rollouter": {"instances": 1, "max_batch": 32, "batch_window_ms": 20.0, "threads": 1},
            "optim": {"lr": 1.0e-3, "weight_decay": 0.0, "grad_clip": 1.0, "schedule": "constant"},
        }},
        "agents": {a: {"model": "smol", "adapter": a, "prompt": PROMPT} for a in agents},
        "workflow": {**workflow, "concurrency": 2, "group_size": 4, "max_new_tokens": 16,
                     "temperature": TEMPERATURE},
        "task": {**(task or TASK), "heldout": HELDOUT},
        "reward": {"shaping": "quality" if arm in ("mad", "mad_grpo") else "none"},
        "eval": {"every": 0, "tasks": HELDOUT, "temperature": 0.0},
        "train": {"max_versions": max_versions, "global_batch": 16, "micro_batch": 16, "max_staleness": 1,
                  "checkpoint_every": 1, "threads": 1,
                  "advantage_group": "env" if arm == "mad_grpo" else "agent_turn"},
        "actions": {"cores": 1, "timeout_s": 5.0},
        "metrics_interval_s": 2.0,
    }


def chorus_eval(target: Path, out: Path, *extra: str) -> dict[str, Any]:
    cmd = [CHORUS, "eval", str(target), "--tasks", str(HELDOUT), "--batch", "64", "--out", str(out), *extra]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}")
    return json.loads(out.read_text())


def budget_points(generated: list[dict[str, Any]], budget: float, model: str = "smol") -> dict[float, dict[str, Any]]:
    """Fraction of the budget -> the first generated line (version, tokens) at or past it (fraction 0: version 0)."""
    points: dict[float, dict[str, Any]] = {0.0: {"version": 0, "tokens_generated": 0}}
    for f in FRACTIONS[1:]:
        line = next((g for g in generated if g["tokens_generated"] >= f * budget), None)
        if line is not None:
            points[f] = {"version": int(line["versions"][model]), "tokens_generated": line["tokens_generated"]}
    return points


def budget_checkpoint(run_dir: Path, budget: float, generated: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first generated line at or past the budget, once its version's checkpoint is written; else None."""
    line = next((g for g in generated if g["tokens_generated"] >= budget), None)
    if line is None or not (run_dir / "checkpoints" / "smol" / f"v{line['versions']['smol']}.pt").exists():
        return None
    return line


def train_to_budget(path: Path, run_dir: Path, budget: float, timeout_s: float) -> dict[str, Any]:
    """``chorus up`` until a version trained on ``budget`` generated tokens has its checkpoint, then SIGINT."""
    metrics, t0 = run_dir / "metrics.jsonl", time.monotonic()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    proc = subprocess.Popen([CHORUS, "up", str(path), "--run", run_dir.name], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    reached: dict[str, Any] | None = None
    shown = -1
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout_s:
            time.sleep(2.0)
            gen = load_generated(metrics) if metrics.exists() else []
            if gen and gen[-1]["versions"]["smol"] // 10 != shown:  # a line every 10 versions
                shown = gen[-1]["versions"]["smol"] // 10
                print(f"  {gen[-1]['tokens_generated']:>7,} / {budget:,.0f} tokens generated, version "
                      f"{gen[-1]['versions']['smol']}, {time.monotonic() - t0:5.0f} s", flush=True)
            reached = budget_checkpoint(run_dir, budget, gen)
            if reached is not None:
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    if reached is None:
        raise SystemExit(f"{run_dir}: did not reach {budget:,.0f} generated tokens (chorus up exit {proc.returncode}, "
                         f"{time.monotonic() - t0:.0f} s); see {log.name}")
    return {"up_s": round(time.monotonic() - t0, 1)}


def reached_budget(work: Path, arm: str, seed: int, budget: float) -> Path | None:
    """The latest run of this arm and seed whose checkpoints reach the budget (an interrupted part), if any."""
    for run_dir in sorted((work / "runs").glob(f"claims-{arm}-s{seed}-*"), reverse=True):
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and budget_checkpoint(run_dir, budget, load_generated(metrics)) is not None:
            return run_dir
    return None


def run_part(arm: str, seed: int, budget: float, out: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    trained_before = reached_budget(work, arm, seed, budget)
    if trained_before is not None:  # an interrupted part: its run reached the budget, the evaluations go on
        run_dir, run_id = trained_before, trained_before.name
        print(f"claims: {arm} seed {seed}: {run_dir} reached {budget:,.0f} generated tokens; evaluating", flush=True)
        part: dict[str, Any] = {"arm": arm, "seed": seed, "budget": budget, "run_dir": str(run_dir), "up_s": None}
    else:
        run_id = f"claims-{arm}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg = arm_config(arm, seed, work / "runs")
        path = work / f"{arm}-s{seed}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        run_dir = work / "runs" / run_id
        print(f"claims: {arm} seed {seed}: chorus up {path} to {budget:,.0f} generated tokens", flush=True)
        part = {"arm": arm, "seed": seed, "budget": budget, "run_dir": str(run_dir),
                **train_to_budget(path, run_dir, budget, timeout_s)}
    metrics = run_dir / "metrics.jsonl"
    points = budget_points(load_generated(metrics), budget)
    steps = [r for r in load_metrics(metrics) if r["model"] == "smol"]
    trained = {v: sum(r["tokens"] for r in steps if r["version"] <= v) for v in {p["version"] for p in points.values()}}
    curve = []
    for f, p in sorted(points.items()):
        v = p["version"]
        # the base is the same for every arm of a workflow and seed: scored once
        where = work / (f"base-{'single' if arm == 'single' else 'mad'}-s{seed}.json" if v == 0 else f"{run_id}-v{v}.json")
        rec = json.loads(where.read_text()) if where.exists() else \
            chorus_eval(run_dir, where, "--version", "base" if v == 0 else str(v))
        curve.append({"fraction": f, "version": v, "tokens_generated": p["tokens_generated"],
                      "tokens_trained": trained[v], "final": rec["final"], "pass1": rec["pass1"]})
        print(f"  {f:4.2f} of the budget: v{v} ({p['tokens_generated']:,} generated, {trained[v]:,.0f} trained): "
              f"held-out final {rec['final']:.3f}", flush=True)
    at = curve[-1]
    part.update(version=at["version"], tokens=at["tokens_generated"], tokens_trained=at["tokens_trained"],
                base_final=curve[0]["final"], final=at["final"], steps=len(steps), curve=curve)
    if arm == "single":  # MARTI's equal inference budget: 4 sampled answers, voted
        where = work / f"{run_id}-v{at['version']}-n4.json"
        sampled = json.loads(where.read_text()) if where.exists() else chorus_eval(
            run_dir, where, "--version", str(at["version"]), "--samples", "4", "--temperature", str(TEMPERATURE))
        part.update(pass1_t=sampled["final"], maj4=sampled["maj"]["final"])
    part["seconds"] = round(time.monotonic() - t0, 1)
    with out.open("a") as f:
        f.write(json.dumps(part) + "\n")
    print(f"claims: {arm} seed {seed}: " + json.dumps({k: v for k, v in part.items() if k != "curve"}), flush=True)
    return part


def probe(out: Path, work: Path, seed: int) -> None:
    """Base held-out pass@1 (greedy) of the single agent and the untrained debate on each candidate task."""
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (dataset, conf) in CANDIDATES.items():
        task = {**TASK, "dataset": dataset, "dataset_config": conf}
        rec: dict[str, Any] = {"task": name, "dataset": dataset, "dataset_config": conf, "seed": seed}
        for arm in ("single", "mad"):
            path = work / f"probe-{arm}.yaml"
            path.write_text(yaml.safe_dump(arm_config(arm, seed, work / "runs", task), sort_keys=False))
            r = chorus_eval(path, work / f"probe-{arm}.json")
            rec[arm] = r["final"]
            rec[f"{arm}_tokens_per_question"] = r.get("tokens_per_question")
        rows.append(rec)
        print(f"{name:22} single {rec['single']:.3f}  debate {rec['mad']:.3f}", flush=True)
    with out.open("a") as f:
        for rec in rows:
            f.write(json.dumps(rec) + "\n")


def load_parts(out: Path) -> list[dict[str, Any]]:
    parts: dict[tuple[str, int], dict[str, Any]] = {}
    for line in out.read_text().splitlines() if out.exists() else []:
        p = json.loads(line)
        parts[(p["arm"], p["seed"])] = p  # a part run again replaces the earlier one
    return [parts[k] for k in sorted(parts)]


def scores(parts: list[dict[str, Any]], arm: str, key: str) -> list[float]:
    return [p[key] for p in sorted(parts, key=lambda p: p["seed"]) if p["arm"] == arm and key in p]


def summary(out: Path, plots: Path | None) -> str:
    parts = load_parts(out)
    if not parts:
        raise SystemExit(f"{out}: no parts yet (python loadtests/claims.py run --arm single --seed 0)")
    budgets = sorted({p["budget"] for p in parts})
    print(f"{len(parts)} parts from {out}; held-out accuracy at {', '.join(f'{b:,.0f}' for b in budgets)} generated "
          f"tokens ({HELDOUT} held-out tasks per seed)")
    print(f"{'arm':12} {'score':10} {'seeds':>5} {'mean':>6} {'median':>6} {'min':>6} {'max':>6}  per seed: score (version, "
          "generated tokens)")
    for arm in ARMS:
        for key in ("base_final", "final", "pass1_t", "maj4"):
            vals = scores(parts, arm, key)
            if not vals:
                continue
            per = ", ".join(f"{p[key]:.3f} " + ("(v0, 0)" if key == "base_final" else f"(v{p['version']}, {p['tokens']:,})")
                            for p in parts if p["arm"] == arm and key in p)
            print(f"{arm:12} {key:10} {len(vals):5d} {statistics.mean(vals):6.3f} {statistics.median(vals):6.3f} "
                  f"{min(vals):6.3f} "
                  f"{max(vals):6.3f}  {per}")
    deltas: dict[str, float | None] = {}
    for claim, (a, ka, b, kb) in CLAIMS.items():
        x, y = scores(parts, a, ka), scores(parts, b, kb)
        deltas[claim] = None if not x or not y else statistics.median(x) - statistics.median(y)
        seeds = f"{len(x)} and {len(y)} seeds"
        print(f"{claim:17} {a} {ka} against {b} {kb}: median difference "
              f"{'n/a' if deltas[claim] is None else f'{deltas[claim]:+.3f}'} ({seeds}); paper: {PAPERS[claim]}")
    if plots is not None:
        draw(parts, plots)
    return "claims " + " ".join(f"{k}={'n/a' if v is None else f'{v:+.3f}'}" for k, v in deltas.items())


def draw(parts: list[dict[str, Any]], plots: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    colours = {"single": "tab:blue", "mad": "tab:red", "mad_grpo": "tab:green", "mad_noshape": "tab:purple"}
    names = {"single": "single agent", "mad": "MAD 2x2 (AT-GRPO, shaping)", "mad_grpo": "MAD 2x2, plain GRPO groups",
             "mad_noshape": "MAD 2x2, no shaping"}
    for claim, (a, _, b, _) in CLAIMS.items():
        if claim == "team_vs_majority":
            continue  # drawn with team_vs_single: the single agent's Majority@4 is a cross at the budget
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm in (a, b):
            mine = [p for p in parts if p["arm"] == arm]
            for p in mine:
                xs = [c["tokens_generated"] for c in p["curve"]]
                ax.plot(xs, [c["final"] for c in p["curve"]], color=colours[arm], alpha=0.3, lw=1, marker=".")
            if mine:  # the mean over seeds at each fraction of the budget
                n = min(len(p["curve"]) for p in mine)
                xs = [statistics.mean(p["curve"][i]["tokens_generated"] for p in mine) for i in range(n)]
                ys = [statistics.mean(p["curve"][i]["final"] for p in mine) for i in range(n)]
                ax.plot(xs, ys, color=colours[arm], lw=2.2, label=f"{names[arm]} (mean of {len(mine)} seeds)")
            if claim == "team_vs_single" and arm == "single":
                ax.scatter([p["tokens"] for p in mine if "maj4" in p], [p["maj4"] for p in mine if "maj4" in p],
                           color=colours[arm], marker="x", s=45, label="single agent Majority@4 (each seed)")
        ax.axvline(parts[0]["budget"], color="grey", ls=":", lw=1)
        ax.set_xlabel("generated tokens (training rollouts, Chorus's count)")
        ax.set_ylabel(f"held-out accuracy, final answer ({HELDOUT} tasks, greedy)")
        ax.set_title(f"{claim.replace('_', ' ')}: chain_sum, SmolLM2-135M", fontsize=10)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(plots / f"claims-{claim}.png", dpi=110)
        plt.close(fig)
        print(f"wrote {plots / f'claims-{claim}.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one arm and seed (or --all missing ones) and append its part")
    r.add_argument("--arm", choices=ARMS)
    r.add_argument("--seed", type=int)
    r.add_argument("--all", action="store_true", help="every arm and seed not yet in --out")
    r.add_argument("--budget", type=float, default=BUDGET, help="generated tokens per arm")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take to reach the budget")
    r.add_argument("--out", type=Path, default=ROOT / "loadtests/results/claims.jsonl")
    r.add_argument("--work", type=Path, default=ROOT / "runs/claims")
    p = sub.add_parser("probe", help="base held-out pass@1 of the candidate tasks (single agent and debate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "loadtests/results/claims-probe.jsonl")
    p.add_argument("--work", type=Path, default=ROOT / "runs/claims")
    s = sub.add_parser("summary", help="read every part: the table, the plots, the claims line")
    s.add_argument("--out", type=Path, default=ROOT / "loadtests/results/claims.jsonl")
    s.add_argument("--plots", type=Path, default=ROOT / "docs/img")
    args = ap.parse_args()
    if args.cmd == "summary":
        print(summary(args.out, args.plots))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.cmd == "probe":
        probe(args.out, args.work, args.seed)
        return
    if args.all:
        done = {(p["arm"], p["seed"]) for p in load_parts(args.out)}
        todo = [(a, s) for s in SEEDS for a in ARMS if (a, s) not in done]
    elif args.arm is None or args.seed is None:
        raise SystemExit("run: give --arm and --seed, or --all")
    else:
        todo = [(args.arm, args.seed)]
    for arm, seed in todo:
        run_part(arm, seed, args.budget, args.out, args.work, args.timeout)


if __name__ == "__main__":
    main()
