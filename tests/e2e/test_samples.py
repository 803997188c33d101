"""A tiny `chorus up` with logging.samples_every 1 writes samples.jsonl; `chorus samples` shows it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess

import nats
import yaml

from services.actions.actions import score_answer
from shared.kernel.codec import decode
from shared.kernel.schemas import Sample
from tests.e2e.conftest import CHORUS, chorus_up, small_run_config

VERSIONS = 4


async def _chorus_samples(*args: str) -> tuple[int | None, str]:
    proc = await asyncio.create_subprocess_exec(CHORUS, "samples", *args, env={**os.environ, "COLUMNS": "200"},
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode(errors="replace")


async def test_samples_jsonl_holds_the_rewards_the_run_published_and_chorus_samples_prints_them(
        nats_url, run_id, tmp_path):
    cfg = small_run_config(tmp_path, run_id, {"logging": {"samples_every": 1, "backends": []}},
                           max_versions=VERSIONS, global_batch=16, micro_batch=16)
    ours = f"chorus.{run_id}-"
    nc = await nats.connect(nats_url)
    published: dict[str, float] = {}

    async def on_msg(msg) -> None:
        if msg.subject.startswith(ours):
            s = decode(Sample, msg.data)
            published[s.sample_id] = s.reward

    await nc.subscribe("chorus.*.traj.*", cb=on_msg)
    code, text = await chorus_up(cfg, nats_url, 120)
    await nc.flush()
    await nc.close()
    assert code == 0, text[-4000:]
    (run_dir,) = sorted((tmp_path / "runs").glob(f"{run_id}-*"))
    path = run_dir / "samples.jsonl"
    assert path.is_file(), text[-2000:]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) >= 3
    partial = yaml.safe_load(cfg.read_text())["reward"]["partial_credit"]  # the shaping the config asks for
    compared = 0
    for rec in records:
        assert rec["question"].endswith("=") and rec["reference"].isdigit() and not rec["eval"]
        assert [t["agent"] for t in rec["turns"]] == ["solver", "verifier"]
        assert [t["model"] for t in rec["turns"]] == ["solver_lm", "verifier_lm"]
        assert rec["turns"][0]["prompt_tail"]  # the decoded prompt the solver saw
        for t in rec["turns"]:
            # the task's own check of the response gives the reward recorded ...
            assert t["reward"] == score_answer(rec["reference"], t["response"], partial_credit=partial)["reward"], (rec, t)
            # ... and it is the reward of the Sample the coordinator published to the trainer's stream
            sid = Sample.make_id(rec["task_id"], t["turn"], rec["rollout"])
            if t["trained"] and sid in published:
                assert t["reward"] == published[sid], (sid, t)
                compared += 1
    assert compared >= len(records), (compared, len(records), len(published))

    code, out = await _chorus_samples(str(run_dir), "--last", "2")
    assert code == 0, out
    assert len(re.findall(r"task \S+ rollout 0", out)) == 2, out
    assert out.count("reference: ") == 2 and "solver (solver_lm" in out and "verifier (verifier_lm" in out
    code, out = await _chorus_samples(str(run_dir), "--json", "--last", "3")
    assert code == 0, out
    lines = out.splitlines()
    assert len(lines) == 3 and [json.loads(x) for x in lines] == records[-3:]
    code, out = await _chorus_samples(str(run_dir), "--json", "--agent", "nobody")
    assert code == 0 and out == ""
    code, out = await _chorus_samples(str(tmp_path))
    assert code == 1 and "samples.jsonl" in out and "logging.samples_every" in out
