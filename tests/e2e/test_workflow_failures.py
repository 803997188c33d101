"""A user's workflow that keeps raising stops a `chorus up` run with its error, logged once, not restarted."""

from __future__ import annotations

import json

import yaml

from tests.e2e.conftest import chorus_up, small_run_config

MAX_FAILURES = 6

RAISING = '''
async def broken(ctx, task):
    outs = await ctx.generate("solver", [task.question])
    lookup = {}
    return lookup["answer for " + task.task_id]  # a different message every task: still one error
'''


async def test_a_workflow_that_raises_stops_the_run_with_its_error_after_max_failures(nats_url, run_id, tmp_path):
    (tmp_path / "broken.py").write_text(RAISING)
    path = small_run_config(tmp_path, run_id, max_versions=50)
    cfg = yaml.safe_load(path.read_text())
    cfg["workflow"] = {**cfg["workflow"], "name": "custom", "function": f"{tmp_path / 'broken.py'}:broken",
                       "agents": ["solver"], "max_failures": MAX_FAILURES, "retries": 1, "backoff_s": 0.05,
                       "backoff_max_s": 0.2}
    for key in ("rounds", "echo_chars"):
        cfg["workflow"].pop(key, None)
    path.write_text(yaml.safe_dump(cfg))
    code, text = await chorus_up(path, nats_url, 240)
    assert code == 1, text[-4000:]
    assert "coordinator-0 stopped the run (exit 78" in text, text[-4000:]
    assert "restarting it in" not in text  # a failing workflow is not a crash to restart
    run_dir = sorted((tmp_path / "runs").glob(f"{run_id}-*"))[-1]
    log = (run_dir / "logs" / "coordinator-0.log").read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    failed = [e for e in lines if e.get("event", "").startswith("workflow failed")]
    stopping = [e for e in lines if e.get("event", "").startswith("stopping the run")]
    assert len(failed) == 1, failed  # one distinct error, however many tasks hit it
    assert "KeyError" in failed[0]["error"] and failed[0]["key"].startswith("KeyError at ")
    assert len(stopping) == 1 and f"failed {MAX_FAILURES} times" in stopping[0]["event"], stopping
    assert "KeyError" in stopping[0]["event"]
    assert len(log) < 64 * 1024, f"coordinator log grew to {len(log)} bytes"


async def test_prompts_longer_than_the_models_context_stop_the_run_with_the_rollouters_reason(nats_url, run_id,
                                                                                            tmp_path):
    """A request the rollouter rejects for good is the workflow's error, not a transient one to retry."""
    path = small_run_config(tmp_path, run_id, {"task": {"name": "code", "max_value": 9}}, max_versions=50)
    cfg = yaml.safe_load(path.read_text())
    cfg["workflow"] = {**cfg["workflow"], "max_failures": 4, "retries": 0, "backoff_s": 0.05, "backoff_max_s": 0.2}
    path.write_text(yaml.safe_dump(cfg))  # tiny-chain's 128-token context: a code task's prompt does not fit
    code, text = await chorus_up(path, nats_url, 240)
    assert code == 1, text[-4000:]
    run_dir = sorted((tmp_path / "runs").glob(f"{run_id}-*"))[-1]
    lines = [json.loads(line) for line in (run_dir / "logs" / "coordinator-0.log").read_text().splitlines()
             if line.startswith("{")]
    stopping = [e for e in lines if e.get("event", "").startswith("stopping the run")]
    # the rollouter's reason, whichever of the two a prompt meets: over the context, or all of it
    reasons = ("more than the model's context of 128", "the whole of the model's context: no room to generate")
    assert len(stopping) == 1 and any(r in stopping[0]["event"] for r in reasons), stopping
    assert not [e for e in lines if e.get("event") == "bad generation reply"]  # never retried as transient
