"""How a run trains: the policy objective (for every model, or one), the batch and the pipeline mode, the advantage
estimator, MARFT and its critic, and the training pool."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from shared.kernel.config.base import Section


class Objective(Section):
    """The policy loss and its regularisers (docs/algorithms.md): ``train.<key>`` for every model,
    ``models.<m>.train.<key>`` for one model."""

    # The policy loss (docs/algorithms.md). ppo_clip: PPO-clip of pi_theta against the behaviour policy mu
    # (verl's bypass mode). decoupled: decoupled PPO as AReaL implements it, the clip centred on the
    # proximal policy (the weights before the step) and pi_prox / mu as an importance weight.
    # marft: MARFT's action-level PPO against the central critic's GAE advantages (the `marft` section,
    # docs/marft.md); for the whole run, set in train.loss. Any name registered in shared/rlmath/losses.py
    # (register_policy_loss); `chorus check` and the trainer refuse one that is not.
    loss: str = Field(default="ppo_clip", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    clip_eps: float = Field(default=0.2, gt=0.0, lt=1.0)
    # dual-clip: a negative-advantage token's loss is at most clip_ratio_c * |A| (null: off); verl's default 3
    clip_ratio_c: float | None = Field(default=3.0, gt=1.0)
    # decoupled only: tokens whose pi_prox / mu exceeds this leave the loss (null: no cap)
    behav_imp_weight_cap: float | None = Field(default=None, gt=1.0)
    # entropy bonus: the loss minus entropy_coef times the policy's entropy at the response positions, aggregated
    # as the policy loss (0: none; the entropy is logged either way)
    entropy_coef: float = Field(default=0.0, ge=0.0)
    # KL to the reference policy (the frozen base of a LoRA model, its adapters disabled; a frozen copy of the
    # initial weights otherwise). 0: off, no reference is kept. kl_in loss: kl_coef * agg(k_t) is added to the
    # loss; reward: kl_coef * sum_t k_t(mu, ref) is subtracted from each sample's reward before its advantage.
    kl_coef: float = Field(default=0.0, ge=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"

    @model_validator(mode="after")
    def _loss_options(self) -> Objective:
        if self.behav_imp_weight_cap is not None and self.loss != "decoupled":
            raise ValueError(f"behav_imp_weight_cap: caps the importance weight pi_prox / mu of the decoupled loss, "
                             f"but loss is {self.loss!r}; set loss: decoupled or remove the cap")
        return self


OBJECTIVE_KEYS = tuple(Objective.model_fields)


class CriticSection(Section):
    """MARFT's central critic (§4.2.1): a frozen base model with a trainable MLP head, its own optimizer."""

    model: str | None = None  # the configured model whose base it reads; null: the model of the workflow's first agent
    head_sizes: list[int] = Field(default_factory=lambda: [1024, 512])  # hidden -> 1024 -> 512 -> 1 (ReLU, no bias)
    lr: float = Field(default=1e-5, gt=0)  # Adam (eps 1e-5); MARFT's Table 5
    grad_clip: float | None = Field(default=0.5, gt=0)  # null: no clipping
    value_clip: float | None = Field(default=0.2, gt=0)  # the clipped value loss's range; null: the plain loss
    huber_delta: float | None = Field(default=None, gt=0)  # null: the squared error
    batch: int | None = Field(default=None, ge=1)  # observations per critic step; null: train.global_batch
    threads: int = Field(default=1, ge=1)


class MarftSection(Section):
    """MARFT (docs/marft.md), read when train.loss is marft."""

    # action: MARFT-A, a whole generation is one action; token: MARFT-T, every token is an action
    variant: Literal["action", "token"] = "action"
    gamma: float = Field(default=0.99, ge=0.0, le=1.0)  # discount per agent hop (per token hop in MARFT-T)
    gae_lambda: float = Field(default=0.95, ge=0.0, le=1.0)  # GAE's lambda, per hop as gamma
    # the action's log-probability divided by 1 (none), its token count (token) or its word count (word)
    action_norm: Literal["none", "token", "word"] = "none"
    # agent-by-agent updates: the agent (in workflow order) whose policy version v trains is (v // interval) % n;
    # 0: every agent at every step. Only in the on-policy modes (train.mode sync or microbatch).
    agent_interval: int = Field(default=0, ge=0)
    # the trust-region cut: a step whose approximate KL is above this is skipped; null: no cut
    kl_target: float | None = Field(default=0.02, gt=0)
    # the cut's KL: action, k3 of each whole action's log-ratio averaged over the actions (the paper's listing);
    # token, k3 of each token's log-ratio averaged over the tokens (about the action's value over its length)
    kl_level: Literal["action", "token"] = "action"
    warmup: int = Field(default=0, ge=0)  # the first versions in which only the critic trains
    critic: CriticSection = Field(default_factory=CriticSection)


