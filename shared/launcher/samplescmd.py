"""``chorus samples RUN``: what the agents said, from the coordinator's samples.jsonl (services/coordinator/samples.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.text import Text

# The coordinator's file names (services/coordinator/samples.py): the older file first.
FILES = ("samples.1.jsonl", "samples.jsonl")


def sample_files(run_dir: Path) -> list[Path]:
    return [run_dir / name for name in FILES if (run_dir / name).is_file()]


def read_lines(run_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(raw line, record) of every readable record, oldest first; a torn or foreign line is skipped."""
    out: list[tuple[str, dict[str, Any]]] = []
    for p in sample_files(run_dir):
        for line in p.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("turns"), list):
                out.append((line, rec))
    return out


def matches(rec: dict[str, Any], model: str | None, agent: str | None) -> bool:
    """A record with a turn of ``model`` and a turn of ``agent`` (either unset: any)."""
    turns = [t for t in rec["turns"] if isinstance(t, dict)]
    return ((model is None or any(t.get("model") == model for t in turns))
            and (agent is None or any(t.get("agent") == agent for t in turns)))


def select(lines: Iterable[tuple[str, dict[str, Any]]], model: str | None = None, agent: str | None = None,
           last: int = 5) -> list[tuple[str, dict[str, Any]]]:
    kept = [(line, rec) for line, rec in lines if matches(rec, model, agent)]
    return kept[-last:] if last > 0 else []


def _num(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, int | float) and not isinstance(v, bool) else str(v)


def render(rec: dict[str, Any]) -> RenderableType:
    """One episode: the question and reference, then each turn: agent (model), reward, answer, prompt tail, response."""
    parts: list[RenderableType] = []
    head = Text()
    head.append("Q: ", style="bold")
    head.append(str(rec.get("question", "")))
    head.append("   reference: ", style="bold")
    head.append(str(rec.get("reference", "")), style="green")
    parts.append(head)
    for t in rec["turns"]:
        if not isinstance(t, dict):
            continue
        line = Text()
        line.append(f"{t.get('agent')} ", style="bold cyan")
        line.append(f"({t.get('model')}", style="cyan")
        line.append(f" v{t['version']})" if t.get("version") is not None else ")", style="cyan")
        line.append("  reward ")
        line.append(_num(t.get("reward")), style="green" if t.get("correct") else "yellow")
        line.append(f"  answer {t.get('answer')!r}")
        if t.get("correct") is not None:
            line.append("  right" if t["correct"] else "  wrong", style="green" if t["correct"] else "red")
        if t.get("reward_error"):
            line.append(f"\n  reward_error: {t['reward_error']}", style="red")
        parts.append(line)
        if t.get("prompt_tail"):
            parts.append(Text("  ..." + str(t["prompt_tail"]), style="dim"))
        parts.append(Text("  > " + str(t.get("response", ""))))
    title = (f"task {rec.get('task_id')} rollout {rec.get('rollout')}" + (" [eval]" if rec.get("eval") else "")
             + f"  versions {rec.get('versions')}")
    return Panel(Group(*parts), title=title, title_align="left", highlight=False)


def show(console: Console, err: Console, run_dir: Path, *, model: str | None, agent: str | None, last: int, as_json: bool) -> int:
    """Print the last ``last`` matching records (``as_json``: their lines as written); the exit code (1: no samples
    file; the error goes to ``err``)."""
    if not sample_files(run_dir):
        err.print(f"[red]error:[/] {run_dir / FILES[1]} does not exist: the coordinator writes it when "
                      "logging.samples_every > 0 (default 10; 0 turns it off)", highlight=False)
        return 1
    picked = select(read_lines(run_dir), model, agent, last)
    if as_json:
        for line, _ in picked:
            print(line)
        return 0
    if not picked:
        console.print(f"no samples in {run_dir} match" + (f" --model {model}" if model else "")
                      + (f" --agent {agent}" if agent else ""), highlight=False)
        return 0
    for _, rec in picked:
        console.print(render(rec))
    return 0
