"""GRPO advantages and the PPO-clip surrogate against behaviour log-probs, as pure torch functions.

Symbols follow the papers: r_i rewards, A_i group-normalised advantages (GRPO, Shao et al. 2024),
rho_t = pi_theta(a_t|s_t) / mu(a_t|s_t) the ratio against the behaviour policy mu (decoupled PPO,
Hilton et al. 2022), epsilon the clip range.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from shared.advantages import group_advantages as shared_group_advantages

# exp() of a log-ratio above this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0


def group_advantages(rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable],
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps), population std per group; singleton/constant groups get 0.

    The formula lives in :mod:`shared.advantages`, shared with the coordinator's episode-complete grouping.
    """
    r = rewards.detach().cpu() if isinstance(rewards, torch.Tensor) else rewards
    return torch.from_numpy(shared_group_advantages(r, group_ids, eps)).to(torch.float32)


def micro_batch_advantages(rewards: Sequence[float], group_ids: Sequence[Hashable],
                           given: Sequence[float | None]) -> torch.Tensor:
    """A_i per sample: ``given[i]`` where the coordinator set it (grouping "episode"), else GRPO over the groups
    of the samples without one, within this micro-batch (grouping "trainer")."""
    if not len(rewards) == len(group_ids) == len(given):
        raise ValueError(f"{len(rewards)} rewards, {len(group_ids)} group ids and {len(given)} advantages: "
                         "expected one of each per sample")
    adv = torch.zeros(len(rewards), dtype=torch.float32)
    todo = [i for i, a in enumerate(given) if a is None]
    if todo:
        adv[todo] = group_advantages([rewards[i] for i in todo], [group_ids[i] for i in todo])
    for i, a in enumerate(given):
        if a is not None:
            if not math.isfinite(a):
                raise ValueError(f"sample {i}: advantage must be a finite number, got {a!r}")
            adv[i] = a
    return adv


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
