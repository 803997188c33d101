"""`chorus eval`: a model played on a split without training, in one process, its record as a run's evaluation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHORUS = str(Path(sys.executable).parent / "chorus")


def chorus(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHORUS, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_chorus_eval_of_a_config_prints_pass_at_1_and_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    done = chorus("eval", str(ROOT / "configs" / "tiny-chain.yaml"), "--tasks", "8", "--samples", "4",
                  "--temperature", "1.0", "--batch", "4", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass@1" in done.stdout and f"wrote {out}" in " ".join(done.stdout.split()), done.stdout
    rec = json.loads(out.read_text())
    assert rec["n"] == 8 and rec["samples"] == 4 and rec["split"] == "heldout" and rec["label"] == "base", rec
    assert len(rec["final_by_task"]) == 8 and rec["tokens_total"] > 0 and rec["seconds"] > 0, rec
    # pass@1 is the mean over tasks of each task's share of right final answers
    assert abs(rec["final"] - sum(rec["final_by_task"]) / 8) < 1e-3, rec
    assert set(rec["pass_at_k"]["final"]) >= {"1", "2", "4"}, rec["pass_at_k"]
    # the vote of the 4 samples, one row per answer (no dict printed into the table)
    assert "maj@4 (final answer)" in done.stdout and "{'final'" not in done.stdout, done.stdout


def test_chorus_eval_of_a_split_the_task_does_not_have_exits_2(tmp_path: Path) -> None:
    done = chorus("eval", str(ROOT / "configs" / "tiny-chain.yaml"), "--split", "test", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--split test" in done.stderr, done.stderr
