"""The checks across config sections report every problem at once and change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.kernel.config import (
    ChorusConfig,
    ConfigError,
    WorkflowConfig,
    cross_section_problems,
    load_config,
)

AGENTS = {"solver": {"model": "m"}, "verifier": {"model": "m"}}


def test_every_problem_across_sections_is_reported_at_once_each_naming_its_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {}}, "agents": AGENTS, "reward": {"judge": "nobody"},
                                    "train": {"global_batch": 7}, "mq": {"capacity": 3}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert lines[0] == f"invalid config {path}:"
    assert [line.split()[0].rstrip(":") for line in lines[1:]] == ["reward.judge", "train.global_batch", "mq.capacity"]


def test_a_consistent_config_has_no_problems_and_checking_it_changes_nothing() -> None:
    cfg = ChorusConfig(models={"m": {}}, agents=AGENTS)
    before = cfg.model_dump()
    assert cross_section_problems(cfg) == [] and cfg.model_dump() == before


def test_the_agents_a_workflow_implies_are_filled_without_changing_the_section_passed_in() -> None:
    wf = WorkflowConfig(name="custom", function="my_workflow.py:play")
    cfg = ChorusConfig(models={"m": {}}, agents={"a": {"model": "m"}, "b": {"model": "m"}}, workflow=wf)
    assert cfg.workflow.agents == ["a", "b"] and wf.agents == []
    assert ChorusConfig(models={"m": {}}, agents=AGENTS).workflow.agents == ["solver", "verifier"]
