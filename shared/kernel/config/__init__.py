"""Run configuration: YAML validated by pydantic, overridable from the environment.

``CHORUS_TRAIN__MAX_VERSIONS=3`` overrides ``train.max_versions``; unknown keys are errors that name the path of
the bad key. The sections live beside what they configure: ``run`` (run, nats, peers, logging), ``models`` (each
model, its optimizer, its rollout and training engines), ``workflow`` (agents, workflow, task, reward, eval),
``train`` (objective, batches, MARFT, the training pool), ``pipeline`` (mq, actions, paramsync, balancing);
``root`` assembles them into :class:`ChorusConfig`, ``checks`` holds the checks across sections and ``loading``
reads a file and the environment.
"""

from shared.kernel.config.base import CONFIG_DIR, ConfigError, Section, resolve_function, resolve_path
from shared.kernel.config.checks import cross_section_problems
from shared.kernel.config.loading import (
    ENV_PREFIX,
    config_from_yaml_text,
    deep_merge,
    env_variable,
    known_keys,
    load_config,
)
from shared.kernel.config.models import (
    DEEPSPEED_OWNED,
    ArchConfig,
    DeepSpeedSection,
    LoraSection,
    ModelConfig,
    OptimSection,
    RolloutSection,
    SpeculateSection,
    TrainerSection,
    VllmSection,
)
from shared.kernel.config.pipeline import (
    ActionsConfig,
    BalanceSection,
    MqConfig,
    ParamSyncConfig,
    RolloutPoolSection,
)
from shared.kernel.config.root import ChorusConfig
from shared.kernel.config.run import (
    TRACKING_PACKAGES,
    LoggingSection,
    MlflowSection,
    NatsSection,
    PeersSection,
    RunSection,
    WandbSection,
)
from shared.kernel.config.train import (
    OBJECTIVE_KEYS,
    CriticSection,
    MarftSection,
    Objective,
    PoolSection,
    TrainConfig,
    model_objective,
)
from shared.kernel.config.workflow import (
    WORKFLOW_AGENTS,
    AgentConfig,
    EvalSection,
    RewardSection,
    TaskConfig,
    WorkflowConfig,
    WorkflowName,
)

__all__ = [
    "CONFIG_DIR", "DEEPSPEED_OWNED", "ENV_PREFIX", "OBJECTIVE_KEYS", "TRACKING_PACKAGES", "WORKFLOW_AGENTS",
    "ActionsConfig", "AgentConfig", "ArchConfig", "BalanceSection", "ChorusConfig", "ConfigError", "CriticSection",
    "DeepSpeedSection", "EvalSection", "LoggingSection", "LoraSection", "MarftSection", "MlflowSection",
    "ModelConfig", "MqConfig", "NatsSection", "Objective", "OptimSection", "ParamSyncConfig", "PeersSection",
    "PoolSection", "RewardSection", "RolloutPoolSection", "RolloutSection", "RunSection", "Section",
    "SpeculateSection", "TaskConfig", "TrainConfig", "TrainerSection", "VllmSection", "WandbSection",
    "WorkflowConfig", "WorkflowName", "config_from_yaml_text", "cross_section_problems", "deep_merge",
    "env_variable", "known_keys", "load_config", "model_objective", "resolve_function", "resolve_path",
]
