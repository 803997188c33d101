"""Tiny `chorus up` runs on a reasoning-gym dataset, on HumanEval and on a verl parquet file with the user's
compute_score: the rewards the run records are the dataset's own score_answer / the sandboxed HumanEval grader's
verdict / what compute_score returned on the same responses,
and a reward function that raises or returns NaN costs only its samples (counted), not the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nats
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from reasoning_gym.utils import extract_answer

from services.actions.actions import REGISTRY
from services.coordinator import datasets
from shared.kernel.codec import decode
from shared.kernel.schemas import Sample
from shared.models.tokenizer import ByteTokenizer
from shared.results.plotting import load_generated, load_metrics
from shared.rlmath import rgym
from tests.conftest import ROOT
from tests.e2e.conftest import chorus_up, small_run_config

VERSIONS = 3


def _config(tmp_path: Path, run_id: str, task: dict[str, Any], reward: dict[str, Any] | None = None,
            group_size: int = 8, max_position: int = 1024, max_new_tokens: int = 4) -> Path:
    path = small_run_config(tmp_path, run_id, max_versions=VERSIONS, global_batch=16, micro_batch=16)
    cfg = yaml.safe_load(path.read_text())
    for m in cfg["models"].values():
        m["arch"]["max_position"] = max_position  # the datasets' questions are longer than arithmetic's
    cfg["task"] = task
    cfg["workflow"].update({"group_size": group_size, "concurrency": 4, "max_new_tokens": max_new_tokens})
    if reward:
        cfg["reward"] = reward
    path.write_text(yaml.safe_dump(cfg))
    return path


async def _run(path: Path, nats_url: str, run_id: str) -> tuple[list[Sample], dict[str, Any], str]:
    ours = f"chorus.{run_id}-"
    samples: list[Sample] = []
    coordinator: dict[str, Any] = {}

    async def on_msg(msg: Any) -> None:
        if not msg.subject.startswith(ours):
            return
        if ".traj." in msg.subject:
            samples.append(decode(Sample, msg.data))
        elif ".metrics.coordinator." in msg.subject:
            coordinator.update(json.loads(msg.data))

    nc = await nats.connect(nats_url)
    await nc.subscribe("chorus.*.traj.*", cb=on_msg)
    await nc.subscribe("chorus.*.metrics.>", cb=on_msg)
    code, text = await chorus_up(path, nats_url, 240)
    await nc.flush()
    await nc.close()
    assert code == 0, text[-4000:]
    assert samples, text[-3000:]
    return samples, coordinator, text


def _counter(metrics: Any, key: str) -> float:
    """``key``'s value anywhere in a metrics message (0 when absent)."""
    if isinstance(metrics, dict):
        if isinstance(metrics.get(key), int | float):
            return metrics[key]
        return max([_counter(v, key) for v in metrics.values()] or [0])
    return 0


async def test_reasoning_gym_run_records_the_datasets_own_score_answer(nats_url, run_id, tmp_path):
    # countdown gives an answer without <answer> tags 0.01 (check_math would give 0): the rewards tell them apart
    task = {"name": "reasoning_gym", "dataset": "countdown", "instruction": ""}
    samples, _, text = await _run(_config(tmp_path, run_id, task), nats_url, run_id)
    tok, ds = ByteTokenizer(), rgym.dataset("countdown", {}, 0, 100_000)
    for s in samples:
        index = int(s.episode.split("/")[0].rsplit("-", 1)[1])  # task ids are <prefix>-<n>: item n of seed 0
        response = tok.decode(s.response_ids.tolist())
        assert s.reward == ds.score_answer(extract_answer(response), ds[index]), (s.sample_id, response)
    assert {round(s.reward, 6) for s in samples} & {0.01}, text[-2000:]


async def test_humaneval_run_scores_every_reply_in_the_sandbox_through_the_coordinator(nats_url, run_id, tmp_path):
    path = _config(tmp_path, run_id, {"name": "humaneval", "heldout": 4}, max_position=2048, max_new_tokens=24)
    samples, coordinator, text = await _run(path, nats_url, run_id)
    assert f"{VERSIONS}/{VERSIONS}" in text, text[-2000:]
    assert _counter(coordinator, "samples_dropped_reward_error") == 0, coordinator
    problems = datasets.humaneval_problems()
    tok = ByteTokenizer()
    checked = 0
    for s in samples:  # the reward is check_humaneval's verdict on the same reply, run again here
        prompt = tok.decode(s.prompt_ids.tolist())
        problem = max((p for p in problems if p["prompt"] in prompt), key=lambda p: len(p["prompt"]))
        response = tok.decode(s.response_ids.tolist())
        out = REGISTRY["check_humaneval"]({"response": response, "prompt": problem["prompt"],
                                           "entry_point": problem["entry_point"], "test": problem["test"]})
        assert s.reward == out["reward"], (s.sample_id, response, out)
        checked += 1
        if checked == 24:  # a sandbox run each: enough to tie the run's rewards to the grader
            break
    assert checked == min(24, len(samples))


