"""Every shipped config under configs/ loads and is self-consistent."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.kernel.config import load_config
from shared.launcher.supervisor import plan_services
from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_shipped_configs() -> None:
    assert any(p.name == "tiny-chain.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.models and cfg.agents
    for agent in cfg.workflow.agents:
        assert cfg.agents[agent].model in cfg.models
    assert cfg.train.micro_batch % cfg.workflow.group_size == 0  # micro-batches hold whole groups
    assert cfg.mq_capacity >= cfg.train.global_batch
    services = {s.service for s in plan_services(cfg)}
    marft = {"critic"} if cfg.marft_on else set()  # MARFT's central critic, one per run
    assert services == {"actions", "mq", "trainer", "rollouter", "paramsync", "coordinator", *marft}


def test_tiny_chain_has_two_models_each_with_its_agent() -> None:
    cfg = load_config(ROOT / "configs" / "tiny-chain.yaml")
    assert set(cfg.models) == {"solver_lm", "verifier_lm"}
    assert cfg.agents_of("solver_lm") == ["solver"]
    assert cfg.agents_of("verifier_lm") == ["verifier"]
    assert cfg.nats.url is None  # `chorus up` starts its own nats-server
