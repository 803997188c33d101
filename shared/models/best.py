"""The best held-out version of a run, kept in its directory beside the last one.

``checkpoints/best.json`` holds the evaluation that scored best on the final answer (pass@1, ``final``) and the
version of each model it evaluated; ``checkpoints/<model>/best.weights`` holds that version's flat weights, packed
as the object store holds them (header + buffer, :func:`shared.models.weights.pack`), or nothing for version 0:
the seeded start, which every process builds the same. The coordinator writes both (it runs the evaluations);
``chorus export --version best`` and ``chorus status`` read them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.kernel.files import write_atomic

RECORD = "best.json"
WEIGHTS = "best.weights"


def record_path(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / RECORD


def weights_path(run_dir: Path, model: str) -> Path:
    return run_dir / "checkpoints" / model / WEIGHTS


def staged_path(run_dir: Path, model: str, version: int) -> Path:
    """Where the weights an evaluation is about to score wait until it is known whether they are the best."""
    return run_dir / "checkpoints" / model / f".eval-v{version}.weights"


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The best evaluation so far (``final``, ``versions`` per model, ``version``, ``time``), or None."""
    try:
        rec = json.loads(record_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("versions"), dict) else None


def is_better(rec: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """A complete evaluation (no task failed every attempt) that beats the best so far on the final answer; the
    first one always does."""
    if rec.get("failed"):
        return False
    return best is None or float(rec["final"]) > float(best["final"])


def keep(run_dir: Path, rec: dict[str, Any], staged: dict[str, Path | None], versions: dict[str, int]) -> None:
    """Make the staged weights (of ``versions``, which evaluation ``rec`` scored) the best. Blocking file work:
    call it in a thread. The record is written last: a crash in between leaves the previous record beside newer
    weights, never a record without its weights."""
    record_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    for model, path in staged.items():
        target = weights_path(run_dir, model)
        if path is None:
            target.unlink(missing_ok=True)  # version 0: the seeded start
        else:
            os.replace(path, target)
    best = {"final": rec["final"], "pass1": rec["pass1"], "versions": versions, "version_max": rec["version_max"],
            "time": rec["time"]}
    write_atomic(record_path(run_dir), json.dumps(best, indent=2) + "\n")


def discard(staged: dict[str, Path | None]) -> None:
    for path in staged.values():
        if path is not None:
            path.unlink(missing_ok=True)
