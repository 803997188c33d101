"""What a run plays: the agents, the workflow that has them take turns, the task stream, the reward and the held-out
evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shared.kernel.config.base import FUNCTION_SPEC, Section, resolve_function, resolve_path
from shared.kernel.schemas import MAX_NEW_TOKENS
from shared.kernel.subjects import check_token


class AgentConfig(Section):
    model: str
    adapter: str | None = None  # a LoRA adapter of `model` (needs models.<model>.lora)
    prompt: str = ""  # the agent's system prompt

    @field_validator("adapter")
    @classmethod
    def _adapter_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        check_token(v, "adapter")
        if "lora" in v.lower():
            # peft matches adapter names as substrings of module names such as `lora_A`
            raise ValueError(f"adapter name {v!r} must not contain 'lora'")
        return v


# The coordinator's built-in workflows (services/coordinator/workflows) and custom, named here so that a config
# validates without importing the coordinator (docs/index.md, "Where the code lives").
WorkflowName = Literal["solve_verify", "debate", "chain", "mixture", "solver_coder_refiner", "custom"]
# How many participants each workflow takes: (fewest, most); None means no upper limit.
WORKFLOW_AGENTS: dict[str, tuple[int, int | None]] = {
    "solve_verify": (2, 2), "debate": (2, None), "chain": (1, None), "mixture": (2, None),
    "solver_coder_refiner": (3, 3), "custom": (0, None),
}


class WorkflowConfig(Section):
    # solve_verify: `solver` answers, `verifier` gives the final answer. debate, chain, mixture and
    # solver_coder_refiner play their turn orders over `agents` (docs/workflows.md). custom: `function`.
    name: WorkflowName = "solve_verify"
    agents: list[str] = Field(default_factory=list)  # participants in order; mixture: the last one aggregates
    rounds: int | None = Field(default=None, ge=1)  # debate rounds (default 2), chain passes, mixture layers (1)
    # chain only: after a round whose last answer is wrong, the next round is shown that answer and that it is
    # wrong; a right answer ends the episode (`rounds` is then the horizon: MARFT's environment with feedback)
    feedback: bool = False
    function: str | None = None  # custom: "path/to/file.py:function_name", relative to the config file or cwd
    echo_chars: int | None = Field(default=None, ge=1)  # characters of an earlier turn shown later; None: all
    solver: str = "solver"  # agent names of solve_verify
    verifier: str = "verifier"
    concurrency: int = Field(default=8, ge=1)  # K tasks in flight, each with G rollouts
    group_size: int = Field(default=8, ge=1)  # G
    max_new_tokens: int = Field(default=4, ge=1, le=MAX_NEW_TOKENS)  # what one generation request may carry
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # parallel: group_size independent rollouts per task. tree: one rollout per task; every agent step
    # samples group_size candidates, scores them with the task's check, and the episode goes on from the
    # best (AT-GRPO's tree-structured sampling); the candidates of a step form its group.
    sampling: Literal["parallel", "tree"] = "parallel"
    # The user's workflow code: one call (one rollout of a task) that runs longer than step_timeout_s is
    # cancelled; a task whose workflow raised or timed out is tried again `retries` times, after a backoff that
    # doubles from backoff_s to backoff_max_s; after max_failures failures in all the run stops with the error.
    step_timeout_s: float = Field(default=600.0, gt=0)
    retries: int = Field(default=1, ge=0)
    backoff_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    max_failures: int = Field(default=20, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _absolute_function(cls, data: Any) -> Any:
        """A custom workflow's file made absolute while the config's directory is known (a copy is read elsewhere)."""
        if isinstance(data, dict) and data.get("name") == "custom" and isinstance(data.get("function"), str):
            return {**data, "function": resolve_function(data["function"])}
        return data

    @model_validator(mode="after")
    def _shape(self) -> WorkflowConfig:
        if self.name == "custom":
            if self.function is None:
                raise ValueError("workflow.function: required when workflow.name is 'custom' "
                                 "(e.g. 'my_workflow.py:critique')")
            if FUNCTION_SPEC.match(self.function) is None:
                raise ValueError(f"workflow.function: expected 'path/to/file.py:function_name', got {self.function!r}")
        elif self.function is not None:
            raise ValueError(f"workflow.function: only read when workflow.name is 'custom' (it is {self.name!r})")
        n, (lo, hi) = len(self.agents), WORKFLOW_AGENTS[self.name]
        if self.name == "solve_verify":
            if self.agents and self.agents != [self.solver, self.verifier]:
                raise ValueError("workflow.agents: solve_verify takes its agents from workflow.solver and "
                                 "workflow.verifier; leave workflow.agents out")
        elif n < lo or (hi is not None and n > hi):
            want = f"exactly {lo}" if lo == hi else f"at least {lo}"
            raise ValueError(f"workflow.agents: {self.name} takes {want} agents, got {n}: {self.agents}")
        if self.name == "debate" and len(set(self.agents)) != n:
            raise ValueError(f"workflow.agents: debate agents must be distinct, got {self.agents}")
        if self.feedback and self.name != "chain":
            raise ValueError(f"workflow.feedback: only the chain workflow plays rounds with feedback (it is {self.name!r})")
        if self.name in ("solve_verify", "solver_coder_refiner") and self.rounds not in (None, 1):
            raise ValueError(f"workflow.rounds: {self.name} has one round, got {self.rounds}")
        return self


class TaskConfig(Section):
    # arithmetic: "3+4=" for tiny models; word: arithmetic word problems; code: small functions with assert
    # tests; jsonl: a user dataset at `path`, one {"question", "answer"} object per line; gsm8k: the GSM8K
    # problems shipped in data/gsm8k; reasoning_gym: the reasoning-gym dataset `dataset`; humaneval: OpenAI's 164
    # HumanEval problems; verl: rows in verl's RL dataset schema at `path` (.parquet or .jsonl). docs/data.md.
    name: Literal["arithmetic", "word", "code", "jsonl", "gsm8k", "reasoning_gym", "humaneval", "verl"] = "arithmetic"
    # arithmetic only. compact: "3+4=", answered by the number the response starts with (a completion, for
    # tiny byte models); question: "What is 3 + 4?", answered by the response's final answer (chat models).
    phrasing: Literal["compact", "question"] = "compact"
    max_operand: int = Field(default=4, ge=1)  # arithmetic operands in 0..max_operand
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: list[Literal["+", "-", "*"]](["+"]))
    modulo: int | None = 10  # answers reduced mod this (a single digit by default)
    max_value: int = Field(default=20, ge=2)  # largest number in word and code problems
    path: Path | None = None  # jsonl and verl datasets
    heldout: int = Field(default=0, ge=0)  # held-out tasks kept out of the training stream
    split: Literal["train", "test"] = "train"  # gsm8k: the file training draws from (held-out items come out of it)
    dataset: str | None = None  # reasoning_gym: the dataset name (chain_sum, basic_arithmetic, countdown, ...)
    # reasoning_gym: keyword arguments of reasoning_gym.create_dataset(dataset, seed=..., size=..., **config)
    dataset_config: dict[str, Any] = Field(default_factory=dict)
    size: int = Field(default=100_000, ge=1)  # reasoning_gym: items per seed (training cycles through them)
    # reasoning_gym: what of a reply its dataset's score_answer scores. tags: what is between <answer> and
    # </answer> (reasoning-gym's extract_answer; none: None). flexible: that, or with no tags the reply's final
    # answer as GSM8K's extractor finds it ("The answer is 6.", \boxed{6}, the last number).
    answer: Literal["tags", "flexible"] = "tags"
    # Text appended to every question (gsm8k, reasoning_gym, humaneval, verl); null: the task's default
    # (docs/data.md), "": none.
    instruction: str | None = None

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, v: Path | None) -> Path | None:
        return None if v is None else resolve_path(v)

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> TaskConfig:
        if self.name in ("jsonl", "verl") and self.path is None:
            what = "a JSONL file" if self.name == "jsonl" else "a verl-format .parquet or .jsonl file"
            raise ValueError(f"path: a task with name {self.name!r} needs the path of {what}")
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("dataset: task.name reasoning_gym needs the reasoning-gym dataset name, e.g. "
                             "'chain_sum' (reasoning_gym.factory.DATASETS lists them)")
        if self.name != "reasoning_gym" and (self.dataset is not None or self.dataset_config):
            raise ValueError(f"dataset: only read when task.name is 'reasoning_gym' (it is {self.name!r})")
        if self.name != "reasoning_gym" and self.answer != "tags":
            raise ValueError(f"answer: only read when task.name is 'reasoning_gym' (it is {self.name!r})")
        return self


class RewardSection(Section):
    """MARTI reward shaping of each agent's turn rewards, an optional LLM judge, an optional reward function."""

    shaping: Literal["none", "quality", "margin"] = "none"
    scope: Literal["last", "all"] = "all"  # history of the shaping: the previous turn, or all earlier turns
    alpha: float = Field(default=0.5, ge=0.0)
    judge: str | None = None  # an agent that scores responses
    # "path/to/file.py:compute_score" (relative to the config file or cwd), verl's signature
    # compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict; it replaces the
    # task's own check and runs in the actions workers (docs/data.md).
    function: str | None = None
    # Shaping, asked for by name: a wrong whole number close to a whole-number answer earns
    # 0.5 * max(0, 1 - |got - expected| / 10) from check_answer and check_math (0 without it).
    partial_credit: bool = False
    # The run stops after this many samples in a row whose reward function failed, none scored in between.
    max_errors: int = Field(default=20, ge=1)
    # A model whose groups all gave their samples one reward for this many steps' worth of groups gets a warning.
    warn_after_steps: int = Field(default=5, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _absolute_function(cls, data: Any) -> Any:
        """``reward.function``'s file made absolute like ``workflow.function``'s."""
        if isinstance(data, dict) and isinstance(data.get("function"), str):
            return {**data, "function": resolve_function(data["function"])}
        return data

    @model_validator(mode="after")
    def _function(self) -> RewardSection:
        if self.function is not None:
            if FUNCTION_SPEC.match(self.function) is None:
                raise ValueError(f"reward.function: expected 'path/to/file.py:compute_score', got {self.function!r}")
            if self.judge is not None:
                raise ValueError("function: reward.function and reward.judge both score every turn; set one")
        return self


class EvalSection(Section):
    """Held-out evaluation every ``every`` versions (0 = off): pass@1 (mean of n samples), pass@k, Maj@N and tokens
    per question, with the same tasks and settings every time."""

    every: int = Field(default=0, ge=0)  # versions between evaluations; also at version 0 and at the end
    tasks: int = Field(default=32, ge=1)  # held-out tasks (needs task.heldout >= tasks)
    temperature: float = Field(default=0.0, ge=0.0)  # 0 = greedy
    samples: int = Field(default=1, ge=1)  # n rollouts per task: pass@1 is their mean, Maj@N their vote
    pass_k: list[int] | None = None  # the k of pass@k, each in [1, samples]; null: 1, 2, 4, ... and samples
    # A held-out task whose episode fails (no answer in time, a workflow error) is played again up to this many
    # times; one that fails every time counts as wrong (the record's failed, retried and errors say so).
    retries: int = Field(default=2, ge=0)
    final_timeout_s: float = Field(default=300.0, gt=0)  # how long `chorus up` waits for the last evaluation

    @model_validator(mode="after")
    def _sampling(self) -> EvalSection:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"samples: {self.samples} greedy rollouts of a task are {self.samples} copies of one "
                             "answer; set eval.temperature > 0 or eval.samples: 1")
        for k in self.pass_k or []:
            if not 1 <= k <= self.samples:
                raise ValueError(f"pass_k: pass@{k} needs k in [1, eval.samples = {self.samples}]")
        return self


