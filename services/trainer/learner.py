"""The torch learner: forward/backward of micro-batches, gradient accumulation, one optimizer step per global batch.

Knows nothing of NATS. Every method runs torch work, so the service calls it from one worker thread. A LoRA
model trains only its adapters: each micro-batch is one pass with every row routed to its sample's adapter,
so all adapters of the base move in the same optimizer step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer.grpo import ppo_clip_loss
from shared.config import ChorusConfig
from shared.models import context_length, load_model, load_tokenizer, shipped_tensors
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
        self.clip_eps = cfg.train.clip_eps
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
        self.net = load_model(cfg, model)
        self.net.train(not self.lora)
        self.vocab_size = int(self.net.get_input_embeddings().num_embeddings)
        self.context = context_length(self.net)
        self.trainable = [p for p in self.net.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        self.version = 0
        self.accumulated = 0
        self._loss_sum = 0.0
        self._stats_sum: dict[str, float] = {}

    def validate(self, sample: Sample) -> str | None:
        """Why this learner cannot train on ``sample`` (ids outside its vocabulary, an adapter it lacks), or None."""
        return validate_sample(sample, self.vocab_size, self.adapters, self.context)

    def token_logprobs(self, batch: Collated) -> torch.Tensor:
        """log pi_theta of every next token, [B, L-1]; a LoRA model runs each row through its sample's adapter."""
        routing: dict[str, Any] = {}
        if self.lora:
            unknown = sorted({str(a) for a in batch.adapters if a not in (self.adapters or [])})
            if unknown or len(batch.adapters) != batch.input_ids.shape[0]:
                raise ValueError(f"rows name adapters {unknown}, model {self.model_name!r} has {self.adapters}")
            routing["adapter_names"] = list(batch.adapters)
        out = self.net(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **routing)
        logits = out.logits[:, :-1, :].float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    def accumulate(self, samples: Sequence[Sample], advantages: Sequence[float]) -> float:
        """Forward + backward of one micro-batch (loss scaled by 1/global_batch); returns its loss."""
        if not samples:
            return 0.0
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        batch = collate(samples, self.pad_id)
        logp = self.token_logprobs(batch)
        adv = torch.as_tensor(list(advantages), dtype=torch.float32)
        loss, stats = ppo_clip_loss(logp, batch.logp_behav, adv, batch.loss_mask, self.clip_eps, self.global_batch)
        loss.backward()
        self.accumulated += len(samples)
        self._loss_sum += float(loss.detach())
        for k, v in stats.items():
            self._stats_sum[k] = self._stats_sum.get(k, 0.0) + v * len(samples)
        return float(loss.detach())

    def ready(self) -> bool:
        return self.accumulated >= self.global_batch

    def scaled_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients as the next step applies them (mean over the samples, before clipping)."""
        scale = self.global_batch / max(self.accumulated, 1)
        return {n: p.grad.detach() * scale for n, p in self.net.named_parameters() if p.grad is not None}

    def step(self) -> StepResult | None:
        """Apply the optimizer once ``global_batch`` samples are in; returns None while fewer are."""
        if not self.ready():
            return None
        n = self.accumulated
        # Each micro-batch divided by global_batch; a different count is renormalised to a mean over n.
        scale = self.global_batch / n
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
        result = StepResult(self.version, n, self._loss_sum * scale, grad_norm,
                            {k: v / n for k, v in self._stats_sum.items()}, skipped)
        self.accumulated = 0
        self._loss_sum = 0.0
        self._stats_sum = {}
        return result

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight update carries, by name: every parameter, or only the adapters of a LoRA model."""
        return {name: t.detach() for name, t in shipped_tensors(self.net, self.lora).items()}

    def state_dict(self) -> dict[str, Any]:
        """Version, the shipped tensors (the frozen base of a LoRA model is rebuilt, not saved) and AdamW's state."""
        return {"version": self.version, "model": self.named_tensors(), "optimizer": self.optimizer.state_dict()}

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
                t.copy_(saved[name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0
        self._loss_sum = 0.0
        self._stats_sum = {}

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
            self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return path


def latest_checkpoint(directory: Path) -> Path | None:
    """The ``v<N>.pt`` with the highest N, or None."""
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CKPT.match(p.name))]
    return max(found)[1] if found else None
