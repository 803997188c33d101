"""The rollouter's backend choice and the parts of the vLLM backend that need no vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.rollouter.backends import BACKENDS
from services.rollouter.vllm_engine import WORK_PREFIX, lora_rank, sweep_work_dirs
from shared.kernel.config import ChorusConfig, ConfigError, RolloutSection, load_config


def test_every_backend_the_config_accepts_has_a_builder() -> None:
    accepted = RolloutSection.model_fields["backend"].annotation.__args__  # type: ignore[union-attr]
    assert set(accepted) == set(BACKENDS) == {"chorus", "vllm"}


def test_the_backend_defaults_to_chorus_and_vllm_keys_are_checked() -> None:
    agents = {"solver": {"model": "m"}, "verifier": {"model": "m"}}
    cfg = ChorusConfig(run={"id": "t"}, models={"m": {}}, agents=agents)
    assert cfg.models["m"].rollouter.backend == "chorus"
    cfg = ChorusConfig(run={"id": "t"}, agents=agents, models={"m": {"rollouter": {
        "backend": "vllm", "vllm": {"kv_cache_gib": 0.5, "extra": {"swap_space": 0}}}}})
    assert cfg.models["m"].rollouter.vllm.kv_cache_gib == 0.5
    with pytest.raises(ValueError, match="kv_cache"):
        ChorusConfig(run={"id": "t"}, agents=agents, models={"m": {"rollouter": {"vllm": {"kv_cache": 1}}}})


@pytest.mark.parametrize(("r", "rank"), [(1, 1), (4, 8), (8, 8), (9, 16), (16, 16), (33, 64), (300, 320)])
def test_a_lora_rank_rounds_up_to_one_vllm_builds(r: int, rank: int) -> None:
    assert lora_rank(r) == rank


def test_a_lora_rank_above_vllms_largest_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="largest LoRA rank"):
        lora_rank(1024)


def test_chorus_up_refuses_a_vllm_run_where_vllm_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from shared.kernel.config import load_config
    from shared.launcher.supervisor import check_backends_installed
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs" / "tiny-chain-vllm.yaml")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"models.solver_lm.rollouter.backend is vllm.*make venv-vllm"):
        check_backends_installed(cfg)
    check_backends_installed(load_config(ROOT / "configs" / "tiny-chain.yaml"))  # chorus backends need nothing


def test_a_dead_rollouters_work_directory_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    # A SIGKILLed vLLM rollouter leaves its base copy on tmpfs; the next engine's start removes it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{WORK_PREFIX}{dead.pid}-abc"
    mine = tmp_path / f"{WORK_PREFIX}{os.getpid()}-def"
    other = tmp_path / "chorus-vllm-notapid-x"
    for d in (gone, mine, other):
        (d / "base").mkdir(parents=True)
        (d / "base" / "model.safetensors").write_bytes(b"x" * 10)
    assert sweep_work_dirs(tmp_path) == [gone]
    assert not gone.exists() and mine.exists() and other.exists()


def test_the_trainer_backend_defaults_to_torch_and_bad_deepspeed_combinations_name_their_key(tmp_path: Path) -> None:
    agents = {"solver": {"model": "m"}, "verifier": {"model": "m"}}
    cfg = ChorusConfig(run={"id": "t"}, models={"m": {}}, agents=agents)
    assert cfg.models["m"].trainer.backend == "torch"
    ok = ChorusConfig(run={"id": "t"}, agents=agents, models={"m": {"trainer": {"backend": "deepspeed", "deepspeed": {
        "ranks": 4, "zero_stage": 3, "offload_optimizer": True, "config": {"zero_optimization": {"overlap_comm": True}}}}}})
    from services.trainer.zero import deepspeed_config

    made = deepspeed_config(ok, "m", 4)
    zero = made["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"} and zero["overlap_comm"] is True
    assert made["optimizer"]["params"]["torch_adam"] is True and made["train_batch_size"] == 4
    bad = {
        "offload_optimizer needs zero_stage 1": {"zero_stage": 0, "offload_optimizer": True},
        "config.optimizer is set by Chorus": {"config": {"optimizer": {"type": "SGD"}}},
        "config.zero_optimization.stage is set by Chorus": {"config": {"zero_optimization": {"stage": 1}}},
        "ranks": {"ranks": 0},
        "zero_stage": {"zero_stage": 4},
    }
    for why, section in bad.items():
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"run": {"id": "t"}, "agents": agents,
                                        "models": {"m": {"trainer": {"backend": "deepspeed", "deepspeed": section}}}}))
        with pytest.raises(ConfigError, match="models.m.trainer.deepspeed") as info:
            load_config(path)
        assert why in str(info.value), (why, str(info.value))


def test_chorus_up_refuses_a_deepspeed_run_where_deepspeed_is_not_installed(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    import importlib.util

    from shared.launcher.supervisor import check_backends_installed

    agents = {"solver": {"model": "m"}, "verifier": {"model": "m"}}
    cfg = ChorusConfig(run={"id": "t"}, agents=agents, models={"m": {"trainer": {"backend": "deepspeed"}}})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match=r"models.m.trainer.backend is deepspeed.*make venv-deepspeed"):
        check_backends_installed(cfg)


def test_a_ranks_sub_batches_hold_whole_prompt_groups_and_at_most_a_micro_batch() -> None:
    """However large the global batch, one forward of a rank holds at most a micro-batch of samples (a prompt group
    larger than that goes alone); a prompt group is never split (its prompt runs once)."""
    from types import SimpleNamespace

    import numpy as np

    from services.trainer.zero import ZeroLearner
    from shared.kernel.schemas import Array

    def s(prompt: int) -> SimpleNamespace:
        return SimpleNamespace(adapter=None, prompt_ids=Array.of([1, prompt], "int32"))

    rank = ZeroLearner.__new__(ZeroLearner)
    rank.sub_samples = 4
    samples = [s(p) for p in (7, 7, 8, 8, 9, 9, 7, 5, 5, 5, 5, 5, 6)]
    chunks = rank._chunks(samples)  # type: ignore[arg-type]
    assert sorted(i for c in chunks for i in c) == list(range(len(samples)))
    assert chunks == [[0, 1, 6], [2, 3, 4, 5], [7, 8, 9, 10, 11], [12]]
    for c in chunks:
        prompts = {int(np.asarray(samples[i].prompt_ids.numpy())[1]) for i in c}
        assert len(c) <= rank.sub_samples or len(prompts) == 1
