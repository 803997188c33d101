"""`chorus up` with the solver -> coder -> refiner workflow on code tasks: the coder's and refiner's programs run in
the actions service under Chorus's scheduler (the default: ARL-Tangram's with Chorus's extensions), and `chorus status` of the live run shows
the action completion times (queue, execution, overhead) of run_code."""

from __future__ import annotations

import asyncio
import os
import subprocess

import yaml

from tests.e2e.conftest import CHORUS, chorus_up, small_run_config


async def test_solver_coder_refiner_runs_its_code_through_the_action_scheduler_and_status_shows_its_acts(
        nats_url, run_id, tmp_path):
    cfg_path = small_run_config(tmp_path, run_id, {
        "agents": {"solver": {"model": "solver_lm", "prompt": ""}, "coder": {"model": "verifier_lm", "prompt": ""},
                   "refiner": {"model": "solver_lm", "prompt": ""}},
        "workflow": {"name": "solver_coder_refiner", "agents": ["solver", "coder", "refiner"], "group_size": 4,
                     "concurrency": 4, "max_new_tokens": 8},
        "task": {"name": "code", "max_value": 9},
        "actions": {"cores": 2, "timeout_s": 5.0},
    }, max_versions=6, global_batch=8, micro_batch=8)
    data = yaml.safe_load(cfg_path.read_text())
    for key in ("solver", "verifier"):  # solve_verify's roles: not this workflow's
        data["workflow"].pop(key, None)
    data["agents"].pop("verifier", None)
    for model in data["models"].values():  # a code task's prompt is longer than tiny-chain's context
        model["arch"]["max_position"] = 512
    cfg_path.write_text(yaml.safe_dump(data))

    up = asyncio.create_task(chorus_up(cfg_path, nats_url, 300))
    seen = ""
    try:
        for _ in range(600):
            await asyncio.sleep(0.5)
            runs = sorted((tmp_path / "runs").glob(f"{run_id}-*/config.yaml"))
            if up.done() or not runs:
                continue
            out = await asyncio.to_thread(subprocess.run, [CHORUS, "status", "--config", str(runs[-1]), "--nats",
                                                           nats_url], capture_output=True, text=True, timeout=60,
                                          env={**os.environ, "COLUMNS": "200"})
            seen = out.stdout
            if "run_code" in seen:
                break
    finally:
        code, text = await up
    assert code == 0, text[-4000:]
    assert "action completion time (ACT)" in seen, seen
    row = next(line for line in seen.splitlines() if "run_code" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    kind = cells[cells.index("run_code"):]
    n, mean, p50, p99, queue, exe, overhead = int(kind[1]), *(float(x) for x in kind[2:8])
    assert n > 0 and exe > 0 and p50 <= p99 and abs(queue + exe + overhead - mean) < 2e-3, row
    assert "chorus" in seen  # the scheduler column
