"""Checks across sections: pure functions from a built config to the problems they find, each naming its keys.

The root config runs them all after its sections are built and reports every problem at once; they change
nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.kernel.config.train import MarftSection, Objective
from shared.kernel.subjects import check_token

if TYPE_CHECKING:
    from shared.kernel.config.root import ChorusConfig


def cross_section_problems(cfg: ChorusConfig) -> list[str]:
    """Every problem across sections, in the order of the keys they name first; [] when there is none."""
    objectives, objective_problems = model_objectives(cfg)
    return [
        *name_problems(cfg),
        *agent_problems(cfg),
        *objective_problems,
        *workflow_problems(cfg),
        *batch_problems(cfg),
        # MARFT's checks read every model's objective: one that is wrong is reported above, and theirs wait for it
        *(marft_problems(cfg, objectives) if not objective_problems else []),
        *transport_problems(cfg),
    ]


def name_problems(cfg: ChorusConfig) -> list[str]:
    """Model names are NATS subject tokens."""
    return [p for p in (_token_problem(name, "model name") for name in cfg.models) if p]


def _token_problem(name: str, what: str) -> str | None:
    try:
        check_token(name, what)
    except ValueError as exc:
        return str(exc)
    return None


def agent_problems(cfg: ChorusConfig) -> list[str]:
    """Agent names are tokens, every agent's model exists, an adapter is of a model with LoRA, and a LoRA model
    has an adapter."""
    out = []
    for agent, a in cfg.agents.items():
        if bad_name := _token_problem(agent, "agent name"):
            out.append(bad_name)
        if a.model not in cfg.models:
            out.append(f"agents.{agent}.model: {a.model!r} is not one of models {sorted(cfg.models)}")
        elif a.adapter is not None and cfg.models[a.model].lora is None:
            out.append(f"agents.{agent}.adapter: model {a.model!r} has no `lora` section")
    for name, m in cfg.models.items():
        if m.lora is not None and not cfg.adapters_of(name):
            out.append(f"models.{name}.lora: no agent names an adapter of this model")
    return out


def model_objectives(cfg: ChorusConfig) -> tuple[dict[str, Objective], list[str]]:
    """Each model's objective (train.* with models.<m>.train over it), and the problems of those that fail."""
    objectives, problems = {}, []
    for name in cfg.models:
        try:
            objectives[name] = cfg.objective(name)
        except ValueError as exc:  # a per-model override that means nothing, named with its key
            problems.append(str(exc))
    return objectives, problems


def workflow_problems(cfg: ChorusConfig) -> list[str]:
    """The workflow's agents and judge exist, and its sampling fits the advantage's group."""
    out = []
    if cfg.train.advantage_group == "env" and cfg.workflow.sampling == "tree":
        out.append("train.advantage_group: env groups a task's rollouts; tree sampling's groups are the "
                   "candidates of one step (use sampling: parallel, or advantage_group: agent_turn)")
    if cfg.reward.judge is not None and cfg.reward.judge not in cfg.agents:
        out.append(f"reward.judge: agent {cfg.reward.judge!r} is not one of agents {sorted(cfg.agents)}")
    wf = cfg.workflow
    if wf.name == "solve_verify":  # its agents are these two (the workflow section holds them to it)
        for role in ("solver", "verifier"):
            agent = getattr(wf, role)
            if agent not in cfg.agents:
                out.append(f"workflow.{role}: agent {agent!r} is not one of agents {sorted(cfg.agents)}")
    else:
        for i, agent in enumerate(wf.agents):
            if agent not in cfg.agents:
                out.append(f"workflow.agents[{i}]: agent {agent!r} is not one of agents {sorted(cfg.agents)}")
    return out


def batch_problems(cfg: ChorusConfig) -> list[str]:
    """Held-out tasks cover the evaluation, and a global batch holds whole groups."""
    out = []
    if cfg.eval.every and cfg.task.heldout < cfg.eval.tasks:
        out.append(f"task.heldout ({cfg.task.heldout}) must be at least eval.tasks ({cfg.eval.tasks}): held-out "
                   "tasks are kept out of the training stream")
    if cfg.train.global_batch % cfg.workflow.group_size:
        out.append(f"train.global_batch ({cfg.train.global_batch}) must be a multiple of "
                   f"workflow.group_size ({cfg.workflow.group_size}): groups are never split")
    return out


