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

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer.grpo import aggregate_loss, policy_loss_terms
from services.trainer.logprobs import (
    PAD_BOUND,
    ResponseScorer,
    pack_rows,
    pack_shared,
    prompt_groups,
    shared_width,
)
from shared.advantages import batch_advantages
from shared.config import ChorusConfig
from shared.models import context_length, load_model, load_tokenizer, resolve_device, shipped_tensors
from shared.schemas import Sample
from shared.validation import arrays_problem, numbers_problem

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
        train = cfg.train
        self.clip_eps = train.clip_eps
        self.loss_name, self.loss_agg = train.loss, train.loss_agg
        self.clip_ratio_c, self.behav_imp_weight_cap = train.clip_ratio_c, train.behav_imp_weight_cap
        self.entropy_coef = train.entropy_coef
        # reinforce_pp normalises over the global batch: its samples are held until the batch is in
        self.batch_level = train.advantage == "reinforce_pp"
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
        self.pad_id = load_tokenizer(cfg, model).pad_id
        self.device = resolve_device(cfg, model)
        self.net = load_model(cfg, model, self.device)
        self.net.train(not self.lora)
        self.vocab_size = int(self.net.get_input_embeddings().num_embeddings)
        self.context = context_length(self.net)
        self.scorer = ResponseScorer(self.net, self.temperature)
        self.scorer.entropy = "bonus" if train.entropy_coef > 0 else "metric"
        self.pad_bound = PAD_BOUND  # inf: every micro-batch in one pass
        self.share_prompts = True  # samples with one prompt run it once (False: one row per sample)
        self.trainable = [p for p in self.net.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        self.version = 0
        self.accumulated = 0
        self._loss_sum = 0.0
        self._parts: list[dict[str, float]] = []  # loss statistics of each sub-batch since the last step

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

    def accumulate(self, samples: Sequence[Sample], advantages: Sequence[float]) -> float:
        """Forward + backward of one micro-batch (loss scaled by 1/global_batch), sub-batch by sub-batch; returns
        its loss."""
        if not samples:
            return 0.0
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        adv = torch.as_tensor(list(advantages), dtype=torch.float32)
        if self.share_prompts and self.scorer.split:
            return self._accumulate_shared(samples, adv)
        lengths = [s.prompt_ids.shape[0] + s.response_ids.shape[0] for s in samples]
        loss_sum = 0.0
        parts: list[dict[str, float]] = []
        for rows in pack_rows(lengths, self.pad_bound):
            batch = collate([samples[i] for i in rows], self.pad_id).to(self.device)
            if not bool(batch.loss_mask.any()):
                continue  # empty responses: no term in the loss, nothing to run
            logp = self.token_logprobs(batch)
            loss, stats = self._policy_loss(logp, batch.logp_behav, adv[rows].to(self.device), batch.loss_mask)
            loss.backward()
            loss_sum += float(loss.detach())
            parts.append(stats)
        self._add_stats(len(samples), loss_sum, parts)
        return loss_sum

    def _accumulate_shared(self, samples: Sequence[Sample], adv: torch.Tensor) -> float:
        """:meth:`accumulate` with each (adapter, prompt) group's prompt run once (:func:`pack_shared`): a GRPO
        group's G samples cost one prompt and G responses, not G prompts. The packed rows are cut into
        sub-batches that pad little, like single samples are."""
        groups = prompt_groups(samples)
        widths = [shared_width(samples, g) for g in groups]
        loss_sum = 0.0
        parts: list[dict[str, float]] = []
        for chosen in pack_rows(widths, self.pad_bound):
            idx = [i for c in chosen for i in groups[c]]
            batch = pack_shared([samples[i] for i in idx], self.pad_id).to(self.device)
            if not bool(batch.loss_mask.any()):
                continue
            logp = self.scorer.shared(batch, self._routing(batch.adapters))
            loss, stats = self._policy_loss(logp, batch.logp_behav, adv[idx].to(self.device), batch.loss_mask)
            loss.backward()
            loss_sum += float(loss.detach())
            parts.append(stats)
        self._add_stats(len(samples), loss_sum, parts)
        return loss_sum

    def _policy_loss(self, logp: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The configured policy loss of one sub-batch, divided by the global batch's sample count (token-mean:
        rescaled to its token count at the step).

        ``decoupled``: pi_prox is the policy of the weights this learner holds before the step. Every micro-batch
        of a step is computed with those weights (gradients accumulate, the optimizer steps once per global
        batch), so pi_prox is this forward's own log-probs, detached: the same numbers a second no-grad forward
        would give, without running it.
        """
        prox = logp.detach() if self.loss_name == "decoupled" else None
        per_token, stats = policy_loss_terms(logp, logp_behav, adv, mask, clip_eps=self.clip_eps, loss=self.loss_name,
                                             logp_prox=prox, clip_ratio_c=self.clip_ratio_c,
                                             behav_imp_weight_cap=self.behav_imp_weight_cap)
        loss = aggregate_loss(per_token, mask, self.loss_agg, self.global_batch)
        entropy = self.scorer.last_entropy
        if entropy is not None:
            mask = mask.to(entropy.dtype)
            stats["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1.0))
            if self.entropy_coef > 0:
                # L = L_pg - c_H * agg(H_t): maximising the entropy of the policy at the response positions
                loss = loss - self.entropy_coef * aggregate_loss(entropy * mask, mask, self.loss_agg, self.global_batch)
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
        return self.accumulated >= self.global_batch

    def hold(self, samples: Sequence[Sample]) -> float:
        """Keep ``samples`` for the step (reinforce_pp: their advantages need the whole global batch)."""
        self._held.extend(samples)
        self.accumulated += len(samples)
        return 0.0

    def _flush(self) -> None:
        """Forward/backward of the held samples with REINFORCE++ advantages over all of them."""
        if not self._held:
            return
        held, self._held = self._held, []
        adv = batch_advantages([s.reward for s in held], [int(s.response_ids.shape[0]) for s in held])
        self.accumulated -= len(held)  # accumulate counts them again
        self.accumulate(held, adv.tolist())

    def scaled_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients as the next step applies them (mean over the samples, before clipping)."""
        self._flush()
        scale = self._scale()
        return {n: p.grad.detach() * scale for n, p in self.net.named_parameters() if p.grad is not None}

    def step(self) -> StepResult | None:
        """Apply the optimizer once ``global_batch`` samples are in; returns None while fewer are."""
        if not self.ready():
            return None
        self._flush()
        n = self.accumulated
        # Each micro-batch divided by global_batch; a different count is renormalised to a mean over n.
        scale = self._scale()
        # An adapter with no rows in this batch has no gradient: AdamW leaves it exactly as it was.
        params = [p for p in self.trainable if p.grad is not None]
        if scale != 1.0:
            for p in params:
                p.grad.mul_(scale)
        if self.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        # A NaN or inf anywhere in the gradients would reach every weight through AdamW: skip the update.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"tokens": 0.0, **merge_token_stats(self._parts)}  # token means over the step, *_max its largest
        result = StepResult(self.version, n, self._loss_sum * scale, grad_norm, stats, skipped)
        self.accumulated = 0
        self._loss_sum = 0.0
        self._parts = []
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

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, directory: Path) -> Path:
        """Write ``v<version>.pt`` atomically (temp file + rename) so a crash never leaves half a checkpoint."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"v{self.version}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(path)
        return path

    def restore_latest(self, directory: Path) -> Path | None:
        """Load the newest ``v<N>.pt`` in ``directory``; None when there is none."""
        path = latest_checkpoint(directory)
        if path is not None:
            # Read onto the CPU, then onto the device by load_state_dict (weights by copy_, AdamW's moments by
            # torch's own move): map_location=device would also put AdamW's step counters on the GPU, where a
            # non-fused AdamW reads each one back to the host every step.
            self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return path


def merge_token_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """:func:`policy_loss_terms` stats of sub-batches as one batch's: ``tokens`` summed, ``*_max`` the largest,
    the others (token means) weighted by their tokens."""
    if not parts:
        return {}
    tokens = sum(p["tokens"] for p in parts)
    merged = {k: (max(p[k] for p in parts) if k.endswith("_max")
                  else sum(p[k] * p["tokens"] for p in parts) / max(tokens, 1.0))
              for k in parts[0] if k != "tokens"}
    return {**merged, "tokens": tokens}


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
