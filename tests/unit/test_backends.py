"""The rollouter's backend choice and the parts of the vLLM backend that need no vLLM."""

from __future__ import annotations

import pytest

from services.rollouter.backends import BACKENDS
from services.rollouter.vllm_engine import lora_rank
from shared.kernel.config import ChorusConfig, ConfigError, RolloutSection


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
