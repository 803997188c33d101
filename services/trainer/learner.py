"""The torch learner: forward/backward of micro-batches, gradient accumulation, one optimizer step per global batch.

Knows nothing of NATS. Every method runs torch work, so the service calls it from one worker thread. A LoRA
model trains only its adapters: every row is routed to its sample's adapter, so all adapters of the base move
in the same optimizer step. A micro-batch is cut into length-sorted sub-batches that pad little
(:func:`services.trainer.logprobs.pack_rows`), each run forward and backward on its own: the loss is a sum of
per-sample terms over ``global_batch``, so the accumulated gradient is the one of the whole micro-batch.

The network lives on ``models.<m>.device`` in ``models.<m>.dtype``; the loss math (log-softmax, ratios) is
float32. Checkpoints and committed states hold CPU tensors and load onto the device.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from services.trainer import optstep
from services.trainer.advantages import micro_batch_advantages
from services.trainer.logprobs import (
    PAD_BOUND,
    ResponseScorer,
    SharedBatch,
    pack_rows,
    pack_shared,
    prompt_groups,
    shared_width,
)
from services.trainer.marft_step import marft_step
from shared.kernel.config import ChorusConfig, ConfigError
from shared.kernel.schemas import Sample
from shared.kernel.validation import arrays_problem, numbers_problem
from shared.models.loading import context_length, load_model, load_tokenizer, resolve_device, shipped_tensors
from shared.rlmath.advantages import batch_advantages, batch_token_advantages
from shared.rlmath.losses import LossSettings, PolicyBatch, kl_estimate, loss_name, policy_loss, regularised

_CKPT = re.compile(r"^v(\d+)\.pt$")


@dataclass
class Collated:
    """A right-padded batch: ``input_ids``/``attention_mask`` [B, L]; targets and masks on shifted positions [B, L-1]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    logp_behav: torch.Tensor
    adapters: list[str | None] = field(default_factory=list)  # per row: the LoRA adapter of its sample

    def to(self, device: torch.device) -> Collated:
        """The same batch with its tensors on ``device``."""
        return Collated(self.input_ids.to(device), self.attention_mask.to(device), self.targets.to(device),
                        self.loss_mask.to(device), self.logp_behav.to(device), list(self.adapters))