REWARD = '''
import math
calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "my/source" and extra_info["tag"] == "t"
    return {"score": (len(solution_str) % 4) / 4 + (0.5 if ground_truth == "7" else 0.0), "length": len(solution_str)}

def zero(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0

def picky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str != ground_truth:  # the reference itself scores (chorus check's trial); no reply of a tiny model does
        raise ValueError("no answer in the reply")
    return 1.0

def flaky(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls % 13 == 5:
        raise RuntimeError("flaky reward")
    if calls % 13 == 9:
        return math.nan
    return 1.0
'''


def _verl_file(tmp_path: Path) -> Path:
    rows = [{"data_source": "my/source", "ability": "math",
             "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"tag": "t", "index": i}}
            for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 5), (4, 4), (0, 1), (3, 3)])]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    (tmp_path / "reward.py").write_text(REWARD)
    return path


async def test_verl_parquet_with_compute_score_trains_on_its_rewards(nats_url, run_id, tmp_path):
    path = _config(tmp_path, run_id, {"name": "verl", "path": str(_verl_file(tmp_path))},
                   {"function": "reward.py:compute_score"})
    samples, _, text = await _run(path, nats_url, run_id)
    assert f"{VERSIONS}/{VERSIONS}" in text, text[-2000:]
    # generated tokens against trained versions: every token a step trained was generated before that version
    metrics = next((tmp_path / "runs").glob("*/metrics.jsonl"))
    generated, steps = load_generated(metrics), load_metrics(metrics)
    assert generated and [g["tokens_generated"] for g in generated] == sorted(g["tokens_generated"] for g in generated)
    for g in generated:
        trained = sum(r["tokens"] for r in steps if r["version"] <= g["versions"].get(r["model"], 0))
        assert 0 < trained <= g["tokens_generated"], (g, trained)
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["tokens_generated"] == generated[-1]["tokens_generated"]
    tok = ByteTokenizer()
    for s in samples:  # the sample does not name its row: the length part, plus 0.5 on 3+4's (not clamped to 1)
        response = tok.decode(s.response_ids.tolist())
        part = (len(response) % 4) / 4
        assert s.reward in (part, part + 0.5), (s.sample_id, response, s.reward)


async def test_a_reward_function_that_raises_or_returns_nan_drops_counted_samples_and_the_run_finishes(
        nats_url, run_id, tmp_path):
    path = _config(tmp_path, run_id, {"name": "verl", "path": str(_verl_file(tmp_path))},
                   {"function": "reward.py:flaky"}, group_size=4)
    samples, coordinator, text = await _run(path, nats_url, run_id)
    assert f"{VERSIONS}/{VERSIONS}" in text, text[-2000:]
    assert _counter(coordinator, "samples_dropped_reward_error") > 0, coordinator
    assert all(s.reward == 1.0 for s in samples)  # no failed row was scored 0


async def test_a_run_whose_rewards_never_vary_warns_with_the_cause_on_the_terminal(nats_url, run_id, tmp_path):
    path = _config(tmp_path, run_id, {"name": "verl", "path": str(_verl_file(tmp_path))},
                   {"function": "reward.py:zero", "warn_after_steps": 1})
    samples, _, text = await _run(path, nats_url, run_id)
    assert all(s.reward == 0.0 for s in samples)
    flat = " ".join(text.split())
    assert "warning: model solver_lm: each of its last 2 groups (1 steps' worth) gave every sample the same reward " \
           "(mean 0.000)" in flat, text[-3000:]
    assert "Every reply scored 0" in flat
    print(next(line for line in text.splitlines() if line.startswith("warning:")))


async def test_a_reward_function_that_fails_on_every_reply_stops_the_run_with_the_reason(nats_url, run_id, tmp_path):
    path = _config(tmp_path, run_id, {"name": "verl", "path": str(_verl_file(tmp_path))},
                   {"function": "reward.py:picky", "max_errors": 16})
    code, text = await chorus_up(path, nats_url, 240)
    flat = " ".join(text.split())
    assert code == 1, text[-3000:]
    assert "stopped the run (exit 78" in flat and "reward.max_errors 16" in flat, text[-3000:]
    assert "ValueError: no answer in the reply" in flat
    assert "coordinator: dropped" in flat and "samples whose reward function failed (reward.function)" in flat, text[-1500:]
    print(text[-1500:])


@pytest.mark.full
async def test_the_shipped_rg_chain_sum_config_earns_reward_within_a_few_versions(nats_url, run_id, tmp_path):
    """configs/rg-chain-sum.yaml as shipped (the embedded SmolLM2, answer: flexible), cut to four versions and no
    evaluation: SmolLM2 does not write <answer> tags, and scored only by them every reply earned 0."""
    cfg = yaml.safe_load((ROOT / "configs" / "rg-chain-sum.yaml").read_text())
    cfg["run"] = {"id": run_id, "dir": str(tmp_path / "runs"), "seed": 0}
    cfg.pop("nats", None)
    cfg["train"]["max_versions"] = 4
    cfg["eval"]["every"] = 0
    path = tmp_path / "rg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    samples, _, text = await _run(path, nats_url, run_id)
    assert "4/4" in text, text[-2000:]
    assert max(s.reward for s in samples) > 0, text[-2000:]
    print(text[-1500:])
