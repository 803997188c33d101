"""The torch learner: forward/backward of micro-batches, gradient accumulation, one optimizer step per global batch.

Knows nothing of NATS. Every method runs torch work, so the service calls it from one worker thread.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer.grpo import ppo_clip_loss
from shared.config import ChorusConfig
from shared.modeling import build_model
from shared.schemas import Sample
from shared.tokenizer import PAD_ID

_CKPT = re.compile(r"^v(\d+)\.pt$")


@dataclass
class Collated:
    """A right-padded batch: ``input_ids``/``attention_mask`` [B, L]; targets and masks on shifted positions [B, L-1]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    logp_behav: torch.Tensor


@dataclass
class StepResult:
    version: int
    samples: int
    loss: float
    grad_norm: float
    stats: dict[str, float] = field(default_factory=dict)


def collate(samples: Sequence[Sample]) -> Collated:
    """Prompt + response, right-padded; only response tokens are in the loss mask (logits shifted by one)."""
    seqs = [(s.prompt_ids.numpy().astype("int64"), s.response_ids.numpy().astype("int64"),
             s.behavior_logprobs.numpy().astype("float32")) for s in samples]
    width = max(len(p) + len(r) for p, r, _ in seqs)
    b = len(seqs)
    input_ids = torch.full((b, width), PAD_ID, dtype=torch.long)
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
    return Collated(input_ids, attention, input_ids[:, 1:], loss_mask, logp_behav)


def validate_sample(s: Sample) -> str | None:
    """Why a sample cannot be trained on, or None when it can."""
    from shared.tokenizer import VOCAB_SIZE

    for name, arr in (("prompt_ids", s.prompt_ids), ("response_ids", s.response_ids),
                      ("behavior_logprobs", s.behavior_logprobs)):
        if len(arr.shape) != 1:
            return f"sample {s.sample_id}: {name} must be 1-d, has shape {arr.shape}"
    if s.prompt_ids.shape[0] == 0:
        return f"sample {s.sample_id}: empty prompt_ids (expected at least BOS)"
    if s.response_ids.shape[0] != s.behavior_logprobs.shape[0]:
        return (f"sample {s.sample_id}: {s.response_ids.shape[0]} response ids but "
                f"{s.behavior_logprobs.shape[0]} behaviour log-probs")
    for name, arr in (("prompt_ids", s.prompt_ids), ("response_ids", s.response_ids)):
        if arr.dtype not in ("int32", "int64"):
            return f"sample {s.sample_id}: {name} dtype {arr.dtype}, expected int32 or int64"
        ids = arr.numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
            return f"sample {s.sample_id}: {name} has ids outside [0, {VOCAB_SIZE})"
    if s.behavior_logprobs.dtype not in ("float32", "float16"):
        return f"sample {s.sample_id}: behavior_logprobs dtype {s.behavior_logprobs.dtype}, expected float32"
    lp = s.behavior_logprobs.numpy()
    if lp.size and not (torch.isfinite(torch.from_numpy(lp.astype("float32"))).all() and (lp <= 1e-4).all()):
        return f"sample {s.sample_id}: behavior_logprobs must be finite and <= 0"
    return None


class Learner:
    """One model in train mode with AdamW; gradients accumulate across micro-batches until ``global_batch``."""

    def __init__(self, cfg: ChorusConfig, model: str) -> None:
        self.model_name = model
        self.global_batch = cfg.train.global_batch
        self.clip_eps = cfg.train.clip_eps
        optim = cfg.models[model].optim
        self.grad_clip = optim.grad_clip
        # Behaviour log-probs are taken after temperature, so pi_theta must be scored the same way.
        t = cfg.workflow.temperature
        self.temperature = t if t > 0 else 1.0
        self.net = build_model(cfg, model)
        self.net.train()
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        self.version = 0
        self.accumulated = 0
        self._loss_sum = 0.0
        self._stats_sum: dict[str, float] = {}

    def token_logprobs(self, batch: Collated) -> torch.Tensor:
        """log pi_theta of every next token, [B, L-1]."""
        out = self.net(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        logits = out.logits[:, :-1, :].float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    def accumulate(self, samples: Sequence[Sample], advantages: Sequence[float]) -> float:
        """Forward + backward of one micro-batch (loss scaled by 1/global_batch); returns its loss."""
        if not samples:
            return 0.0
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        batch = collate(samples)
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
        params = [p for p in self.net.parameters() if p.grad is not None]
        if scale != 1.0:
            for p in params:
                p.grad.mul_(scale)
        if self.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        result = StepResult(self.version, n, self._loss_sum * scale, grad_norm,
                            {k: v / n for k, v in self._stats_sum.items()})
        self.accumulated = 0
        self._loss_sum = 0.0
        self._stats_sum = {}
        return result

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters by name, the layout the rollouters load into."""
        return {name: p.detach() for name, p in self.net.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "model": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["model"])
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
