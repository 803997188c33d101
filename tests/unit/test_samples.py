"""samples.jsonl: the record of a sampled rollout, and the byte-bounded writer that keeps one old file."""

from __future__ import annotations

import json

import pytest

from services.coordinator.samples import (
    OLD_SAMPLES_FILE,
    SAMPLES_FILE,
    SampleWriter,
    dumps,
    episode_records,
    prompt_text,
    rollout_record,
)
from services.coordinator.tasks import Task
from services.coordinator.workflows.api import GenResult
from services.coordinator.workflows.episode import to_episode
from shared.kernel.config import ChorusConfig
from shared.models.tokenizer import ByteTokenizer


def _cfg(**reward: object) -> ChorusConfig:
    return ChorusConfig.model_validate({
        "models": {"solver_lm": {}, "verifier_lm": {}},
        "agents": {"solver": {"model": "solver_lm"}, "verifier": {"model": "verifier_lm"}},
        "workflow": {"group_size": 2}, **({"reward": reward} if reward else {})})


class Ctx:
    """A rollout's generations, as workflows.api.Context holds them."""

    def __init__(self, solver: str, verifier: str) -> None:
        self.generations = [
            GenResult(ids=[5], logprobs=[0.0], finished=True, version=3, text=solver,
                      prompt_ids=[ord(c) for c in "SYS 2+3="], agent="solver", gen_id=0),
            GenResult(ids=[6], logprobs=[0.0], finished=True, version=4, text=verifier,
                      prompt_ids=[ord(c) for c in "2+3= says " + solver], agent="verifier", gen_id=1),
        ]


def _traj(solver: str, verifier: str, rewards: tuple[float, float], error: str | None = None) -> dict:
    vmeta = {"gen_id": 1, "answer": verifier[:1], "correct": rewards[1] >= 1.0,
             **({"reward_error": error} if error else {})}
    return {"prompt": "2+3=", "label": "5", "final_reward": rewards[1], "final_answer": verifier[:1], "trajectory": [
        {"turn_id": 0, "agent_name": "solver", "agent_input": "2+3=", "agent_output": solver, "reward": rewards[0],
         "metadata": {"gen_id": 0, "answer": solver[:1], "correct": rewards[0] >= 1.0}},
        {"turn_id": 1, "agent_name": "verifier", "agent_input": "2+3= says " + solver, "agent_output": verifier,
         "reward": 0.0 if error else rewards[1], "metadata": vmeta},
    ]}


def _episode(cfg: ChorusConfig, errors: tuple[str | None, str | None] = (None, None)):
    task = Task(task_id="t7", question="2+3=", answer="5")
    trajs = [_traj("5 ok", "5", (1.0, 1.0), errors[0]), _traj("4 no", "6", (0.45, 0.4), errors[1])]
    ctxs = [Ctx("5 ok", "5"), Ctx("4 no", "6")]
    return to_episode(cfg, task, 0, trajs, ctxs, {"solver_lm": 3, "verifier_lm": 4}, 0.5)


def decode(model: str, ids: list[int]) -> str:
    return f"<{model}>" + "".join(map(chr, ids))


