"""The names the kernel's config keeps for code above it match that code (the config validates without it)."""

from __future__ import annotations

from typing import get_args

from shared.kernel.config import WORKFLOW_AGENTS, WorkflowName


def test_the_workflows_the_config_accepts_are_the_coordinators_built_ins_and_custom() -> None:
    from services.coordinator.workflows import BUILTIN

    assert set(get_args(WorkflowName)) == set(WORKFLOW_AGENTS) == {*BUILTIN, "custom"}
