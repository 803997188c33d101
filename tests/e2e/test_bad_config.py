"""A run checks what it was given before it starts: what a new user met, each reproduced with the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHORUS = str(BIN / "chorus")
EX_RUN_FAILED = 78


def write_config(tmp_path: Path, **changes: Any) -> Path:
    """configs/tiny-chain.yaml with ``changes`` merged over it, its runs under ``tmp_path``."""
    data = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    data["run"]["dir"] = str(tmp_path / "runs")
    for section, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(section), dict):
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(data[section].get(k), dict):
                    data[section][k] = {**data[section][k], **v}
                else:
                    data[section][k] = v
        else:
            data[section] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def chorus(*args: str, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    done = subprocess.run([CHORUS, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "COLUMNS": "250"})
    return done.returncode, done.stdout + done.stderr


def no_service_started(tmp_path: Path) -> bool:
    runs = tmp_path / "runs"
    return not any(runs.glob("*/logs/*.log")) if runs.exists() else True


def test_a_model_directory_that_does_not_exist_exits_2_naming_it_before_any_service_starts(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    cfg = write_config(tmp_path, models={"solver_lm": {"source": "hf", "path": str(missing)}})
    code, out = chorus("up", str(cfg), cwd=tmp_path)
    assert code == 2, out
    assert f"models.solver_lm.path: {missing}" in " ".join(out.split()), out
    assert no_service_started(tmp_path), list((tmp_path / "runs").rglob("*.log"))


def test_a_missing_dataset_and_a_missing_workflow_function_stop_the_run_before_any_service_starts(
        tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text("async def other(ctx, task):\n    return {}\n")
    cfg = write_config(tmp_path, task={"name": "jsonl", "path": "no-such-data.jsonl"},
                       workflow={"name": "custom", "function": "flow.py:critique", "agents": []})
    code, out = chorus("up", str(cfg), cwd=ROOT)
    flat = " ".join(out.split())
    assert code == 2, out
    assert "2 problem(s); nothing was started" in flat, out
    assert f"task.path: cannot read the dataset {tmp_path / 'no-such-data.jsonl'}" in flat, out
    assert "workflow.function" in flat and "critique" in flat, out
    assert no_service_started(tmp_path), list((tmp_path / "runs").rglob("*.log"))


def test_chorus_check_names_every_problem_of_a_config(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 1.0\n")
    cfg = write_config(tmp_path, models={"solver_lm": {"source": "hf", "path": "missing-model"}},
                       task={"name": "jsonl", "path": "missing.jsonl"},
                       reward={"function": "reward.py:compute_score"})
    code, out = chorus("check", str(cfg), cwd=tmp_path)
    flat = " ".join(out.split())
    assert code == 2 and "3 problem(s)" in flat, out
    assert "models.solver_lm.path" in flat and "missing.jsonl" in flat and "compute_score" in flat, out
    good = write_config(tmp_path)
    code, out = chorus("check", str(good), cwd=tmp_path)
    assert code == 0 and ": ok (2 model(s)" in out, out


def test_chorus_check_refuses_verl_rows_whose_data_source_has_no_grader(tmp_path: Path) -> None:
    rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": "1"}} for i, source in enumerate(["lighteval/MATH", "my/puzzles"] * 4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path, task={"name": "verl", "path": "rows.jsonl", "heldout": 2})
    code, out = chorus("check", str(cfg), cwd=tmp_path)
    flat = " ".join(out.split())
    assert code == 2 and "task.path: no built-in grader for data_source 'my/puzzles' (4 rows)" in flat, out
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 1.0\n")
    with_fn = write_config(tmp_path, task={"name": "verl", "path": "rows.jsonl", "heldout": 2},
                           reward={"function": "reward.py:compute_score"})
    code, out = chorus("check", str(with_fn), cwd=tmp_path)
    assert code == 0, out


def test_chorus_check_calls_the_reward_function_once_and_reports_one_that_raises(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text("def boom(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    raise RuntimeError('no reward today')\n"
                                        "def half(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 0.5\n")
    cfg = write_config(tmp_path, reward={"function": "reward.py:boom"})
    code, out = chorus("check", str(cfg), cwd=tmp_path)
    flat = " ".join(out.split())
    assert code == 2 and "raised RuntimeError: no reward today" in flat and "called once on a row of the task" in flat, out
    print(out)
    cfg = write_config(tmp_path, reward={"function": "reward.py:half"})
    code, out = chorus("check", str(cfg), cwd=tmp_path)
    flat = " ".join(out.split())
    assert code == 0 and "reward.function: half(data_source='arithmetic'" in flat and "returned reward 0.5" in flat, out
    print(out)


def test_a_relative_task_path_is_read_beside_the_config_file(tmp_path: Path) -> None:
    from shared.kernel.config import load_config

    here = tmp_path / "project"
    here.mkdir()
    (here / "qa.jsonl").write_text("".join(f'{{"question": "{a}+{b}=", "answer": "{a + b}"}}\n'
                                           for a in range(4) for b in range(4)))
    cfg = write_config(here, task={"name": "jsonl", "path": "qa.jsonl", "heldout": 4})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out = chorus("check", str(cfg), cwd=elsewhere)
    assert code == 0, out
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        assert load_config(cfg).task.path == here / "qa.jsonl"
    finally:
        os.chdir(cwd)


def test_a_service_whose_model_directory_is_missing_exits_78_naming_it_not_the_broker(
        tmp_path: Path, nats_url: str, run_id: str) -> None:
    missing = tmp_path / "gone"
    cfg = write_config(tmp_path, run={"id": run_id}, models={"solver_lm": {"source": "hf", "path": str(missing)}})
    done = subprocess.run([sys.executable, "-m", "services.trainer", "--config", str(cfg), "--model", "solver_lm",
                           "--nats", nats_url], capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == EX_RUN_FAILED, out[-3000:]
    assert str(missing) in out and "the broker did not answer" not in out, out[-3000:]


def test_a_resumed_run_whose_dataset_is_gone_exits_2_before_any_service_starts(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    cfg = write_config(tmp_path, run={"id": "gone-20260101-000000"}, task={"name": "jsonl", "path": str(data)})
    run_dir = tmp_path / "runs" / "gone-20260101-000000"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.read_text())  # the run's saved config; its dataset was removed since
    code, out = chorus("up", "--resume", str(run_dir), cwd=tmp_path)
    flat = " ".join(out.split())
    assert code == 2, out
    assert f"task.path: cannot read the dataset {data}" in flat, out
    assert no_service_started(tmp_path), list((tmp_path / "runs").rglob("*.log"))
