"""GRPO advantages and the PPO-clip surrogate against behaviour log-probs, as pure torch functions.

Symbols follow the papers: r_i rewards, A_i group-normalised advantages (GRPO, Shao et al. 2024),
rho_t = pi_theta(a_t|s_t) / mu(a_t|s_t) the ratio against the behaviour policy mu (decoupled PPO,
Hilton et al. 2022), epsilon the clip range.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from shared.rlmath.advantages import EPS, estimate

# exp() of a log-ratio above this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0


def group_advantages(rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable],
                     eps: float = EPS, estimator: str = "grpo") -> torch.Tensor:
    """A_i of a group estimator within each group, float32; GRPO by default: A_i = (r_i - mean_g(r)) /
    (std_g(r) + eps), population std per group; singleton/constant groups get 0.

    The formulas live in :mod:`shared.rlmath.advantages`, shared with the coordinator's episode-complete grouping.
    """
    r = rewards.detach().cpu() if isinstance(rewards, torch.Tensor) else rewards
    return torch.from_numpy(estimate(r, group_ids, estimator, eps)).to(torch.float32)


def micro_batch_advantages(rewards: Sequence[float], group_ids: Sequence[Hashable],
                           given: Sequence[float | None], estimator: str = "grpo") -> torch.Tensor:
    """A_i per sample: ``given[i]`` where the coordinator set it (grouping "episode"), else the group estimator
    over the groups of the samples without one, within this micro-batch (grouping "trainer")."""
    if not len(rewards) == len(group_ids) == len(given):
        raise ValueError(f"{len(rewards)} rewards, {len(group_ids)} group ids and {len(given)} advantages: "
                         "expected one of each per sample")
    adv = torch.zeros(len(rewards), dtype=torch.float32)
    todo = [i for i, a in enumerate(given) if a is None]
    if todo:
        adv[todo] = group_advantages([rewards[i] for i in todo], [group_ids[i] for i in todo], estimator=estimator)
    for i, a in enumerate(given):
        if a is not None:
            if not math.isfinite(a):
                raise ValueError(f"sample {i}: advantage must be a finite number, got {a!r}")
            adv[i] = a
    return adv


LOSSES = ("ppo_clip", "decoupled")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")


def policy_loss_terms(logp_new: torch.Tensor, logp_behav: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, *, clip_eps: float, loss: str = "ppo_clip",
                      logp_prox: torch.Tensor | None = None, clip_ratio_c: float | None = None,
                      behav_imp_weight_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token policy loss ``L_t`` [B, T] (masked tokens 0) and its token statistics.

    ``loss="ppo_clip"`` (the trust region centred on the behaviour policy mu; verl's bypass mode)::

        rho_t = pi_theta / mu,   L_t = max(-A rho_t, -A clip(rho_t, 1 - eps, 1 + eps))

    ``loss="decoupled"`` (decoupled PPO, Hilton et al. 2022, as AReaL implements it): the trust region is centred
    on the proximal policy pi_prox and the behaviour policy enters only as an importance weight::

        r_t = pi_theta / pi_prox,  w_t = pi_prox / mu,   L_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps, 1 + eps))

    with ``w_t = 0`` where ``w_t > behav_imp_weight_cap`` (the token leaves the loss) when a cap is set.
    Dual-clip (``clip_ratio_c`` = c > 1, Ye et al. 2020, verl's default 3) bounds a negative-advantage token:
    ``L_t = min(L_t, -c A)`` where ``A < 0`` (before the weight ``w_t``, as AReaL applies it).
    ``advantages`` is [B] (one per sample) or [B, T].
    """
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {LOSSES}")
    if loss == "decoupled" and logp_prox is None:
        raise ValueError("the decoupled loss needs the proximal log-probs logp_prox")
    mask = mask.to(logp_new.dtype)
    adv = advantages.to(logp_new.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    anchor = logp_behav if loss == "ppo_clip" else logp_prox
    assert anchor is not None
    # rho_t = exp(log pi_theta - log anchor), anchor = mu (ppo_clip) or pi_prox (decoupled)
    log_ratio = (logp_new - anchor.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1  # the clipped term is the one used (its gradient is zero)
    dual = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        # L_t = min(L_t, -c A) for A < 0: a negative-advantage token's loss is at most c |A|
        bound = -clip_ratio_c * adv
        dual = (adv < 0) & (bound < per_token)
        per_token = torch.where(dual, bound.expand_as(per_token), per_token)
    if loss == "decoupled":
        assert logp_prox is not None
        # w_t = pi_prox / mu, a constant of the step (no gradient)
        weight = torch.exp((logp_prox - logp_behav).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        kept = mask > 0
        if behav_imp_weight_cap is not None:
            kept = kept & (weight <= behav_imp_weight_cap)
        weight = torch.where(kept, weight, torch.zeros_like(weight))
        per_token = per_token * weight
    else:
        weight = ratio.detach()
    per_token = per_token * mask

    with torch.no_grad():
        m = mask > 0
        n_tok = float(m.sum())
        denom = max(n_tok, 1.0)

        def mean(x: torch.Tensor) -> float:
            return float((x.to(mask.dtype) * mask).sum() / denom)

        stats = {
            "clip_frac": mean(clipped),
            "dual_clip_frac": mean(dual),
            "ratio_mean": mean(ratio),
            # k1 estimates of KL(anchor || pi_theta) on the sampled tokens (verl's ppo_kl)
            "approx_kl_mu": mean(logp_behav - logp_new),
            "is_weight_mean": mean(weight),
            "is_weight_max": float(weight[m].max()) if n_tok else 0.0,
            "tokens": n_tok,
        }
        if loss == "decoupled":
            assert logp_prox is not None
            stats["approx_kl_prox"] = mean(logp_prox - logp_new)
            stats["is_weight_capped_frac"] = mean(m & (weight == 0))
    return per_token, stats


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float) -> torch.Tensor:
    """The scalar loss of per-token losses [B, T] (already 0 where masked), as verl's ``agg_loss`` defines it:

    - ``seq-mean-token-mean``: sum_i (sum_t L_it / |o_i|) / denominator  (each sample's token mean; the
      denominator is the global batch's sample count, so micro-batches add up to the batch's mean)
    - ``seq-mean-token-sum``:  sum_i sum_t L_it / denominator  (sample sums, mean over samples)
    - ``token-mean``:          sum_i sum_t L_it / denominator  (the denominator is the global batch's count of
      response tokens: every token weighs the same, long answers weigh more)

    A sample with no response token contributes 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is not one of {AGGREGATIONS}")
    if mode == "seq-mean-token-mean":
        tokens = mask.to(per_token.dtype).sum(dim=1).clamp(min=1.0)
        return (per_token.sum(dim=1) / tokens).sum() / denominator
    return per_token.sum() / denominator


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens (Schulman 2020, "Approximating
    KL divergence"), as verl's ``kl_penalty`` computes them. With log r_t = log pi_ref - log pi::

        k1 = -log r_t                  = log pi - log pi_ref     (unbiased, high variance, can be negative)
        k2 = (log r_t)^2 / 2                                     (verl's "mse")
        k3 = r_t - 1 - log r_t                                   (unbiased, low variance, >= 0; verl's "low_var_kl")

    k3's log r_t is clamped to [-20, 20] and its value to [-10, 10], as verl's ``low_var_kl``. Gradients flow
    through ``logp`` (the reference is a constant).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    diff = logp - logp_ref.detach()  # log pi - log pi_ref = -log r_t
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    log_r = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(-10.0, 10.0)


def ppo_clip_loss(logp_new: torch.Tensor, logp_behav: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float, global_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate against mu, token-mean per sample, summed over the micro-batch and divided by
    ``global_batch`` (no dual-clip): :func:`policy_loss_terms` + :func:`aggregate_loss`.

    Shapes: ``logp_*`` and ``mask`` are [B, T], ``advantages`` is [B]. Dividing by the global batch (not
    B) makes the gradients of several micro-batches add up to the gradient of one full-batch step.
    """
    per_token, stats = policy_loss_terms(logp_new, logp_behav, advantages, mask, clip_eps=clip_eps)
    return aggregate_loss(per_token, mask, "seq-mean-token-mean", global_batch), stats
