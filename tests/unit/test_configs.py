"""Every shipped config under configs/ loads and is self-consistent."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.config import load_config
from shared.supervisor import plan_services
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
    assert services == {"actions", "mq", "trainer", "rollouter", "paramsync", "coordinator"}


def test_tiny_chain_has_two_models_each_with_its_agent() -> None:
    cfg = load_config(ROOT / "configs" / "tiny-chain.yaml")
    assert set(cfg.models) == {"solver_lm", "verifier_lm"}
    assert cfg.agents_of("solver_lm") == ["solver"]
    assert cfg.agents_of("verifier_lm") == ["verifier"]
    assert cfg.nats.url is None  # `chorus up` starts its own nats-server


def test_compose_file_runs_every_service_for_every_model_of_its_config() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "-js" in services["nats"]["command"]
    commands = [s["command"] for name, s in services.items() if name != "nats"]
    cfg = load_config(ROOT / commands[0][commands[0].index("--config") + 1].removeprefix("/app/"))
    started = {(c[1], c[c.index("--model") + 1] if "--model" in c else None) for c in commands}
    expected = {(s.service, s.model) for s in plan_services(cfg)}
    assert started == expected
    assert all(c[0] == "serve" and c[c.index("--nats") + 1] == "nats://nats:4222" for c in commands)