def test_a_record_holds_the_task_and_each_turns_prompt_tail_response_reward_and_answer():
    cfg = _cfg()
    ep = _episode(cfg)
    rec = rollout_record(cfg, ep, 1, decode=decode, now=12.5)
    assert {k: rec[k] for k in ("time", "task_id", "rollout", "question", "reference", "versions", "eval")} == {
        "time": 12.5, "task_id": "t7", "rollout": 1, "question": "2+3=", "reference": "5",
        "versions": {"solver_lm": 3, "verifier_lm": 4}, "eval": False}
    solver, verifier = rec["turns"]
    advantages = {(s.episode, s.turn): s.advantage for s in ep.samples}
    assert solver.pop("advantage") == advantages[("t7/1", 0)] and verifier["advantage"] == advantages[("t7/1", 1)]
    assert solver == {"turn": 0, "agent": "solver", "model": "solver_lm", "version": 3,
                      "prompt_tail": "<solver_lm>SYS 2+3=", "response": "4 no", "reward": 0.45, "answer": "4",
                      "correct": False, "trained": True}
    assert verifier["model"] == "verifier_lm" and verifier["version"] == 4 and verifier["reward"] == 0.4
    assert verifier["prompt_tail"] == "<verifier_lm>2+3= says 4 no" and "reward_error" not in verifier
    # the rewards are the published Samples' (the ones of rollout 1, not rollout 0)
    published = {(s.episode, s.turn): s.reward for s in ep.samples}
    assert [t["reward"] for t in rec["turns"]] == [published[("t7/1", 0)], published[("t7/1", 1)]]
    # without a tokenizer the prompt is the turn's own input text; a long prompt keeps its last 300 characters
    assert rollout_record(cfg, ep, 0)["turns"][1]["prompt_tail"] == "2+3= says 5 ok"
    ep.trajectories[0]["trajectory"][0]["agent_input"] = "x" * 1000 + "END"
    assert rollout_record(cfg, ep, 0)["turns"][0]["prompt_tail"] == "x" * 297 + "END"
    assert json.loads(dumps(rec)) == rec
    assert [r["rollout"] for r in episode_records(cfg, ep, (0, 1, 5), eval=True)] == [0, 1]
    assert episode_records(cfg, ep, (0,), eval=True)[0]["eval"] is True
    assert all(t["advantage"] is None for t in episode_records(cfg, ep, (0,), eval=True)[0]["turns"])  # not trained


def test_a_prompt_tail_reads_past_the_eos_that_ends_each_chat_message():
    tok = ByteTokenizer()
    ids = [*tok.encode("system: be brief", bos=False), tok.eos_id, *tok.encode("user: 2+3=", bos=False), tok.eos_id]
    assert tok.decode(ids) == "system: be brief"  # decode stops at the first EOS, as generation does
    assert prompt_text(tok, ids) == "system: be briefuser: 2+3="


def test_shaped_rewards_are_the_samples_and_a_failed_reward_is_reported_not_scored():
    cfg = _cfg(shaping="quality")
    ep = _episode(cfg, errors=(None, "reward.function raised ZeroDivisionError"))
    rec = rollout_record(cfg, ep, 1)
    solver, verifier = rec["turns"]
    assert verifier["reward"] is None and verifier["trained"] is False
    assert verifier["reward_error"] == "reward.function raised ZeroDivisionError"
    assert verifier["model"] == "verifier_lm" and verifier["version"] is None
    assert solver["reward"] == next(s.reward for s in ep.samples if s.episode == "t7/1" and s.turn == 0)


def test_rotation_keeps_the_file_under_the_bound_and_one_old_file(tmp_path):
    w = SampleWriter(tmp_path, max_bytes=1000)
    line = json.dumps({"n": 0, "pad": "x" * 80})  # 100 bytes with its newline
    assert len(line) + 1 == 100
    seen = []
    for batch in range(30):
        lines = [json.dumps({"n": batch * 3 + i, "pad": "x" * (80 - len(str(batch * 3 + i)) + 1)})
                 for i in range(3)]
        w.write(lines)
        seen.extend(lines)
        assert (tmp_path / SAMPLES_FILE).stat().st_size <= 1000
        if (tmp_path / OLD_SAMPLES_FILE).exists():
            assert (tmp_path / OLD_SAMPLES_FILE).stat().st_size <= 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [OLD_SAMPLES_FILE, SAMPLES_FILE]
    old = (tmp_path / OLD_SAMPLES_FILE).read_text().splitlines()
    new = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    # the two files are the newest lines, in order, the old one full
    assert old + new == seen[-len(old) - len(new):]
    assert len(old) == 10 and 0 < len(new) <= 10
    with pytest.raises(ValueError):
        SampleWriter(tmp_path, max_bytes=0)


def test_a_line_longer_than_the_bound_is_written_alone(tmp_path):
    w = SampleWriter(tmp_path, max_bytes=50)
    w.write(["a" * 10, "b" * 100, "c" * 10])
    assert (tmp_path / OLD_SAMPLES_FILE).read_text() == "b" * 100 + "\n"
    assert (tmp_path / SAMPLES_FILE).read_text() == "c" * 10 + "\n"
