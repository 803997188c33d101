"""The whole run's config: its sections, the keys other sections imply, the checks across them, and what is
derived from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.kernel.config.checks import cross_section_problems
from shared.kernel.config.models import ModelConfig
from shared.kernel.config.pipeline import (
    ActionsConfig,
    BalanceSection,
    MqConfig,
    ParamSyncConfig,
    RolloutPoolSection,
)
from shared.kernel.config.run import LoggingSection, NatsSection, PeersSection, RunSection
from shared.kernel.config.train import MarftSection, Objective, TrainConfig, model_objective
from shared.kernel.config.workflow import (
    AgentConfig,
    EvalSection,
    RewardSection,
    TaskConfig,
    WorkflowConfig,
    with_workflow_agents,
)


class ChorusConfig(BaseSettings):
    """A whole run."""

    model_config = SettingsConfigDict(
        env_prefix="CHORUS_", env_nested_delimiter="__", extra="forbid", case_sensitive=False
    )

    run: RunSection = Field(default_factory=RunSection)
    nats: NatsSection = Field(default_factory=NatsSection)
    models: dict[str, ModelConfig]
    agents: dict[str, AgentConfig]
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    reward: RewardSection = Field(default_factory=RewardSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    train: TrainConfig = Field(default_factory=TrainConfig)
    marft: MarftSection = Field(default_factory=MarftSection)
    mq: MqConfig = Field(default_factory=MqConfig)
    actions: ActionsConfig = Field(default_factory=ActionsConfig)
    paramsync: ParamSyncConfig = Field(default_factory=ParamSyncConfig)
    peers: PeersSection = Field(default_factory=PeersSection)
    balance: BalanceSection = Field(default_factory=BalanceSection)
    rollouter: RolloutPoolSection = Field(default_factory=RolloutPoolSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    metrics_interval_s: float = 2.0  # every service publishes its metrics on metrics.<service>.<id> this often

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment overrides the YAML file (passed as init kwargs).
        return (env_settings, init_settings)

    @model_validator(mode="before")
    @classmethod
    def _implied_keys(cls, data: Any) -> Any:
        """Keys other sections imply, filled in the raw config before it is built (workflow.agents)."""
        return with_workflow_agents(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross_checks(self) -> ChorusConfig:
        problems = cross_section_problems(self)
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @property
    def marft_on(self) -> bool:
        """Whether the run trains with MARFT (train.loss marft): a critic service, GAE in the coordinator."""
        return self.train.loss == "marft"

    def marft_agents(self) -> list[str]:
        """The agents in the order they act within a round (MARFT's agent index i)."""
        return list(self.workflow.agents) or list(self.agents)

    def critic_model(self) -> str:
        """The model whose base the critic reads (marft.critic.model, else the first agent's)."""
        return self.marft.critic.model or self.agents[self.marft_agents()[0]].model

    # --- derived --------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return self.run.dir / self.run.id

    def agents_of(self, model: str) -> list[str]:
        return [a for a, c in self.agents.items() if c.model == model]

    def objective(self, model: str) -> Objective:
        """The policy loss and regularisers of ``model``: train.* with ``models.<model>.train`` over it."""
        return model_objective(self.train, model, self.models[model].train)

    def adapters_of(self, model: str) -> list[str]:
        """The LoRA adapters of ``model`` named by agents, sorted (agents may share one)."""
        return sorted({c.adapter for c in self.agents.values() if c.model == model and c.adapter})

    @property
    def cache_dir(self) -> Path:
        """Shared by every run under ``run.dir``: dequantised model weights and tokenizers."""
        return self.run.dir / "_cache"

    @property
    def rollouter_fleet(self) -> int:
        """Rollouter instances the run starts: every model's, and the rollout pool's."""
        return sum(m.rollouter.instances for m in self.models.values()) + self.rollouter.pool

    @property
    def keepalive_s(self) -> float:
        """How often an instance whose load did not change reports it (``balance.keepalive_for`` the fleet)."""
        return self.balance.keepalive_for(self.rollouter_fleet)

    @property
    def heartbeat_s(self) -> float:
        """The longest a live rollouter instance stays silent (``balance.heartbeat_for`` the fleet)."""
        return self.balance.heartbeat_for(self.rollouter_fleet)

    @property
    def mq_capacity(self) -> int:
        if self.mq.capacity is not None:
            return self.mq.capacity
        # MARFT's episodes end early, so its groups and batches vary in size: a step may take more than one global
        # batch's samples, and one more batch of room keeps the on-policy gate from waiting on the backlog
        return (self.train.max_staleness + (2 if self.marft_on else 1)) * self.train.global_batch

    def micro_batch_groups(self) -> int:
        """Whole groups per micro-batch (at least one)."""
        return max(1, self.train.micro_batch // self.workflow.group_size)

    def dump_yaml(self) -> str:
        """The config as YAML, secrets left out (nats.password and nats.token are null: pass them in the
        environment, see :meth:`secret_env`)."""
        data = self.model_dump(mode="json")
        data["nats"].update(password=None, token=None)
        return yaml.safe_dump(data, sort_keys=False)

    def secret_env(self) -> dict[str, str]:
        """``CHORUS_NATS__PASSWORD`` / ``CHORUS_NATS__TOKEN`` for the secrets :meth:`dump_yaml` leaves out."""
        out = {}
        for key in ("password", "token"):
            value = getattr(self.nats, key)
            if value is not None:
                out[f"CHORUS_NATS__{key.upper()}"] = value.get_secret_value()
        return out
