"""The tail of every optimizer step, one place for the torch learner, MARFT's step and the DeepSpeed group: the
scheduled lr of the version being made, the gradient norm (clipped at ``optim.grad_clip``), the skip of an update
whose gradients are not finite, and the step's statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shared.kernel.config import OptimSection
from shared.rlmath.schedules import lr_factor


def scheduled_lr(optim: OptimSection, version: int, max_versions: int) -> float:
    """The lr of the step that makes version ``version + 1`` (docs/algorithms.md, optim.schedule)."""
    return optim.lr * lr_factor(version + 1, max_versions, optim.schedule, optim.warmup_versions, optim.min_lr_ratio)


def set_lr(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(params: Sequence[torch.Tensor], clip: float) -> float:
    """The total gradient norm of ``params``, clipped to ``clip`` when it is > 0 (the norm before clipping)."""
    if clip > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, clip))
    return float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))) if params else 0.0


def apply(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], lr: float, clip: float, *,
          update: bool = True) -> tuple[float, bool]:
    """Clip, then step at ``lr`` unless the norm is not finite (a NaN or inf anywhere in the gradients would reach
    every weight through AdamW) or ``update`` is False; the gradients are cleared either way. Returns (the
    gradient norm, whether the update was skipped for a non-finite norm)."""
    norm = grad_norm(params, clip) if params else 0.0
    skipped = bool(params) and not math.isfinite(norm)
    if update and params and not skipped:
        set_lr(optimizer, lr)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def merge_token_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """A loss's stats of sub-batches as one batch's: ``tokens`` summed, ``*_max`` the largest, the others (token
    means) weighted by their tokens."""
    if not parts:
        return {}
    tokens = sum(p["tokens"] for p in parts)
    merged = {k: (max(p[k] for p in parts) if k.endswith("_max")
                  else sum(p[k] * p["tokens"] for p in parts) / max(tokens, 1.0))
              for k in parts[0] if k != "tokens"}
    return {**merged, "tokens": tokens}


def step_stats(parts: Sequence[dict[str, float]], lr: float, reward_kl: Sequence[dict[str, float]]) -> dict[str, float]:
    """The step record's loss statistics: token means over the step (``*_max`` its largest), the lr, and with a KL
    penalty in the rewards (``kl_in: reward``) k_t(mu, ref)'s token mean and the mean penalty per sample."""
    stats = {"tokens": 0.0, **merge_token_stats(parts), "lr": lr}
    if reward_kl:
        pen = sum(p["kl_penalty"] for p in reward_kl) / max(sum(p["samples"] for p in reward_kl), 1.0)
        stats.update(kl_ref=merge_token_stats(reward_kl)["kl_ref"], kl_reward_penalty=pen)
    return stats
