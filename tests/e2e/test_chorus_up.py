"""A short version of the tiny-chain run through `chorus up`, the way a user starts it."""

from __future__ import annotations

import json
import re

import nats

from shared.kernel.codec import decode
from shared.kernel.schemas import Sample
from shared.results.plotting import summarize
from tests.e2e.conftest import chorus_up, small_run_config

MODELS = ["solver_lm", "verifier_lm"]


async def test_short_tiny_chain_run_learns_on_both_models(nats_url, run_id, tmp_path):
    max_staleness = 2
    cfg = small_run_config(tmp_path, run_id, max_versions=120, max_staleness=max_staleness)
    # `chorus up` appends a timestamp to the run id, so watch every run and keep this one's subjects.
    ours = f"chorus.{run_id}-"
    nc = await nats.connect(nats_url)
    sample_version: dict[str, int] = {}
    steps: list[dict] = []

    async def on_msg(msg) -> None:
        if not msg.subject.startswith(ours):
            return
        if ".traj." in msg.subject:
            s = decode(Sample, msg.data)
            sample_version[s.sample_id] = s.version
        else:
            ev = json.loads(msg.data)
            if ev.get("kind") == "step":
                steps.append(ev)

    await nc.subscribe("chorus.*.traj.*", cb=on_msg)
    await nc.subscribe("chorus.*.events.trainer", cb=on_msg)
    code, text = await chorus_up(cfg, nats_url, 420)
    await nc.close()
    assert code == 0, text[-4000:]
    # stdout is a pipe, not a terminal: progress comes as lines, ending at the target
    assert re.search(r"^progress: .*120/120.*120/120", text, re.M), text[-4000:]

    run_dirs = sorted((tmp_path / "runs").glob(f"{run_id}-*"))
    assert run_dirs, text[-2000:]
    run_dir = run_dirs[-1]
    assert (run_dir / "reward.png").stat().st_size > 0
    summary = summarize(run_dir / "metrics.jsonl")

    # Versions advanced on both models, up to the target.
    for m in MODELS:
        assert summary[m]["steps"] >= 120, summary
        versions = [s["version"] for s in steps if s["model"] == m]
        assert versions and max(versions) == 120

    # Every trained sample was generated within max_staleness of the version it was trained at.
    checked = 0
    for s in steps:
        for sid in s["sample_ids"]:
            if sid in sample_version:
                assert (s["version"] - 1) - sample_version[sid] <= max_staleness, (sid, s["version"])
                checked += 1
        assert s["staleness_max"] <= max_staleness
    assert checked > 0.9 * sum(len(s["sample_ids"]) for s in steps)

    # Reward rose on both models.
    for m in MODELS:
        assert summary[m]["last"] - summary[m]["first"] > 0.1, summary