@dataclass
class StepResult:
    version: int
    samples: int
    loss: float
    grad_norm: float
    stats: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # the gradient norm was not finite: no update, the version stays
    # MARFT: samples of the batch the step did not train, by drop reason (another agent's turn to learn, the
    # critic's warm-up, the trust-region cut), and what to say about each reason; the version still moves on
    untrained: dict[str, list[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)


def collate(samples: Sequence[Sample], pad_id: int) -> Collated:
    """Prompt + response, right-padded with ``pad_id``; only response tokens are in the loss mask (shifted by one)."""
    seqs = [(s.prompt_ids.numpy().astype("int64"), s.response_ids.numpy().astype("int64"),
             s.behavior_logprobs.numpy().astype("float32")) for s in samples]
    width = max(len(p) + len(r) for p, r, _ in seqs)
    b = len(seqs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, max(width - 1, 1)), dtype=torch.float32)
    logp_behav = torch.zeros((b, max(width - 1, 1)), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(seqs):
        n = len(p) + len(r)
        input_ids[i, : len(p)] = torch.from_numpy(p)
        input_ids[i, len(p) : n] = torch.from_numpy(r)
        attention[i, :n] = 1
        # Position t of the shifted view predicts token t + 1: response token j sits at len(p) + j.
        start = len(p) - 1
        loss_mask[i, start : start + len(r)] = 1.0
        logp_behav[i, start : start + len(r)] = torch.from_numpy(lp)
    return Collated(input_ids, attention, input_ids[:, 1:], loss_mask, logp_behav, [s.adapter for s in samples])


def validate_sample(s: Sample, vocab_size: int, adapters: Sequence[str] | None,
                    context: int | None = None) -> str | None:
    """Why a sample cannot be trained on, or None when it can.

    ``adapters``: the LoRA adapters of the model, or None for a full model (whose samples name no adapter).
    """
    why = adapter_problem(s, adapters) or numbers_problem(s) or arrays_problem(s, vocab_size, context)
    return None if why is None else f"sample {s.sample_id}: {why}"


def adapter_problem(s: Sample, adapters: Sequence[str] | None) -> str | None:
    """Why a model with LoRA ``adapters`` (None: a full model) cannot train on ``s``'s adapter, or None."""
    if adapters is None and s.adapter is not None:
        return f"adapter {s.adapter!r}, but this model has no LoRA adapters"
    if adapters is not None and s.adapter not in adapters:
        return (f"adapter {s.adapter!r} is not one of the model's adapters {sorted(adapters)} "
                "(the base of a LoRA model is frozen; check agents.<agent>.adapter)")
    return None


class Learner:
    """One model with AdamW over its trainable tensors; gradients accumulate across micro-batches until ``global_batch``.

    A full model trains every parameter in train mode. A LoRA model trains only its adapters, in eval mode:
    peft routes rows to different adapters only in eval mode, and with LoRA dropout 0 the two modes compute
    the same function.
    """

    def __init__(self, cfg: ChorusConfig, model: str) -> None:
        self.model_name = model
        self.global_batch = cfg.train.global_batch
        obj = cfg.objective(model)  # train.* with models.<model>.train over it
        self.clip_eps = obj.clip_eps
        self.loss_name, self.loss_agg = obj.loss, obj.loss_agg
        # the registered policy loss (shared/rlmath/losses.py): nothing else computes one
        try:
            self.policy_loss = policy_loss(loss_name(obj.loss, cfg.marft.variant))
        except ValueError as exc:  # a name no restart will register: the trainer stops for good, saying which
            raise ConfigError(f"train.loss: {exc}") from None
        self.clip_ratio_c, self.behav_imp_weight_cap = obj.clip_ratio_c, obj.behav_imp_weight_cap
        self.entropy_coef = obj.entropy_coef
        self.kl_coef, self.kl_estimator = obj.kl_coef, obj.kl_estimator
        self.kl_reward = obj.kl_coef > 0 and obj.kl_in == "reward"  # the penalty goes into the rewards
        self.kl_loss = obj.kl_coef > 0 and obj.kl_in == "loss"  # the estimate goes into the loss
        # reinforce_pp normalises over the global batch: its samples are held until the batch is in; so does MARFT
        # (its step takes the whole batch: services/trainer/marft_step.py)
        self.marft = obj.loss == "marft"
        self.batch_level = cfg.train.advantage == "reinforce_pp" or self.marft
        self.marft_cfg = cfg.marft
        self.marft_agents = cfg.marft_agents()
        self.agent_models = {a: cfg.agents[a].model for a in cfg.agents}
        self._held: list[Sample] = []
        mcfg = cfg.models[model]
        optim = mcfg.optim
        self.grad_clip = optim.grad_clip
        # Behaviour log-probs are taken after temperature, so pi_theta must be scored the same way.
        t = cfg.workflow.temperature
        self.temperature = t if t > 0 else 1.0
        self.lora = mcfg.lora is not None
        if mcfg.lora is not None and mcfg.lora.dropout > 0:
            raise ValueError(f"models.{model}.lora.dropout is {mcfg.lora.dropout}: mixed-adapter training runs "
                             "in eval mode, where dropout is off; set it to 0")
        self.adapters: list[str] | None = cfg.adapters_of(model) if self.lora else None
        self.tokenizer = load_tokenizer(cfg, model)
        self.pad_id = self.tokenizer.pad_id
        self.device = resolve_device(cfg, model)
        self.net = load_model(cfg, model, self.device)
        self.net.train(not self.lora)
        self.vocab_size = int(self.net.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        self.context = context_length(self.net)
        self.scorer = ResponseScorer(self.net, self.temperature)
        self.scorer.entropy = "bonus" if obj.entropy_coef > 0 else "metric"
        # The KL reference: a LoRA model's own base with its adapters disabled (no extra memory); a full model's
        # frozen copy of the weights it starts from (one more copy of the model on its device).
        self.reference: ResponseScorer | None = None
        if obj.kl_coef > 0:
            ref_net = self.net if self.lora else copy.deepcopy(self.net).eval().requires_grad_(False)
            self.reference = ResponseScorer(ref_net, self.temperature)
        self.pad_bound = PAD_BOUND  # inf: every micro-batch in one pass
        self.share_prompts = True  # samples with one prompt run it once (False: one row per sample)
        self.trainable = [p for p in self.net.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=optim.lr, betas=(optim.betas[0], optim.betas[1]),
                                           eps=optim.eps, weight_decay=optim.weight_decay)
        self.optim, self.max_versions = optim, cfg.train.max_versions
        self.version = 0
        self.accumulated = 0
        self._loss_sum = 0.0
        self._parts: list[dict[str, float]] = []  # loss statistics of each sub-batch since the last step
        self._reward_kl: list[dict[str, float]] = []  # kl_in reward: the penalties' statistics since the last step

    def validate(self, sample: Sample) -> str | None:
        """Why this learner cannot train on ``sample`` (ids outside its vocabulary, an adapter it lacks), or None."""
        return validate_sample(sample, self.vocab_size, self.adapters, self.context)

    def token_logprobs(self, batch: Collated) -> torch.Tensor:
        """log pi_theta of the response tokens, [B, L-1] float32 (0 outside the loss mask); a LoRA model runs each
        row through its sample's adapter. ``batch`` must be on the learner's device."""
        routing: list[str] | None = None
        if self.lora:
            unknown = sorted({str(a) for a in batch.adapters if a not in (self.adapters or [])})
            if unknown or len(batch.adapters) != batch.input_ids.shape[0]:
                raise ValueError(f"rows name adapters {unknown}, model {self.model_name!r} has {self.adapters}")
            routing = [str(a) for a in batch.adapters]
        return self.scorer(batch.input_ids, batch.targets, batch.loss_mask, routing)

    def micro_batch(self, samples: Sequence[Sample], keep_idx: Sequence[int], estimator: str) -> float:
        """Train on ``samples[i]`` for ``i`` in ``keep_idx`` (the others are stale: they only count in their groups'
        advantages); returns the loss.

        Each sample's advantage is the coordinator's where it set one, else ``estimator`` over the groups of this
        micro-batch's samples without one. ``reinforce_pp`` holds the samples for the step (whole-batch
        whitening). With a KL penalty in the rewards (``kl_in: reward``) the trainer, which holds the reference,
        computes every kept sample's advantage itself from its penalised reward, over the groups of the kept
        samples."""
        kept = [samples[i] for i in keep_idx]
        if self.batch_level:
            return self.hold(kept)
        if self.kl_reward:
            penalties = self.reward_penalties(kept)
            adv = micro_batch_advantages([s.reward - float(p.sum()) for s, p in zip(kept, penalties, strict=True)],
                                         [s.group_key for s in kept], [None] * len(kept), estimator)
            return self.accumulate(kept, adv.tolist())
        adv = micro_batch_advantages([s.reward for s in samples], [s.group_key for s in samples],
                                     [s.advantage for s in samples], estimator)
        return self.accumulate(kept, [float(adv[i]) for i in keep_idx])

    def accumulate(self, samples: Sequence[Sample], advantages: Sequence[float | np.ndarray]) -> float:
        """Forward + backward of one micro-batch (loss scaled by 1/global_batch), sub-batch by sub-batch; returns
        its loss. ``advantages``: one number per sample, or one array per sample with a value per response token
        (REINFORCE++ with a per-token reward penalty)."""
        if not samples:
            return 0.0
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        loss_sum = 0.0
        parts: list[dict[str, float]] = []
        for idx, batch in self._batches(samples):
            logp = self._logprobs(self.scorer, batch)
            ref = self._reference_logprobs(batch) if self.kl_loss else None
            adv = token_layout([advantages[i] for i in idx], batch.loss_mask)
            loss, stats = self._policy_loss(logp, batch.logp_behav, adv, batch.loss_mask, ref)
            self._backward(loss)
            loss_sum += float(loss.detach())
            parts.append(stats)
        self._add_stats(len(samples), loss_sum, parts)
        return loss_sum

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _logprobs(self, scorer: ResponseScorer, batch: Collated | SharedBatch) -> torch.Tensor:
        if isinstance(batch, SharedBatch):
            return scorer.shared(batch, self._routing(batch.adapters) if scorer is self.scorer else None)
        if scorer is not self.scorer:
            return scorer(batch.input_ids, batch.targets, batch.loss_mask, None)
        return self.token_logprobs(batch)

    def _reference_logprobs(self, batch: Collated | SharedBatch) -> torch.Tensor:
        """log pi_ref of the batch's response tokens, no gradient: the base of a LoRA model (adapters disabled),
        else the frozen copy of the starting weights."""
        assert self.reference is not None
        with torch.no_grad(), self._adapters_off():
            return self._logprobs(self.reference, batch)

    @contextlib.contextmanager
    def _adapters_off(self) -> Iterator[None]:
        """A LoRA model's base alone (its adapters disabled), then every adapter trainable again: peft's re-enable
        makes only its active adapter trainable, which would freeze the others from the first KL forward on."""
        if not self.lora:
            yield
            return
        try:
            with self.net.disable_adapter():  # type: ignore[operator]
                yield
        finally:
            for p in self.trainable:
                p.requires_grad_(True)

    def reward_penalties(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """kl_in reward: ``kl_coef * k_t(mu, pi_ref)`` per response token of each sample, from its behaviour
        log-probs and one no-grad forward of the reference (float64 arrays, in the samples' order)."""
        out = [np.zeros(0) for _ in samples]
        if self.reference is None:
            return out
        stats: list[dict[str, float]] = []
        for idx, batch in self._batches(samples):
            ref = self._reference_logprobs(batch)
            kl = kl_estimate(batch.logp_behav, ref, self.kl_estimator) * batch.loss_mask
            per_sample = token_values(kl, batch.loss_mask)
            for i, k in zip(idx, per_sample, strict=True):
                out[i] = self.kl_coef * k.astype(np.float64)
            n = float(batch.loss_mask.sum())
            stats.append({"kl_ref": float(kl.sum()) / max(n, 1.0), "tokens": n})
        self._reward_kl.append({**optstep.merge_token_stats(stats), "kl_penalty": float(sum(p.sum() for p in out)),
                                "samples": float(len(samples))})
        return out

    def _batches(self, samples: Sequence[Sample]) -> Iterator[tuple[list[int], Collated | SharedBatch]]:
        """(sample indices, their batch on the device) per sub-batch, skipping those without a response token.

        Sub-batches pad little (:func:`pack_rows`); with ``share_prompts`` each (adapter, prompt) group's prompt
        runs once (:func:`pack_shared`: a GRPO group's G samples cost one prompt and G responses, not G
        prompts)."""
        shared = self.share_prompts and self.scorer.split
        groups = prompt_groups(samples) if shared else [[i] for i in range(len(samples))]
        widths = [shared_width(samples, g) if shared else
                  int(samples[g[0]].prompt_ids.shape[0] + samples[g[0]].response_ids.shape[0]) for g in groups]
        for chosen in pack_rows(widths, self.pad_bound):
            idx = [i for c in chosen for i in groups[c]]
            picked = [samples[i] for i in idx]
            batch: Collated | SharedBatch = (pack_shared(picked, self.pad_id) if shared
                                             else collate(picked, self.pad_id)).to(self.device)
            if bool(batch.loss_mask.any()):
                yield idx, batch

    def _policy_loss(self, logp: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The configured policy loss of one sub-batch, divided by the global batch's sample count (token-mean:
        rescaled to its token count at the step), with the entropy bonus and the KL term (``kl_in: loss``,
        ``logp_ref`` the reference's log-probs) aggregated the same way.

        ``decoupled``: pi_prox is the policy of the weights this learner holds before the step. Every micro-batch
        of a step is computed with those weights (gradients accumulate, the optimizer steps once per global
        batch), so pi_prox is this forward's own log-probs, detached: the same numbers a second no-grad forward
        would give, without running it.
        """
        prox = logp.detach() if self.loss_name == "decoupled" else None
        settings = LossSettings(clip_eps=self.clip_eps, agg=self.loss_agg, denominator=self.global_batch,
                                clip_ratio_c=self.clip_ratio_c, behav_imp_weight_cap=self.behav_imp_weight_cap)
        loss, stats = self.policy_loss(PolicyBatch(logp, logp_behav, adv, mask, logp_prox=prox), settings)
        loss = regularised(loss, stats, mask, self.loss_agg, self.global_batch, entropy=self.scorer.last_entropy,
                           entropy_coef=self.entropy_coef, logp=logp, logp_ref=logp_ref, kl_coef=self.kl_coef,
                           kl_estimator=self.kl_estimator)
        return loss, stats

    def _add_stats(self, n: int, loss_sum: float, parts: Sequence[dict[str, float]]) -> None:
        self.accumulated += n
        self._loss_sum += loss_sum
        self._parts.extend(parts)

    @property
    def _tokens(self) -> float:
        """Response tokens accumulated for the next step (token-mean divides by them)."""
        return sum(p["tokens"] for p in self._parts)

    def _scale(self) -> float:
        """What the accumulated gradients are multiplied by at the step: each micro-batch was divided by
        ``global_batch``; the step divides by the samples it really has (or, token-mean, by their tokens)."""
        if self.loss_agg == "token-mean":
            return self.global_batch / max(self._tokens, 1.0)
        return self.global_batch / max(self.accumulated, 1)

    def _routing(self, adapters: Sequence[str | None]) -> list[str] | None:
        """Per-row adapter names for a LoRA model (checked), None for a full model."""
        if not self.lora:
            return None
        unknown = sorted({str(a) for a in adapters if a not in (self.adapters or [])})
        if unknown:
            raise ValueError(f"rows name adapters {unknown}, model {self.model_name!r} has {self.adapters}")
        return [str(a) for a in adapters]

    def ready(self) -> bool:
        """Whether the next step can run: ``global_batch`` samples are in, or, for MARFT, every sample of the
        on-policy batch the coordinator published whole (``batch_samples``, which may pass the global batch by
        the last task's overshoot)."""
        if self.marft and self._held:
            return self.accumulated >= max(s.batch_samples or self.global_batch for s in self._held)
        return self.accumulated >= self.global_batch

    def hold(self, samples: Sequence[Sample]) -> float:
        """Keep ``samples`` for the step (reinforce_pp: their advantages need the whole global batch)."""
        self._held.extend(samples)
        self.accumulated += len(samples)
        return 0.0

    def _flush(self) -> None:
        """Forward/backward of the held samples with REINFORCE++ advantages over all of them (token by token when
        a KL penalty is in the rewards)."""
        if not self._held:
            return
        held, self._held = self._held, []
        rewards = [s.reward for s in held]
        adv: Sequence[float | np.ndarray]
        if self.kl_reward:
            adv = batch_token_advantages(rewards, self.reward_penalties(held))
        else:
            adv = batch_advantages(rewards, [int(s.response_ids.shape[0]) for s in held]).tolist()
        self.accumulated -= len(held)  # accumulate counts them again
        self.accumulate(held, adv)

    def scaled_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients as the next step applies them (mean over the samples, before clipping)."""
        self._flush()
        scale = self._scale()
        return {n: p.grad.detach() * scale for n, p in self.net.named_parameters() if p.grad is not None}

    def step(self) -> StepResult | None:
        """Apply the optimizer once ``global_batch`` samples are in; returns None while fewer are."""
        if not self.ready():
            return None
        if self.marft:
            return marft_step(self)
        self._flush()
        n = self.accumulated
        # Each micro-batch divided by global_batch; a different count is renormalised to a mean over n.
        scale = self._scale()
        # An adapter with no rows in this batch has no gradient: AdamW leaves it exactly as it was.
        params = [p for p in self.trainable if p.grad is not None]
        if scale != 1.0:
            for p in params:
                assert p.grad is not None
                p.grad.mul_(scale)
        lr = optstep.scheduled_lr(self.optim, self.version, self.max_versions)
        grad_norm, skipped = optstep.apply(self.optimizer, params, lr, self.grad_clip)
        if not skipped:
            self.version += 1
        stats = optstep.step_stats(self._parts, lr, self._reward_kl)
        result = StepResult(self.version, n, self._loss_sum * scale, grad_norm, stats, skipped)
        self.accumulated = 0
        self._loss_sum = 0.0
        self._parts = []
        self._reward_kl = []
        return result

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight update carries, by name: every parameter, or only the adapters of a LoRA model."""
        return {name: t.detach() for name, t in shipped_tensors(self.net, self.lora).items()}

    def optimizer_state(self) -> dict[str, Any]:
        """AdamW's state_dict with every tensor copied to the CPU (what checkpoints and commits hold)."""
        return _to_cpu(self.optimizer.state_dict())

    def state_dict(self) -> dict[str, Any]:
        """Version, the shipped tensors (the frozen base of a LoRA model is rebuilt, not saved) and AdamW's
        state, all on the CPU."""
        return {"version": self.version, "model": {k: t.cpu() for k, t in self.named_tensors().items()},
                "optimizer": self.optimizer_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = self.named_tensors()
        saved: dict[str, torch.Tensor] = state["model"]
        if saved.keys() != own.keys():
            missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
            raise ValueError(f"checkpoint does not match model {self.model_name!r}: missing {missing[:3]}, "
                             f"unexpected {extra[:3]} (was it written with another models.{self.model_name} config?)")
        for name, t in own.items():
            if t.shape != saved[name].shape:
                raise ValueError(f"checkpoint {name}: shape {tuple(saved[name].shape)}, model has {tuple(t.shape)}")
        with torch.no_grad():
            for name, t in own.items():
                t.copy_(saved[name])  # across devices and into the model's dtype
        # torch moves each state tensor to its parameter's device (and dtype, except AdamW's step).
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0
        self._held = []
        self._loss_sum = 0.0
        self._parts = []
        self._reward_kl = []

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, directory: Path) -> Path:
        return save_checkpoint(self, directory)

    def restore_latest(self, directory: Path) -> Path | None:
        return restore_latest(self, directory)

    def close(self) -> None:
        """Nothing to release: the learner lives in this process."""


class _Stateful(Protocol):
    @property
    def version(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def save_checkpoint(learner: _Stateful, directory: Path) -> Path:
    """Write ``learner``'s ``v<version>.pt`` atomically (temp file + rename) so a crash never leaves half a
    checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"v{learner.version}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(learner.state_dict(), tmp)
    tmp.replace(path)
    return path


def restore_latest(learner: _Stateful, directory: Path) -> Path | None:
    """Load the newest ``v<N>.pt`` in ``directory`` into ``learner``; None when there is none."""
    path = latest_checkpoint(directory)
    if path is not None:
        # Read onto the CPU, then onto the device by load_state_dict (weights by copy_, AdamW's moments by torch's
        # own move): map_location=device would also put AdamW's step counters on the GPU, where a non-fused AdamW
        # reads each one back to the host every step.
        learner.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return path


def token_layout(advantages: Sequence[float | np.ndarray], mask: torch.Tensor) -> torch.Tensor:
    """Advantages in the layout of ``mask`` (rows = samples): [S] when each is one number, else [S, T] with each
    sample's per-token array written at its response positions (the set positions of its row, in order)."""
    if all(np.ndim(a) == 0 for a in advantages):
        return torch.as_tensor([float(a) for a in advantages], dtype=torch.float32, device=mask.device)
    arrays = [np.broadcast_to(np.asarray(a, dtype=np.float32), (int(n),)) if np.ndim(a) == 0 else
              np.asarray(a, dtype=np.float32) for a, n in zip(advantages, mask.sum(dim=1).tolist(), strict=True)]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    flat = torch.from_numpy(np.concatenate(arrays)) if arrays else torch.zeros(0)
    if flat.numel() != int((mask > 0).sum()):
        raise ValueError(f"{flat.numel()} per-token advantages for {int((mask > 0).sum())} response tokens")
    out[mask > 0] = flat.to(mask.device)
    return out


def token_values(values: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """Each row's values at its set ``mask`` positions, in order (the inverse of :func:`token_layout`)."""
    m = mask > 0
    return [values[i][m[i]].detach().cpu().numpy() for i in range(values.shape[0])]


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def latest_checkpoint(directory: Path) -> Path | None:
    """The ``v<N>.pt`` with the highest N, or None."""
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CKPT.match(p.name))]
    return max(found)[1] if found else None