class PoolSection(Section):
    """FlexMARL's training pool (docs/training-pool.md): with ``slots`` > 0 every model's trainer is a tenant of
    ``slots`` slots (each ``cores`` cores and a worker process), holding one only while it trains, its state swapped
    to host memory in between; 0 keeps one trainer process per model, holding its cores the whole run."""

    slots: int = Field(default=0, ge=0)  # 0: a trainer process per model; N: every model's trainer shares N slots
    cores: int | None = Field(default=None, ge=1)  # cores per slot; None: an equal share of this machine's
    # warm: slot processes stay between tenants and only the state moves; destroy: a slot's process ends when its
    # model releases it (suspend-to-destroy) and the next tenant starts a fresh one
    mode: Literal["warm", "destroy"] = "warm"
    budget_mb: float = Field(default=2048, ge=0)  # host memory for swapped states; beyond it they spill to <run>/pool
    attempts: int = Field(default=3, ge=1)  # a call whose slot process dies runs again on a fresh one, this often


class TrainConfig(Objective):
    max_versions: int = Field(default=50, ge=1)
    global_batch: int = Field(default=64, ge=1)  # samples per optimizer step
    micro_batch: int = Field(default=32, ge=1)  # samples per micro-batch from mq (whole groups)
    # sync: generate a whole global batch, then train on it (the barrier baseline). microbatch: FlexMARL's
    # pipeline, training starts on micro-batches while the rest of the batch generates, one step per global
    # batch, the next batch waits for the new weights (max_staleness 0). async: rollouts never wait,
    # samples older than max_staleness are dropped and counted.
    mode: Literal["sync", "microbatch", "async"] = "async"
    max_staleness: int = Field(default=2, ge=0)
    # AT-GRPO advantages. episode: the coordinator computes them over each whole (env, agent, turn) group
    # once all rollouts of a task are done, and mq dispatches whole groups. trainer: the trainer groups the
    # samples of each micro-batch it receives by (env, agent, turn); mq does not wait for whole groups.
    grouping: Literal["episode", "trainer"] = "episode"
    # The advantage estimator (docs/algorithms.md#advantages): grpo, dr_grpo (no std normalisation) and rloo within
    # each AT-GRPO group; reinforce_pp whitens the returns over the whole global batch (the trainer holds a batch's
    # micro-batches until it is complete, then runs them).
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    # The group an advantage's baseline is taken over. agent_turn: AT-GRPO's (env, agent, turn). env: plain
    # GRPO's, every agent's every turn of one task (env) together, computed by the coordinator over the whole
    # episode (grouping episode, a group estimator). Dispatch is by AT-GRPO group either way.
    advantage_group: Literal["agent_turn", "env"] = "agent_turn"
    # Every version is committed to the object store (weights and optimizer) before its micro-batches are acked;
    # this adds a file runs/<id>/checkpoints/<model>/v<N>.pt every this many versions (0 = none on the way); the
    # final version's file is always written (`chorus export` turns it into a Hugging Face directory).
    checkpoint_every: int = Field(default=25, ge=0)
    threads: int = Field(default=1, ge=1)
    ack_wait_s: float = 60.0
    pool: PoolSection = Field(default_factory=PoolSection)

    @model_validator(mode="after")
    def _env_groups(self) -> TrainConfig:
        if self.advantage_group == "env" and (self.grouping != "episode" or self.advantage == "reinforce_pp"
                                               or self.loss == "marft"):
            raise ValueError("advantage_group: env (plain GRPO's group of a whole task) is computed by the "
                             "coordinator over each finished episode: it needs grouping episode, a group "
                             f"estimator (grpo, dr_grpo, rloo) and a GRPO-family loss (got grouping "
                             f"{self.grouping!r}, advantage {self.advantage!r}, loss {self.loss!r})")
        return self

    @model_validator(mode="after")
    def _on_policy_modes(self) -> TrainConfig:
        if self.mode in ("sync", "microbatch") and self.max_staleness != 0:
            raise ValueError(f"max_staleness: train.mode {self.mode!r} trains every sample on the weights that "
                             f"generated it, so max_staleness must be 0 (got {self.max_staleness}); "
                             "use mode 'async' for stale samples")
        return self


def model_objective(train: TrainConfig, model: str, patch: dict[str, Any]) -> Objective:
    """The policy loss and regularisers of ``model``: ``train``'s with the model's own ``patch`` over them; a
    ValueError naming ``models.<model>.train.<key>`` for a key that is not per-model or a value that is wrong."""
    for key in patch:
        if key not in OBJECTIVE_KEYS:
            raise ValueError(f"models.{model}.train.{key}: not a per-model key; a model may set "
                             f"{', '.join(OBJECTIVE_KEYS)} (the rest of train.* is one for the run)")
    try:  # train.* alone passed these checks already: an error here is the model's
        return Objective(**{**train.model_dump(include=set(OBJECTIVE_KEYS)), **patch})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"models.{model}.train{'.' + where if where else ''}: "
                         f"{err['msg'].removeprefix('Value error, ')}"
                         + (f" (got {err['input']!r})" if where else "")) from None
