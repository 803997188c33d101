"""What a new user does in the first hour, as they would do it: `chorus up tiny-chain` by name from the checkout,
watching the live run with the subscriber of docs/operations.md and `chorus monitor --raw`, then, with the run's
server gone, `chorus status` from the run directory and `chorus export --version best`; every line every service
logged is JSON, and a clean shutdown logs no warning."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.waits import wait_until

CHORUS = str(Path(sys.executable).parent / "chorus")
VERSIONS = 40
# The held-out evaluation of the demo, small: the best version is kept and exported.
ENV = {"CHORUS_TRAIN__MAX_VERSIONS": str(VERSIONS), "CHORUS_TASK__HELDOUT": "8", "CHORUS_EVAL__EVERY": "10",
       "CHORUS_EVAL__TASKS": "8", "CHORUS_EVAL__SAMPLES": "4", "CHORUS_EVAL__TEMPERATURE": "1.0",
       "CHORUS_TRAIN__CHECKPOINT_EVERY": "0"}


def docs_subscriber() -> str:
    """The subscriber of docs/operations.md, as a user would copy it."""
    text = (ROOT / "docs" / "operations.md").read_text()
    block = text.split("<!-- subscriber: tested by tests/e2e/test_first_hour.py -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)  # type: ignore[union-attr]


async def run(*args: str, env: dict[str, str], timeout_s: float = 120) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    return int(proc.returncode or 0), out.decode()


async def test_a_new_user_runs_watches_reads_and_exports_the_tiny_chain(tmp_path: Path) -> None:
    env = {**os.environ, **ENV, "CHORUS_RUN__DIR": str(tmp_path / "runs"), "COLUMNS": "200"}
    script = tmp_path / "watch.py"
    script.write_text(docs_subscriber())
    up = await asyncio.create_subprocess_exec(CHORUS, "up", "tiny-chain", "--timeout-s", "900", cwd=ROOT, env=env,
                                              stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert up.stdout is not None
    lines: list[str] = []

    async def read() -> None:
        assert up.stdout is not None
        async for raw in up.stdout:
            lines.append(raw.decode().rstrip("\n"))

    reader = asyncio.create_task(read())
    try:
        head = await wait_until(lambda: [m for line in lines if (m := re.search(
            r"embedded nats-server at (nats://\S+)", line))], "the embedded server's URL printed")
        url = head[0].group(1)
        run_id = next(m.group(1) for line in lines if (m := re.match(r"run (\S+) in ", line)))
        assert run_id.startswith("tiny-chain-"), lines
        # the live run, watched with what the install brings
        password = tmp_path / "runs" / run_id / "nats" / "observer.password"
        watching = asyncio.create_task(run(sys.executable, str(script), url, run_id, str(password), env=env,
                                           timeout_s=600))
        await asyncio.wait([watching, asyncio.create_task(up.wait())], return_when=asyncio.FIRST_COMPLETED)
        assert watching.done(), "the run ended before the subscriber saw three steps:\n" + "\n".join(lines[-60:])
        code, text = watching.result()
        assert code == 0, text
        assert len(re.findall(r"^step (solver_lm|verifier_lm) v\d+ reward \d\.\d{3}$", text, re.M)) >= 3, text
        config = tmp_path / "runs" / run_id / "config.yaml"
        code, text = await run(CHORUS, "monitor", "--config", str(config), "--raw", "events.trainer", "--count", "2",
                               env=env, timeout_s=300)
        assert code == 0, text
        watched = text.strip().splitlines()
        assert len(watched) == 2 and all(w.startswith("events.trainer {") for w in watched), text
        assert all(json.loads(w.split(" ", 1)[1])["kind"] in ("step", "drop", "done") for w in watched), text
        assert await asyncio.wait_for(up.wait(), 900) == 0, "\n".join(lines[-60:])
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()
        await reader
    output = "\n".join(lines)
    assert "starting: each service imports its libraries and loads its model" in output
    assert "every service is up after" in output and "first evaluates version 0 on 8 held-out tasks" in output
    assert re.search(r"^solver_lm: \d+ samples trained", output, re.M), output[-3000:]
    run_dir = tmp_path / "runs" / run_id

    # Every line every service logged is JSON; the clean shutdown logs no warning.
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert len(logs) >= 9, logs
    for log in logs:
        records = [json.loads(line) for line in log.read_text().splitlines()]  # a non-JSON line fails here
        drain = next((i for i, r in enumerate(records) if r.get("event") == "draining"), None)
        assert drain is not None, f"{log.name} has no clean shutdown"
        late = [r for r in records[drain:] if r.get("level") in ("warning", "error", "critical")]
        assert not late, f"{log.name} logged during its clean shutdown: {late}"

    # The server stopped with the run: status reads the run directory.
    code, text = await run(CHORUS, "status", "--config", str(run_dir / "config.yaml"), env=env)
    assert code == 0, text
    flat = " ".join(text.split())
    assert f"run {run_id} finished at" in flat and f"every model reached train.max_versions ({VERSIONS})" in flat
    assert f"{VERSIONS}/{VERSIONS}" in flat and "best held-out version" in flat, text

    # What the agents said: the sampled episodes as text, each turn's reward the task's check of its response.
    from services.actions.actions import score_answer

    code, text = await run(CHORUS, "samples", str(run_dir), "--last", "3", "--json", env=env)
    assert code == 0, text
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(records) == 3, text
    scored = [(rec, t) for rec in records if not rec["eval"] for t in rec["turns"] if t["reward"] is not None]
    partial = yaml.safe_load((run_dir / "config.yaml").read_text())["reward"]["partial_credit"]  # the run's shaping
    for rec, t in scored:
        assert t["reward"] == score_answer(rec["reference"], t["response"], partial_credit=partial)["reward"], (rec, t)
    code, text = await run(CHORUS, "samples", str(run_dir), "--last", "2", env=env)
    assert code == 0 and records[-1]["question"] in text, text

    # The best held-out version, exported: the logits of Chorus's network holding the kept weights.
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"kind":"eval"' in line]
    assert len(evals) >= 3 and best["final"] == max(e["final"] for e in evals if not e["failed"]), (best, evals)
    out = tmp_path / "best"
    code, text = await run(CHORUS, "export", str(run_dir), "--model", "solver_lm", "--version", "best", "--out",
                           str(out), env=env, timeout_s=300)
    assert code == 0, text
    version = best["versions"]["solver_lm"]
    assert (run_dir / "checkpoints" / "solver_lm" / "best.weights").is_file() == (version > 0), best
    assert f"exported solver_lm v{version} (best held-out)" in " ".join(text.split()), text
    assert json.loads((out / "chorus_export.json").read_text())["version"] == version
    assert "## How the agents were prompted" in (out / "README.md").read_text()
    await asyncio.to_thread(assert_same_logits, run_dir, out, version)


def assert_same_logits(run_dir: Path, out: Path, version: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from shared.kernel.config import load_config
    from shared.models.export import load_checkpoint
    from shared.models.tokenizer import ByteTokenizer

    cfg = load_config(run_dir / "config.yaml")
    kept = run_dir / "checkpoints" / "solver_lm" / "best.weights"
    ours = load_checkpoint(cfg, "solver_lm", kept if version else None)
    ids = torch.tensor([ByteTokenizer().encode("1+2=3")])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits,
                                   ours(input_ids=ids).logits)


pytestmark = pytest.mark.e2e