def with_workflow_agents(data: dict[str, Any]) -> dict[str, Any]:
    """The raw config with ``workflow.agents`` filled where the workflow implies them and they are left out:
    solve_verify's are workflow.solver and workflow.verifier, a custom workflow's every agent in order."""
    wf, agents = data.get("workflow", {}), data.get("agents")
    if isinstance(wf, WorkflowConfig):
        if wf.agents:
            return data
        fill = _implied_agents(wf.name, wf.solver, wf.verifier, agents)
        return data if fill is None else {**data, "workflow": wf.model_copy(update={"agents": fill})}
    if not isinstance(wf, dict) or wf.get("agents", []) != []:
        return data
    fields = WorkflowConfig.model_fields
    name, solver, verifier = (wf.get(k, fields[k].default) for k in ("name", "solver", "verifier"))
    fill = _implied_agents(name, solver, verifier, agents)
    return data if fill is None else {**data, "workflow": {**wf, "agents": fill}}


def _implied_agents(name: Any, solver: Any, verifier: Any, agents: Any) -> list[str] | None:
    if name == "solve_verify" and isinstance(solver, str) and isinstance(verifier, str):
        return [solver, verifier]
    if name == "custom" and isinstance(agents, dict) and all(isinstance(a, str) for a in agents):
        return list(agents)
    return None
