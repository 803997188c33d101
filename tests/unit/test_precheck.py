"""shared.launcher.precheck: each kind of problem a config can name is found, by its key and its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import shared.models.loading
from shared.kernel.config import ChorusConfig, deep_merge, load_config
from shared.launcher import precheck

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, **changes: Any) -> ChorusConfig:
    """configs/tiny-chain.yaml with ``changes`` merged over it, written and loaded from ``tmp_path``."""
    data = yaml.safe_load((ROOT / "configs" / "tiny-chain.yaml").read_text())
    data = deep_merge(data, {"run": {"dir": str(tmp_path / "runs")}, **changes})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def hf_dir(path: Path, *files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for f in files:
        (path / f).write_text("{}")
    return path


def hf(path: Path | str) -> dict[str, Any]:
    return {"models": {"solver_lm": {"source": "hf", "path": str(path)}}}


def test_the_shipped_tiny_config_has_no_problems(tmp_path: Path) -> None:
    assert precheck.problems(config(tmp_path)) == []


def test_a_missing_model_directory_is_named_by_its_key_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    found = precheck.problems(config(tmp_path, **hf(missing)))
    assert len(found) == 1 and found[0].startswith(f"models.solver_lm.path: {missing} does not exist"), found
    empty = hf_dir(tmp_path / "empty")
    found = precheck.problems(config(tmp_path, **hf(empty)))
    assert len(found) == 1 and "is not a Hugging Face model directory (no config.json)" in found[0], found


def test_a_missing_reward_function_lists_the_functions_its_file_has(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text("import math\n\ndef score(*a, **k):\n    return 1.0\n\n"
                                        "def other(*a, **k):\n    return 0.0\n")
    found = precheck.function_problems(config(tmp_path, reward={"function": "reward.py:compute_score"}))
    assert len(found) == 1 and found[0].endswith("defines no function 'compute_score' (its functions: other, "
                                                 "score)"), found


def test_a_model_directory_without_weights_or_tokenizer_is_a_problem(tmp_path: Path) -> None:
    no_weights = hf_dir(tmp_path / "a", "config.json", "tokenizer.json")
    found = precheck.model_problems(config(tmp_path, **hf(no_weights)))
    assert found == [f"models.solver_lm.path: {no_weights} has no weights file (*.safetensors or *.bin)"]
    no_tokenizer = hf_dir(tmp_path / "b", "config.json", "model.safetensors")
    found = precheck.model_problems(config(tmp_path, **hf(no_tokenizer)))
    assert len(found) == 1 and "no tokenizer files" in found[0] and str(no_tokenizer) in found[0], found
    complete = hf_dir(tmp_path / "c", "config.json", "pytorch_model.bin", "tokenizer_config.json")
    assert precheck.model_problems(config(tmp_path, **hf(complete))) == []


def test_a_relative_model_path_is_read_beside_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_dir(tmp_path / "model", "config.json", "model.safetensors", "tokenizer.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = config(tmp_path, **hf("model"))
    assert cfg.models["solver_lm"].path == tmp_path / "model"
    assert precheck.model_problems(cfg) == []


def test_smollm2_that_is_not_installed_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def absent() -> Path:
        raise FileNotFoundError("SmolLM2 (models.<name>.source smollm2) is not installed")

    monkeypatch.setattr(shared.models.loading, "smollm2_gguf", absent)
    found = precheck.model_problems(config(tmp_path, models={"verifier_lm": {"source": "smollm2"}}))
    assert found == ["models.verifier_lm.source: SmolLM2 (models.<name>.source smollm2) is not installed"]


def test_a_missing_dataset_is_named_with_its_path(tmp_path: Path) -> None:
    found = precheck.problems(config(tmp_path, task={"name": "jsonl", "path": "no-such-data.jsonl"}))
    assert len(found) == 1, found
    assert found[0].startswith(f"task.path: cannot read the dataset {tmp_path / 'no-such-data.jsonl'}"), found


def test_a_dataset_too_small_for_its_heldout_tasks_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "qa.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n{"question": "1+2=", "answer": "3"}\n')
    found = precheck.task_problems(config(tmp_path, task={"name": "jsonl", "path": "qa.jsonl", "heldout": 2}))
    assert len(found) == 1 and "leave none for training" in found[0], found
    assert precheck.task_problems(config(tmp_path, task={"name": "jsonl", "path": "qa.jsonl", "heldout": 1})) == []


def test_a_workflow_function_not_in_its_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text("async def other(ctx, task):\n    return {}\n")
    found = precheck.problems(config(tmp_path, workflow={"name": "custom", "function": "flow.py:critique",
                                                        "agents": []}))
    assert len(found) == 1 and found[0].startswith("workflow.function"), found
    assert "critique" in found[0]


def test_a_reward_function_missing_or_not_in_its_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 1.0\n")
    found = precheck.function_problems(config(tmp_path, reward={"function": "reward.py:compute_score"}))
    assert len(found) == 1 and found[0].startswith("reward.function") and "compute_score" in found[0], found
    found = precheck.function_problems(config(tmp_path, reward={"function": "gone.py:score"}))
    assert len(found) == 1 and found[0].startswith("reward.function") and "gone.py" in found[0], found
    assert precheck.function_problems(config(tmp_path, reward={"function": "reward.py:score"})) == []


def test_the_reward_function_is_called_once_on_a_held_out_row_and_what_it_returned_is_shown(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text(
        "calls = []\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    calls.append(1)\n"
        "    assert len(calls) == 1, 'called twice'\n"
        "    return {'score': float(solution_str == ground_truth), 'length': len(solution_str)}\n"
        "def broken(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise KeyError('answer')\n"
        "def text(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 'yes'\n")
    cfg = config(tmp_path, reward={"function": "reward.py:score"}, task={"heldout": 4})
    shown: list[str] = []
    assert precheck.problems(cfg, shown) == []
    assert len(shown) == 1 and shown[0].startswith("reward.function: score(data_source='arithmetic', solution_str="), shown
    assert "on held-out row heldout-0 returned reward 1, scores {'length':" in shown[0], shown
    for name, why in (("broken", "raised KeyError: 'answer'"), ("text", "returned str 'yes'")):
        found = precheck.function_problems(config(tmp_path, reward={"function": f"reward.py:{name}"}))
        assert len(found) == 1 and found[0].startswith(f"reward.function {tmp_path}") and why in (
            found[0]) and found[0].endswith("with its reference answer as the reply)"), found


def test_a_credentials_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "app.creds"
    found = precheck.credential_problems(config(tmp_path, nats={"url": "nats://127.0.0.1:4222",
                                                                "creds": str(missing)}))
    assert len(found) == 1 and found[0].startswith(f"nats.creds: cannot read {missing}"), found
    missing.write_text("-----BEGIN NATS USER JWT-----\n")
    assert precheck.credential_problems(config(tmp_path, nats={"url": "nats://127.0.0.1:4222",
                                                               "creds": str(missing)})) == []


def test_a_config_with_three_problems_lists_all_three(tmp_path: Path) -> None:
    cfg = config(tmp_path, **hf("missing-model"), task={"name": "jsonl", "path": "missing.jsonl"},
                 reward={"function": "missing_reward.py:score"})
    found = precheck.problems(cfg)
    assert len(found) == 3, found
    assert found[0].startswith(f"models.solver_lm.path: {tmp_path / 'missing-model'}"), found
    assert found[1].startswith(f"task.path: cannot read the dataset {tmp_path / 'missing.jsonl'}"), found
    assert found[2].startswith("reward.function") and "missing_reward.py" in found[2], found


def test_a_policy_loss_that_is_not_registered_is_named(tmp_path: Path) -> None:
    from shared.launcher.precheck import problems
    from tests.unit.test_learner import make_cfg

    cfg = make_cfg(tmp_path, train_extra=", loss: ppo_klipp")
    assert [p for p in problems(cfg) if p.startswith("train.loss")] == [
        "train.loss: policy loss 'ppo_klipp' is not registered: one of decoupled, marft, marft_token, ppo_clip "
        "(shared/rlmath/losses.py)"]
