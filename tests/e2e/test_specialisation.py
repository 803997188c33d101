"""Each specialisation config (L1 prompts, L2 LoRA, L3 models, mixed) and the user-workflow config run a
few steps through `chorus up`."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from shared.kernel.codec import decode
from shared.kernel.schemas import Sample
from shared.models.tokenizer import ByteTokenizer
from tests.conftest import ROOT
from tests.e2e.conftest import chorus_up
from tests.e2e.results import (
    assert_exports_load_with_chorus_logits,
    assert_served,
    assert_tensorboard_matches_metrics,
    parse_exposition,
    prometheus_exporter,
)

pytestmark = pytest.mark.e2e

VERSIONS = 3


def shrunk(name: str, tmp_path: Path, run_id: str) -> Path:
    """configs/<name>.yaml with small groups and batches and a target of VERSIONS steps."""
    base = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    base["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    base.pop("nats", None)
    base["workflow"].update({"concurrency": 4, "group_size": 4})
    base["train"].update({"max_versions": VERSIONS, "global_batch": 8, "micro_batch": 8, "checkpoint_every": 0})
    base["metrics_interval_s"] = 0.5
    function = base["workflow"].get("function")
    if function:  # a user workflow's file is relative to the config's own directory
        file, name = function.rsplit(":", 1)
        base["workflow"]["function"] = f"{(ROOT / 'configs' / file).resolve()}:{name}"
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


@dataclass
class Seen:
    """Samples published on traj.<model> and step events of the trainers, for one run."""

    samples: dict[str, Sample] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def trained(self, model: str) -> list[Sample]:
        """The samples that went into a step of ``model`` (those seen on the trajectory stream)."""
        ids = [sid for s in self.steps if s["model"] == model for sid in s["sample_ids"]]
        return [self.samples[sid] for sid in ids if sid in self.samples]


async def run_config(name: str, nats_url: str, run_id: str, tmp_path: Path) -> Seen:
    cfg = shrunk(name, tmp_path, run_id)
    ours = f"chorus.{run_id}-"  # `chorus up` appends a timestamp to the run id
    seen = Seen()

    async def on_msg(msg: Any) -> None:
        if not msg.subject.startswith(ours):
            return
        if ".traj." in msg.subject:
            s = decode(Sample, msg.data)
            seen.samples[s.sample_id] = s
        else:
            ev = json.loads(msg.data)
            if ev.get("kind") == "step":
                seen.steps.append(ev)

    nc = await nats.connect(nats_url)
    await nc.subscribe("chorus.*.traj.*", cb=on_msg)
    await nc.subscribe("chorus.*.events.trainer", cb=on_msg)
    code, text = await chorus_up(cfg, nats_url, 240)
    await nc.flush()
    await nc.close()
    assert code == 0, f"chorus up {name} failed:\n{text[-4000:]}"
    models = yaml.safe_load(cfg.read_text())["models"]
    for m in models:
        versions = [s["version"] for s in seen.steps if s["model"] == m]
        assert versions and max(versions) == VERSIONS, (m, versions, text[-2000:])
        assert seen.trained(m), f"no trained sample of {m} was seen on traj.{m}"
    return seen


async def test_l1_one_model_trains_both_agents_told_apart_by_their_prompts(nats_url, run_id, tmp_path):
    seen = await run_config("l1-prompts", nats_url, run_id, tmp_path)
    trained = seen.trained("shared_lm")
    assert {s.agent for s in trained} == {"solver", "verifier"}
    assert all(s.adapter is None for s in trained)
    tok = ByteTokenizer()
    prefix = {"solver": "Solve: ", "verifier": "Check: "}
    for s in trained:
        assert prefix[s.agent] in tok.decode(s.prompt_ids.tolist()), (s.agent, tok.decode(s.prompt_ids.tolist()))


async def test_l2_one_base_trains_the_adapters_of_both_agents(nats_url, run_id, tmp_path):
    seen = await run_config("l2-lora", nats_url, run_id, tmp_path)
    by_agent: dict[str, set[str | None]] = defaultdict(set)
    for s in seen.trained("base_lm"):
        by_agent[s.agent].add(s.adapter)
    assert by_agent == {"solver": {"sol"}, "verifier": {"ver"}}
    # The trainer's own count agrees: each step event says how many samples of each adapter it trained.
    counted: dict[str, int] = defaultdict(int)
    for step in (s for s in seen.steps if s["model"] == "base_lm"):
        assert sum(step["adapter_samples"].values()) == step["samples"]
        for adapter, n in step["adapter_samples"].items():
            counted[adapter] += n
    assert set(counted) == {"sol", "ver"}


async def test_l3_every_agent_trains_a_model_of_its_own(nats_url, run_id, tmp_path):
    seen = await run_config("l3-models", nats_url, run_id, tmp_path)
    assert {s.agent for s in seen.trained("solver_lm")} == {"solver"}
    assert {s.agent for s in seen.trained("verifier_lm")} == {"verifier"}


async def test_mixed_a_lora_agent_and_a_full_model_agent_train_side_by_side_and_their_results_are_usable(
        nats_url, run_id, tmp_path):
    # The run is watched by `chorus export-prometheus` (every run on the server) and by the test itself.
    last: dict[str, dict[str, Any]] = {}  # the last metrics message of each instance of this run

    async def on_metrics(msg: Any) -> None:
        if msg.subject.startswith(f"chorus.{run_id}-"):
            last[msg.subject] = json.loads(msg.data)

    nc = await nats.connect(nats_url)
    await nc.subscribe("chorus.*.metrics.>", cb=on_metrics)
    async with prometheus_exporter(nats_url) as scrape:
        seen = await run_config("mixed", nats_url, run_id, tmp_path)
        await nc.flush()
        await nc.close()
        assert {(s.agent, s.adapter) for s in seen.trained("base_a")} == {("solver", "sol")}
        assert {(s.agent, s.adapter) for s in seen.trained("full_b")} == {("verifier", None)}
        # Scraped over HTTP: the latest value of every numeric field of every service instance of the run.
        assert {p["service"] for p in last.values()} >= {"coordinator", "rollouter", "mq", "trainer", "paramsync"}
        deadline = asyncio.get_running_loop().time() + 120
        while True:
            try:
                checked = assert_served(parse_exposition(await scrape()), last)
                break
            except AssertionError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert checked > 50
    run_dir = next((tmp_path / "runs").glob(f"{run_id}-*"))
    # The final weights are kept (checkpoint_every is 0 here) ...
    for m in ("base_a", "full_b"):
        assert (run_dir / "checkpoints" / m / f"v{VERSIONS}.pt").is_file()
    # ... TensorBoard has every scalar of metrics.jsonl ...
    assert assert_tensorboard_matches_metrics(run_dir, ["base_a", "full_b"]) >= 2 * VERSIONS * 10
    # ... and both trained models load with transformers / peft and compute what Chorus's learner computes.
    assert_exports_load_with_chorus_logits(run_dir, tmp_path, "base_a", "sol", "full_b")


async def test_a_workflow_from_a_users_own_file_trains_both_of_its_agents(nats_url, run_id, tmp_path):
    # configs/custom-workflow.yaml names examples/my_workflow.py:critique, a file outside the package.
    seen = await run_config("custom-workflow", nats_url, run_id, tmp_path)
    solver = {(s.agent, s.turn) for s in seen.trained("solver_lm")}
    critic = {(s.agent, s.turn) for s in seen.trained("critic_lm")}
    assert solver <= {("solver", 0), ("solver", 2)} and ("solver", 2) in solver  # draft and revision
    assert critic == {("critic", 1)}
    # The reviser's prompt holds the draft and the critic's review, as the user's function built it.
    tok = ByteTokenizer()
    revision = next(s for s in seen.trained("solver_lm") if s.turn == 2)
    text = tok.decode(revision.prompt_ids.tolist())
    assert "answer: " in text and "critic: " in text, text