def marft_problems(cfg: ChorusConfig, objectives: dict[str, Objective]) -> list[str]:
    """MARFT's settings mean something only with train.loss marft, and need a Flex-MG workflow."""
    on = [m for m, o in objectives.items() if o.loss == "marft"]
    if on and len(on) != len(objectives):
        off = sorted(set(objectives) - set(on))
        return [f"models.{off[0]}.train.loss: MARFT trains every agent against one critic; set train.loss: marft "
                "for the whole run, not per model"]
    if not on:
        if cfg.marft != MarftSection():  # a dumped config carries the defaults: only set keys are refused
            return [f"marft: read only when train.loss is marft (it is {cfg.train.loss!r}); remove the section or "
                    "set train.loss: marft"]
        return []
    out = []
    wf, mc, tc = cfg.workflow, cfg.marft, cfg.train
    if wf.name in ("mixture", "debate"):
        out.append(f"workflow.name: {wf.name} runs the agents of a round concurrently; MARFT needs them to act one "
                   "after another in each round (chain, solve_verify, solver_coder_refiner or a custom workflow "
                   "whose turns carry metadata.round)")
    if wf.sampling == "tree":
        out.append("workflow.sampling: tree sampling scores every step's candidates on their own; MARFT's "
                   "advantages come from the critic along whole episodes (use sampling: parallel)")
    if tc.grouping != "episode":
        out.append("train.grouping: MARFT's GAE is computed by the coordinator over whole episodes; set "
                   "grouping: episode")
    if any(o.kl_coef > 0 and o.kl_in == "reward" for o in objectives.values()):
        out.append("train.kl_in: reward changes rewards after the coordinator's GAE has used them; with "
                   "train.loss marft put the KL in the loss (kl_in: loss)")
    if mc.agent_interval and tc.mode == "async":
        out.append(f"marft.agent_interval: agent-by-agent updates (interval {mc.agent_interval}) hold the other "
                   "agents still while one learns from samples of the current policies, so they need an on-policy "
                   "mode: set train.mode sync or microbatch, or agent_interval: 0")
    elif mc.agent_interval:
        for model in cfg.models:
            agents = cfg.agents_of(model)
            shared = [a for a in agents if cfg.agents[a].adapter is None]
            if len(agents) > 1 and shared:
                out.append(f"marft.agent_interval: agents {agents} share model {model!r} and {shared} have no "
                           "adapter of their own, so one agent's update moves the others too; give each a LoRA "
                           "adapter or set agent_interval: 0")
                break
    if mc.critic.model is not None and mc.critic.model not in cfg.models:
        out.append(f"marft.critic.model: {mc.critic.model!r} is not one of models {sorted(cfg.models)}")
    return out


def transport_problems(cfg: ChorusConfig) -> list[str]:
    """The training pool's backends, the weight chunks' size and the sample queue's room."""
    out = []
    ds = deepspeed_models(cfg)
    slots = cfg.train.pool.slots
    for m in ds if slots else []:
        ranks = cfg.models[m].trainer.deepspeed.ranks
        if ranks > slots:
            out.append(f"models.{m}.trainer.deepspeed.ranks ({ranks}) is more than train.pool.slots ({slots}): in "
                       "the training pool a DeepSpeed group is a gang that takes one slot per rank, all at once")
    if cfg.paramsync.chunk_kb * 1024 > cfg.nats.max_payload_mb * 1024 * 1024:
        out.append(f"paramsync.chunk_kb ({cfg.paramsync.chunk_kb}) must fit in one NATS message "
                   f"(nats.max_payload_mb {cfg.nats.max_payload_mb})")
    if cfg.mq.capacity is not None and cfg.mq.capacity < cfg.train.global_batch:
        out.append(f"mq.capacity ({cfg.mq.capacity}) must be at least train.global_batch "
                   f"({cfg.train.global_batch}): a smaller backlog could never make a whole optimizer step")
    return out


def deepspeed_models(cfg: ChorusConfig) -> list[str]:
    """The models trained with the DeepSpeed backend, sorted."""
    return sorted(m for m, c in cfg.models.items() if c.trainer.backend == "deepspeed")
