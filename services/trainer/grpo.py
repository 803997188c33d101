"""GRPO advantages and the PPO-clip surrogate against behaviour log-probs, as pure torch functions.

Symbols follow the papers: r_i rewards, A_i group-normalised advantages (GRPO, Shao et al. 2024),
rho_t = pi_theta(a_t|s_t) / mu(a_t|s_t) the ratio against the behaviour policy mu (decoupled PPO,
Hilton et al. 2022), epsilon the clip range.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

# exp() of a log-ratio above this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0


def group_advantages(rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable],
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps), population std per group; singleton/constant groups get 0."""
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if len(group_ids) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    index: dict[Hashable, int] = {}
    g = torch.tensor([index.setdefault(k, len(index)) for k in group_ids], dtype=torch.long)
    n_groups = len(index)
    count = torch.zeros(n_groups).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(n_groups).index_add_(0, g, r) / count.clamp(min=1)
    var = torch.zeros(n_groups).index_add_(0, g, (r - mean[g]) ** 2) / count.clamp(min=1)
    std = var.sqrt()
    adv = (r - mean[g]) / (std[g] + eps)
    # A group of one, or one where every reward is equal, carries no learning signal.
    degenerate = (count[g] < 2) | (std[g] == 0)
    return torch.where(degenerate, torch.zeros_like(adv), adv)


def ppo_clip_loss(logp_new: torch.Tensor, logp_behav: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float, global_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate, token-mean per sample, summed over the micro-batch and divided by ``global_batch``.

    Shapes: ``logp_*`` and ``mask`` are [B, T], ``advantages`` is [B]. Dividing by the global batch (not
    B) makes the gradients of several micro-batches add up to the gradient of one full-batch step.
    """
    mask = mask.to(logp_new.dtype)
    # rho_t = exp(log pi_theta - log mu)
    log_ratio = (logp_new - logp_behav).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp_new.dtype).unsqueeze(1)
    # L_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(surr1, surr2)
    tokens = mask.sum(dim=1)
    per_sample = (per_token * mask).sum(dim=1) / tokens.clamp(min=1.0)
    loss = per_sample.sum() / global_batch

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1.0)
        clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask
        stats = {
            "clip_frac": float(clipped.sum() / n_tok),
            "ratio_mean": float((ratio * mask).sum() / n_tok),
            "tokens": float(mask.sum()),
        }
    return loss, stats
