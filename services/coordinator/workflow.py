"""The coordinator's workflow API under its short name; the code is in :mod:`services.coordinator.workflows`."""

from services.coordinator.workflows import (  # noqa: F401
    BUILTIN,
    Abandon,
    Act,
    Context,
    Episode,
    Generate,
    GenResult,
    Tokenizers,
    Trajectory,
    Turn,
    Workflow,
    WorkflowError,
    printable,
    run_episode,
    solve_verify,
    verifier_prompt,
    workflow_of,
)
