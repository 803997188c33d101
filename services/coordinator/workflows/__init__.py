"""Workflows of the coordinator: ``async def workflow(ctx, task) -> Trajectory`` plays one rollout of a task.

Built in: ``solve_verify``, ``debate``, ``chain``, ``mixture``, ``solver_coder_refiner``; ``custom`` loads the
function named by ``workflow.function`` from the user's file. See docs/workflows.md.
"""

from __future__ import annotations

from pathlib import Path

from services.coordinator.workflows.api import (
    Abandon,
    Act,
    Context,
    Generate,
    GenResult,
    Stopping,
    Tokenizers,
    Trajectory,
    Turn,
    Workflow,
    WorkflowError,
    WorkflowTimeout,
)
from services.coordinator.workflows.builtin import chain, debate, mixture, solver_coder_refiner
from services.coordinator.workflows.episode import Episode, run_episode
from services.coordinator.workflows.loader import load_workflow_function
from services.coordinator.workflows.solve_verify import (
    printable,
    solve_verify,
    solve_verify_workflow,
    verifier_prompt,
)
from shared.kernel.config import ChorusConfig

BUILTIN: dict[str, Workflow] = {
    "solve_verify": solve_verify_workflow,
    "debate": debate,
    "chain": chain,
    "mixture": mixture,
    "solver_coder_refiner": solver_coder_refiner,
}


def workflow_of(cfg: ChorusConfig, base_dirs: list[Path] | None = None) -> Workflow:
    """The workflow function a config names; a custom one is imported from its file now (ConfigError if not)."""
    wf = cfg.workflow
    if wf.name == "custom":
        assert wf.function is not None  # the config requires it
        return load_workflow_function(wf.function, base_dirs)
    return BUILTIN[wf.name]


__all__ = [
    "BUILTIN", "Abandon", "Act", "Context", "Episode", "GenResult", "Generate", "Stopping", "Tokenizers",
    "Trajectory", "Turn", "Workflow", "WorkflowError", "WorkflowTimeout", "chain", "debate", "load_workflow_function", "mixture",
    "printable", "run_episode", "solve_verify", "solve_verify_workflow", "solver_coder_refiner", "verifier_prompt",
    "workflow_of",
]
