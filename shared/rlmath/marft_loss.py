"""MARFT's objectives in torch (Liao et al. 2025, §4.2.1 and Appendix A): the action-level probability ratio,
the clipped policy loss of eq. (6), the critic's clipped value loss and the approximate KL of the trust-region cut.

Symbols: pi_theta^m the policy of agent m, a_t^m its action (a whole generation in MARFT-A), w^{m,1..L} the
action's tokens, A_t the normalised advantage, epsilon the PPO clip.

    log pi(a | s, a^{1:m-1}) = sum_j log P(w^{m,j} | s, a^{1:m-1}, w^{m,1:j-1})     (eq. 7)
    normalised by the action's length (Tan et al. 2024): / 1 (none), / L (token), / words (word)
    r_t^m(theta) = pi_theta^m(a_t^m | ...) / pi_theta_old^m(a_t^m | ...)            (eq. 6, action level)
    L(theta) = 1/(nT) sum_m sum_t min(r_t^m A_t, clip(r_t^m, 1 - eps, 1 + eps) A_t)  maximised
"""

from __future__ import annotations

import torch

ACTION_NORMS = ("none", "token", "word")


def action_logprob(token_logp: torch.Tensor, mask: torch.Tensor, norm: str = "none",
                   words: torch.Tensor | None = None) -> torch.Tensor:
    """log pi of each action [B] from its tokens' log-probs [B, L] (``mask`` 1 on the action's tokens), divided by
    1 (``none``), the token count (``token``) or ``words`` [B], the action's word count (``word``)."""
    total = (token_logp * mask).sum(-1)
    if norm == "none":
        return total
    if norm == "token":
        return total / mask.sum(-1).clamp(min=1)
    if norm == "word":
        if words is None:
            raise ValueError("word normalisation needs each action's word count")
        return total / words.to(total.dtype).clamp(min=1)
    raise ValueError(f"action normalisation {norm!r}: one of {ACTION_NORMS}")


def action_ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """r(theta) = pi_theta(a) / pi_theta_old(a) from action log-probs (the same normalisation on both)."""
    return torch.exp(logp - logp_old)


def policy_loss(ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float, entropy: torch.Tensor | None = None,
                entropy_coef: float = 0.0) -> torch.Tensor:
    """The negative of eq. (6) over the actions given (the mean over them is the 1/(nT) sum), minus the entropy
    bonus ``entropy_coef`` * mean entropy."""
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    loss = -surrogate.mean()
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * entropy.mean()
    return loss


def _error_loss(err: torch.Tensor, huber_delta: float | None) -> torch.Tensor:
    """err^2 / 2, or Huber's loss with ``huber_delta`` (quadratic within it, linear beyond)."""
    if huber_delta is None:
        return 0.5 * err**2
    a = err.abs()
    return torch.where(a <= huber_delta, 0.5 * err**2, huber_delta * (a - 0.5 * huber_delta))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None,
               huber_delta: float | None = None) -> torch.Tensor:
    """The critic's loss against the GAE returns R: the larger of the loss of V and of the clipped
    V_old + clip(V - V_old, -clip, clip) (no clipping where ``clip`` is None), averaged."""
    loss = _error_loss(returns - values, huber_delta)
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.max(loss, _error_loss(returns - clipped, huber_delta))
    return loss.mean()


def approx_kl(token_logp: torch.Tensor, token_logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL[pi_old || pi_theta] estimated over the tokens (k3, Schulman 2020): the mean over the mask of
    (rho - 1) - log rho, rho = pi_theta / pi_old (unbiased and never negative)."""
    log_rho = (token_logp - token_logp_old) * mask
    k3 = (torch.exp(log_rho) - 1.0) - log_rho
    return (k3 * mask).sum() / mask.sum().clamp(min=1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R): 1 where the critic predicts the returns, 0 (or below) where it predicts nothing."""
    var = float(returns.var(unbiased=False))
    if var == 0.0:
        return float("nan")
    return 1.0 - float((returns - values).var(unbiased=False)) / var


__all__ = ["ACTION_NORMS", "action_logprob", "action_ratio", "approx_kl", "explained_variance", "policy_loss",
           "value_loss"]
